"""`--load-format dummy` (shared/engine/loader/dummy.py): weights drawn from config.json alone, the same in every
load, never the real checkpoint's; the engine serves them under a cache id of their own; the worker flag, the
launcher and its preflight take it; what cannot have dummy weights is refused by name."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from shared.config import add_common_args
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.loader import LOAD_FORMATS, load
from shared.engine.loader.dummy import RandomWeights, quantized_kind, v4_table
from shared.engine.quant import Fp4Weight, Fp8Weight, Weight, quantize_fp4, quantize_fp8
from shared.engine.random_model import random_llama
from shared.launch import cli_up
from shared.launch.launcher import build_plan
from shared.launch.preflight import PreflightError, check_model
from shared.models import ModelFiles, resolve
from shared.schemas.generate import SamplingParams
from shared.worker import config as worker_config
from shared.worker.config import WorkerConfig, add_worker_args
from tests import v4_checkpoints

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "max_position_embeddings": 512, "eos_token_id": 2}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny V4 checkpoint with real (transformers-initialised) weights."""
    path = tmp_path_factory.mktemp("v4") / "tiny-v4"
    v4_checkpoints.build(path, "mixed")
    return path


@pytest.fixture(scope="module")
def config_only(real: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model's config.json and nothing else."""
    path = tmp_path_factory.mktemp("dummy") / "tiny-v4"
    path.mkdir()
    shutil.copy(real / "config.json", path / "config.json")
    return path


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny V4 checkpoint as DeepSeek's release spells it, FP8 linears and FP4 routed experts with `.scale`
    tensors and a quantization_config; a directory holding only its config.json)."""
    root = tmp_path_factory.mktemp("v4q")
    v4_checkpoints.save_hub_dialect(v4_checkpoints.build(root / "hf", "mixed"), root / "hub", quantize=True)
    alone = root / "alone" / "tiny-v4-fp8"
    alone.mkdir(parents=True)
    shutil.copy(root / "hub" / "config.json", alone / "config.json")
    return root / "hub", alone


def _served_as(w: Weight) -> tuple:
    """What the model is handed: the kind, shape and dtypes (and block) of a loaded weight, not its values."""
    if isinstance(w, (Fp8Weight, Fp4Weight)):
        return (type(w).__name__, tuple(w.shape), w.data.dtype, tuple(w.scale.shape), w.scale.dtype, w.block)
    return ("dense", tuple(w.shape), w.dtype)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "dequantized"])
def test_quantized_dummy_weights_are_served_as_the_quantized_checkpoints_are(quantized: tuple[Path, Path],
                                                                             keep: bool) -> None:
    """config.json's quantization_config: dummy hands the model what the loader makes of the FP8 / FP4 release,
    name for name: Fp8Weight / Fp4Weight kept (a GPU), bfloat16 dequantized (a CPU), the rest dense. Where the
    test release quantizes otherwise than dummy's rule (DeepSeek's release as bench/v4_model.py has it) only:
    the test release quantizes its head (for the FP8 head GEMM) and, its rule testing the suffix "gate.weight",
    leaves the compressors' wgate dense."""
    hub, alone = quantized
    real = load(resolve(str(hub)), keep_quantized=keep)
    dummy = load(resolve(str(alone)), keep_quantized=keep, load_format="dummy")
    assert set(dummy.weights) == set(real.weights)
    served = {name: _served_as(dummy.weights[name]) for name in dummy.weights}
    assert {s[0] for s in served.values()} == ({"Fp8Weight", "Fp4Weight", "dense"} if keep else {"dense"})
    table = dummy.weights.table
    differ = {n for n, d in table.items() if v4_checkpoints.quantized_kind(n, torch.empty(d.shape, device="meta"))
              != quantized_kind(n, d.shape)}
    assert differ == {"head.weight"} | {n for n in table if n.endswith("compressor.wgate.weight")}
    for name, w in real.weights.items():
        if name not in differ:
            assert served[name] == _served_as(w), name


