"""Prompt-lookup (n-gram) speculative decoding on the real SmolLM2-135M (CPU): the output is exactly plain
decoding's, greedy and seeded, for both verify-length policies; a prompt that quotes itself gets drafts accepted."""

from __future__ import annotations

import pytest

from shared.engine.drafters.ngram import lookup
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.loader import LoadedModel, load
from shared.models import resolve
from shared.schemas.generate import SamplingParams
from shared.tokenizer import load_tokenizer

PASSAGE = ("The committee met on Tuesday to review the budget. It approved the new library, delayed the road "
           "repairs until spring, and asked the mayor to publish the full accounts before the next meeting.")
# the assistant turn starts the copy, so the model goes on quoting the passage (drafts from the prompt accepted)
QUOTING = (f"<|im_start|>user\nRepeat this text word for word:\n{PASSAGE}<|im_end|>\n<|im_start|>assistant\n"
           f"{PASSAGE[:40]}")
FREE = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"


def test_lookup_takes_the_longest_recent_match() -> None:
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == ([7, 8], 3)  # latest of the two 3-gram hits
    assert lookup([5, 2, 3, 4, 6, 2, 3], 3) == ([4, 6, 2], 2)
    assert lookup([4, 8, 1, 4], 5) == ([8, 1, 4], 1)  # runs up to the end of the sequence
    assert lookup([1, 2, 3], 4) == ([], 0)  # nothing recurs
    assert lookup([1, 1], 3) == ([1], 1) and lookup([1], 3) == ([], 0) and lookup([1, 2, 1], 0) == ([], 0)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load(resolve("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    tok = load_tokenizer(resolve("SmolLM2-135M-Instruct"))
    return {"quoting": tok.encode(QUOTING), "free": tok.encode(FREE)}


def _requests(prompts: dict[str, list[int]], temperature: float) -> list[EngineRequest]:
    return [EngineRequest(name, ids, SamplingParams(temperature=temperature, max_tokens=24, seed=7 + i), 24)
            for i, (name, ids) in enumerate(prompts.items())]


@pytest.fixture(scope="module")
def plain(loaded: LoadedModel, prompts: dict[str, list[int]]) -> dict[float, dict[str, list[int]]]:
    engine = Engine(loaded, kv_blocks=64)
    return {t: run_to_completion(engine, _requests(prompts, t)) for t in (0.0, 0.8)}


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_ngram_drafts_never_change_the_output(loaded: LoadedModel, prompts: dict[str, list[int]],
                                              plain: dict[float, dict[str, list[int]]], temperature: float,
                                              policy: str) -> None:
    engine = Engine(loaded, kv_blocks=64, speculative_tokens=4, speculative_method="ngram",
                    speculative_policy=policy)
    assert run_to_completion(engine, _requests(prompts, temperature)) == plain[temperature]
    assert engine.spec_drafted > 0 and engine.spec_verifies > 0
    if temperature == 0.0:  # greedy copying of the quoted passage: its drafts are the model's own tokens
        quoting = Engine(loaded, kv_blocks=64, speculative_tokens=4, speculative_method="ngram",
                         speculative_policy=policy)
        out = run_to_completion(quoting, _requests({"quoting": prompts["quoting"]}, 0.0))
        assert out["quoting"] == plain[0.0]["quoting"]
        # accepted drafts: some steps emitted several tokens, so there were fewer steps than tokens
        assert quoting.spec_accepted > 0 and quoting.spec_verifies < len(out["quoting"])
    assert not engine.policy_state()  # every request's acceptance history is dropped when it finishes


def test_unknown_method_and_policy_are_refused(loaded: LoadedModel) -> None:
    with pytest.raises(ValueError, match="speculative method"):
        Engine(loaded, kv_blocks=8, speculative_tokens=2, speculative_method="eagle")
    with pytest.raises(ValueError, match="speculative policy"):
        Engine(loaded, kv_blocks=8, speculative_tokens=2, speculative_method="ngram", speculative_policy="dspark")
