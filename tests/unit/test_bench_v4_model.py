"""bench/v4_model.py at toy widths on the CPU: the script runs every part (ours through the Engine with placed
contexts, transformers eager, the floors), and both models really get the same weights (same greedy tokens)."""

from __future__ import annotations

import torch

from bench import v4_model
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.loader import LoadedModel
from shared.engine.loader.deepseek_v4 import parse_spec


def test_the_bench_runs_ours_transformers_and_the_floors() -> None:
    out = v4_model.main(["--tiny", "--shape", "3x16", "--batches", "2", "--ctx", "40", "--prefill", "32",
                         "--steps", "1"])
    rows = [line for line in out.splitlines() if line.startswith("| 3x16 |")]
    assert [r.split(" | ")[1:4] for r in rows] == [["decode", "2", "40"], ["prefill", "1", "32"]]
    for r in rows:
        cells = [c.strip() for c in r.split("|")]
        # ours, (ours without CUDA graphs: GPU only), transformers, % of floor
        assert cells[5].endswith(" ms") and cells[8].endswith(" ms") and cells[12].endswith(" %"), r


def test_ours_and_transformers_get_the_same_weights() -> None:
    config = v4_model.hf_config(3, 16, tiny=True)
    spec = parse_spec(config.to_dict())
    weights = v4_model.RandomWeights(spec, torch.device("cpu"))
    reference = v4_model.hf_model(config, weights, torch.device("cpu"), torch.float32)
    engine = Engine(LoadedModel("tiny", v4_model.model_config(spec), weights), kv_blocks=16)
    prompt = [(5 * t + 1) % spec.vocab_size for t in range(20)]
    ours = run_to_completion(engine, [EngineRequest("r", prompt, v4_model.GREEDY, 3)])["r"]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(reference(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert ours == ids[len(prompt):]