def test_quantized_dummy_weights_are_the_dense_draws_quantized(quantized: tuple[Path, Path]) -> None:
    """The same numbers as the dense dummy's, on the FP8 / FP4 grids with the config's block (32 x 32 here)."""
    _, alone = quantized
    drawn = load(resolve(str(alone)), keep_quantized=True, load_format="dummy")
    dense = RandomWeights(v4_table(drawn.config.spec), "cpu")
    fp8, fp4 = drawn.weights["layers.2.attn.wq_b.weight"], drawn.weights["layers.2.ffn.experts.1.w2.weight"]
    assert isinstance(fp8, Fp8Weight) and fp8.block == (32, 32) and isinstance(fp4, Fp4Weight) and fp4.block == 32
    want8 = quantize_fp8(dense["layers.2.attn.wq_b.weight"], 32)
    assert torch.equal(fp8.data.view(torch.uint8), want8.data.view(torch.uint8)) and torch.equal(fp8.scale,
                                                                                                  want8.scale)
    want4 = quantize_fp4(dense["layers.2.ffn.experts.1.w2.weight"], 32)
    assert torch.equal(fp4.data, want4.data) and torch.equal(fp4.scale, want4.scale)
    assert torch.equal(drawn.weights["layers.2.ffn.gate.weight"], dense["layers.2.ffn.gate.weight"])  # dense
    assert drawn.weights.nbytes(2) < 0.7 * dense.nbytes(2)


def test_the_engine_generates_with_quantized_dummy_weights(quantized: tuple[Path, Path]) -> None:
    """--load-format dummy of a quantized V4's config.json on the CPU (dequantized there, as a real FP8 / FP4
    checkpoint): greedy tokens, the same in two engines."""
    _, alone = quantized
    prompt = [(3 * t + 1) % 512 for t in range(24)]
    engines = [Engine(str(alone), load_format="dummy", kv_blocks=8) for _ in range(2)]
    tokens = [run_to_completion(e, [EngineRequest("r", prompt, GREEDY, 3)])["r"] for e in engines]
    assert len(tokens[0]) == 3 and all(0 <= t < 512 for t in tokens[0]) and tokens[0] == tokens[1]
    assert "+dummy" in engines[0].cache_id


def test_another_quantization_scheme_has_no_dummy(quantized: tuple[Path, Path], tmp_path: Path) -> None:
    raw = json.loads((quantized[1] / "config.json").read_text())
    for scheme in ({"quant_method": "awq", "bits": 4}, {"quant_method": "fp8", "weight_block_size": [1, 128]}):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "quantization_config": scheme}))
        with pytest.raises(ValueError, match="dummy weights: only DeepSeek's FP8 block quantization"):
            load(ModelFiles("v4-other", "hf", tmp_path), load_format="dummy")


