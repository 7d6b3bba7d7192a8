"""bench/v4_model.py at toy widths on the CPU: the script runs every part (ours through the Engine with placed
contexts, transformers eager, the floors), and both models really get the same weights (same greedy tokens)."""

from __future__ import annotations

import torch

from bench import v4_model
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.loader import LoadedModel
from shared.engine.loader.deepseek_v4 import parse_spec
from shared.engine.loader.dummy import QuantizedWeights, RandomWeights, quantized_kind, v4_table


def test_the_bench_runs_ours_transformers_and_the_floors() -> None:
    out = v4_model.main(["--tiny", "--shape", "3x16", "--batches", "2", "--ctx", "40", "--prefill", "32",
                         "--steps", "1"])
    rows = [line for line in out.splitlines() if line.startswith("| 3x16 |")]
    assert [r.split(" | ")[1:4] for r in rows] == [["decode", "2", "40"], ["prefill", "1", "32"]]
    for r in rows:
        cells = [c.strip() for c in r.split("|")]
        # ours, (ours without CUDA graphs: GPU only), transformers, % of floor
        assert cells[5].endswith(" ms") and cells[8].endswith(" ms") and cells[13].endswith(" %"), r


def test_the_quantized_rows_run_and_read_fewer_bytes() -> None:
    """--quantized: the shape with FP8 / FP4 weights quantized in memory (on the CPU the model dequantizes them:
    the script's path, not the kernels), its byte floor beside bf16's."""
    out = v4_model.main(["--tiny", "--quantized", "--shape", "4x8q", "--batches", "1", "--ctx", "40",
                         "--prefill", "32", "--steps", "1", "--skip-hf"])
    rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if line.startswith("| 4x8q |")]
    assert [r[2] for r in rows] == ["decode", "prefill"]
    for r in rows:
        assert r[5].endswith(" ms") and r[8] == "not run (quantized)" and float(r[10]) < float(r[11]), r
    assert "(bf16: " in out


def test_flash_quantized_weights_are_about_80_gb() -> None:
    """The issue's shape: 43 layers x 128 routed experts as DeepSeek ships them, ~80 GB (a bf16 copy ~4x that);
    its batch-1 byte floor well under half the bf16 one."""
    spec = parse_spec(v4_model.hf_config(43, 128, tiny=False).to_dict())
    dense = RandomWeights(v4_table(spec), "cpu")
    quantized = QuantizedWeights(dense.table, "cpu")
    assert 70 < quantized.nbytes(2) / 1e9 < 90 and dense.nbytes(2) > 3.5 * quantized.nbytes(2)
    assert quantized_kind("layers.3.attn.compressor.wgate.weight", (1024, 4096)) == "fp8"
    assert quantized_kind("layers.3.ffn.gate.weight", (128, 4096)) is None
    q, bf16 = v4_model.ModelCosts(spec, 2, quantized=True), v4_model.ModelCosts(spec, 2)
    assert q.decode(1, 4096)[0] < 0.45 * bf16.decode(1, 4096)[0]
    assert q.decode(1, 4096)[1] == bf16.decode(1, 4096)[1]


def test_ours_and_transformers_get_the_same_weights() -> None:
    config = v4_model.hf_config(3, 16, tiny=True)
    spec = parse_spec(config.to_dict())
    weights = RandomWeights(v4_table(spec), "cpu")
    reference = v4_model.hf_model(config, weights, torch.device("cpu"), torch.float32)
    engine = Engine(LoadedModel("tiny", v4_model.model_config(spec), weights), kv_blocks=16)
    prompt = [(5 * t + 1) % spec.vocab_size for t in range(20)]
    ours = run_to_completion(engine, [EngineRequest("r", prompt, v4_model.GREEDY, 3)])["r"]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(reference(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert ours == ids[len(prompt):]
