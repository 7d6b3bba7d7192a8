"""Constrained decoding on a GPU (marked gpu: skipped without CUDA), real SmolLM2 weights: the masks are
applied on the device under CUDA graphs and overlapped scheduling (or verify rows with n-gram drafts); a batch of
constrained and free requests gets exactly the synchronous run's tokens (the steps around a constrained one lose
their overlap, never their tokens), and the constrained outputs validate."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.models import resolve
from shared.schemas.generate import Constraint, SamplingParams
from shared.tokenizer import load_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "colour": {"enum": ["red", "green", "blue"]}}, "required": ["name", "age", "colour"]}
REGEX = r"[A-Z]{2}-[0-9]{3}"


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _requests(tok) -> list[EngineRequest]:
    free = [EngineRequest(f"free{i}", tok.encode(chat(q)), SamplingParams(temperature=0.8, seed=i, ignore_eos=True), 40)
            for i, q in enumerate(["Tell me a story.", "Name three rivers.", "What is rain?"])]
    constrained = []
    for i in range(8):
        prompt = tok.encode(chat("Describe a person as JSON." if i % 2 else "Give me a product code."))
        c = Constraint("json_schema", json.dumps(SCHEMA)) if i % 2 else Constraint("regex", REGEX)
        constrained.append(EngineRequest(f"c{i}", prompt, SamplingParams(temperature=1.0, seed=i, constraint=c), 60))
    return free + constrained


@pytest.mark.parametrize("speculative", [0, 3], ids=["overlapped", "ngram-drafts"])
def test_constrained_rows_on_the_device(speculative: int) -> None:
    """fp32, so the synchronous reference and the run under test round alike."""
    files = resolve("SmolLM2-135M-Instruct")
    tok = load_tokenizer(files)
    sync = Engine(files, device="cuda", dtype=torch.float32, kv_blocks=1024, max_running=32)
    sync.overlap = False
    expected = run_to_completion(sync, _requests(tok))
    engine = Engine(files, device="cuda", dtype=torch.float32, kv_blocks=1024, max_running=32,
                    speculative_tokens=speculative, speculative_method="ngram")
    assert engine.overlap == (speculative == 0)
    assert run_to_completion(engine, _requests(tok)) == expected
    for i in range(8):
        text = tok.decode(expected[f"c{i}"])
        if i % 2:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text
    assert not engine.grammars.states and not sync.grammars.states