def test_v4_dummy_weights_come_from_config_json_alone_and_are_the_same_every_time(config_only: Path) -> None:
    first, second = (load(resolve(str(config_only)), load_format="dummy") for _ in range(2))
    assert first.name == "tiny-v4+dummy" and first.config.arch == "deepseek_v4"
    assert list(first.weights) == list(second.weights)
    for name in first.weights:  # drawn again by name: the same numbers in every process
        assert torch.equal(first.weights[name], second.weights[name]), name
    assert first.weights["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    ids = first.weights["layers.0.ffn.gate.tid2eid"]  # a token's hash-routed experts are distinct, as trained ones
    assert ids.shape == (512, 2) and bool((ids[:, 0] != ids[:, 1]).all()) and 0 <= int(ids.min()) < int(ids.max()) < 8


def test_v4_dummy_weights_have_the_real_shapes_not_its_values(real: Path) -> None:
    checkpoint = load(resolve(str(real)))
    dummy = load(resolve(str(real)), load_format="dummy")  # the safetensors beside config.json are not read
    extra = set(dummy.weights) - set(checkpoint.weights)
    # transformers saves no MTP layer though its config counts one: dummy draws what the config says
    assert extra and all(name.startswith("mtp.0.") for name in extra)
    assert dummy.config.spec.num_mtp_layers == 1 and checkpoint.config.spec.num_mtp_layers == 0
    for name, tensor in checkpoint.weights.items():
        drawn = dummy.weights[name]
        assert drawn.shape == tensor.shape, name
        if tensor.is_floating_point() and tensor.numel() > 1:
            assert not torch.allclose(drawn, tensor.float()), name


def test_the_engine_generates_with_dummy_weights_under_a_cache_id_of_their_own(real: Path, config_only: Path
                                                                              ) -> None:
    prompt = [(7 * t + 3) % 512 for t in range(40)]
    engines = [Engine(str(config_only), load_format="dummy", kv_blocks=8) for _ in range(2)]
    tokens = [run_to_completion(e, [EngineRequest("r", prompt, GREEDY, 4)])["r"] for e in engines]
    assert len(tokens[0]) == 4 and all(0 <= t < 512 for t in tokens[0])
    assert tokens[0] == tokens[1]  # two workers with dummy weights agree (a hand-over between them is exact)
    assert engines[0].cache_id == engines[1].cache_id and "+dummy" in engines[0].cache_id
    assert Engine(str(real), kv_blocks=8).cache_id != engines[0].cache_id


def test_llama_dummy_weights_load_and_generate(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    loaded = load(ModelFiles("tiny-llama", "hf", tmp_path), load_format="dummy")
    # the names the Llama model takes: those of the random Llama used by benches and GPU tests
    assert set(loaded.weights) == set(random_llama(loaded.config, "cpu").weights)
    engine = Engine(ModelFiles("tiny-llama", "hf", tmp_path), load_format="dummy", kv_blocks=8)
    assert len(run_to_completion(engine, [EngineRequest("r", [5, 6, 7, 8], GREEDY, 3)])["r"]) == 3


def test_what_cannot_have_dummy_weights_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dummy weights need a checkpoint directory's config.json, not a gguf"):
        load(ModelFiles("smol", "gguf", tmp_path / "smol.gguf"), load_format="dummy")
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="dummy weights: only DeepSeek-V4 and Llama-family checkpoints"):
        load(ModelFiles("mistral", "hf", tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="load format must be one of"):
        load(ModelFiles("mistral", "hf", tmp_path), load_format="random")
    with pytest.raises(ValueError, match="--load-format must be one of"):
        WorkerConfig(device="cpu", load_format="random")
    assert worker_config.LOAD_FORMATS == LOAD_FORMATS  # the worker's flag is checked without importing torch


def test_up_passes_dummy_to_the_workers_and_its_preflight_needs_no_weights(config_only: Path, tmp_path: Path
                                                                         ) -> None:
    plan = build_plan(cli_up.parse(["--model", str(config_only), "--load-format", "dummy"]), tmp_path,
                      "nats://127.0.0.1:4222")
    argv = {c.service: c.argv[3:] for c in plan.children}
    parser = argparse.ArgumentParser()
    add_common_args(parser, "prefill")
    add_worker_args(parser)
    assert parser.parse_args(argv["prefill"]).load_format == "dummy"
    assert parser.parse_args(argv["decode"]).load_format == "dummy"
    assert "--load-format" not in " ".join(argv["recipe"] + argv["gateway"])
    assert check_model(str(config_only), load_format="dummy").path == config_only
    with pytest.raises(PreflightError, match="has no \\*.safetensors weights"):
        check_model(str(config_only))
    with pytest.raises(SystemExit):
        cli_up.parse(["--load-format", "random"])


def test_expert_parallel_ranks_draw_the_same_dummy_weights(config_only: Path) -> None:
    """The spawned rank draws its half of the routed experts itself, by name: greedy tokens equal one process's."""
    prompt = [(11 * t + 5) % 512 for t in range(40)]
    one = Engine(str(config_only), load_format="dummy", kv_blocks=8)
    want = run_to_completion(one, [EngineRequest("r", prompt, GREEDY, 4)])["r"]
    spread = Engine(str(config_only), load_format="dummy", kv_blocks=8, expert_parallel=2)
    try:
        assert spread.expert_ranks == 2 and spread.cache_id == one.cache_id
        assert run_to_completion(spread, [EngineRequest("r", prompt, GREEDY, 4)])["r"] == want
    finally:
        spread.close()
