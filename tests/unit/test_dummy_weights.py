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
    assert set(loaded.weights) == set(random_llama(loaded.config, "cpu", torch.float32).weights)
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
