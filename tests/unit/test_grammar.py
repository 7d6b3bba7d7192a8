"""Grammar-constrained decoding (shared/engine/grammar.py) with the real SmolLM2 tokenizer and, in the engine, the
real SmolLM2 weights on CPU: every output of a corpus of schemas validates (jsonschema), greedy and seeded; a regex
and an EBNF grammar hold; the reasoning before an end-of-thinking marker is free; the constraint survives the
prefill -> decode hand-over and speculative verification (n-gram drafts) without changing a token."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from shared.engine.api import RequestError
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.grammar import Grammars, vocabulary
from shared.engine.loader import LoadedModel, load
from shared.models import resolve
from shared.schemas.generate import Constraint, SamplingParams
from shared.tokenizer import Tokenizer, load_tokenizer

V = 49152  # SmolLM2's vocabulary (and logits' width)
EOS = [0, 2]  # <|endoftext|>, <|im_end|>

# a small corpus that ends early (a few dozen tokens): nested objects, arrays, enums, bounded numbers, optional
# fields, anyOf, string patterns
SCHEMAS: dict[str, dict] = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "colours": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}},
        "required": ["colours"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
             "required": ["answer"], "additionalProperties": False},
    "bounds": {"type": "object", "properties": {"score": {"type": "number", "minimum": -5, "maximum": 5},
                                                "count": {"type": "integer", "minimum": 1, "maximum": 9}},
               "required": ["score", "count"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15},
                                                  "zip": {"type": "string", "maxLength": 6}},
                 "required": ["city"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "maximum": 999},
                                                                   {"type": "boolean"}]}},
               "required": ["value"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
}


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(resolve("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def grammars(tok: Tokenizer) -> Grammars:
    return Grammars(V, lambda: vocabulary(tok.token_bytes, tok.is_special, tok.vocab_size), torch.device("cpu"))


def allowed(g: Grammars, rid: str, drafts: tuple[int, ...] = ()) -> set[int]:
    logits = torch.zeros(1, V)
    g.apply(logits, [(rid, drafts)])
    return set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())


def test_the_mask_allows_what_the_grammar_accepts_and_stop_ids_only_when_complete(grammars: Grammars,
                                                                                 tok: Tokenizer) -> None:
    grammars.add("r", Constraint("regex", "ab|abc"), EOS, [])
    first = allowed(grammars, "r")
    assert tok.encode("a")[0] in first and all(tok.decode([t]).startswith("a") for t in first)
    grammars.accept("r", tok.encode("ab"))
    after = allowed(grammars, "r")
    assert set(EOS) <= after and tok.encode("c")[0] in after  # complete (may stop) or one more "c"
    grammars.accept("r", tok.encode("c"))
    assert allowed(grammars, "r") == set(EOS)  # nothing may follow but a stop id
    grammars.drop("r")
    assert "r" not in grammars


def test_the_output_so_far_is_replayed_and_must_match(grammars: Grammars, tok: Tokenizer) -> None:
    grammars.add("j", Constraint("json_object"), EOS, tok.encode('{"a": [1, 2'))
    assert tok.encode("]")[0] in allowed(grammars, "j") and EOS[0] not in allowed(grammars, "j")
    with pytest.raises(RequestError, match="does not match"):  # JSON mode: an object, not any value
        grammars.add("l", Constraint("json_object"), EOS, tok.encode("[1"))
    with pytest.raises(RequestError, match="does not match"):
        grammars.add("k", Constraint("regex", "[0-9]+"), EOS, tok.encode("12a"))
    assert "k" not in grammars


@pytest.mark.parametrize("constraint", [Constraint("regex", "(unclosed"), Constraint("grammar", "root ::= nope"),
                                        Constraint("json_schema", '{"type": "objet"}'),
                                        Constraint("json_schema", "not json")])
def test_a_constraint_that_does_not_compile_is_a_request_error(grammars: Grammars, constraint: Constraint) -> None:
    with pytest.raises(RequestError, match=f"invalid {constraint.kind} constraint"):
        grammars.add("bad", constraint, EOS, [])


def test_a_constraint_needs_a_stop_id(grammars: Grammars) -> None:
    with pytest.raises(RequestError, match="stop token"):
        grammars.add("s", Constraint("json_object"), [], [])


def test_reasoning_is_free_until_the_marker_and_rollback_closes_it_again(grammars: Grammars, tok: Tokenizer) -> None:
    marker = tok.encode("<|im_start|>")[0]  # any token id stands for the end-of-thinking marker here
    grammars.add("t", Constraint("regex", "[0-9]{2}", after_token=marker), EOS, tok.encode("I think"))
    assert len(allowed(grammars, "t")) == V  # still reasoning: nothing masked
    digits = allowed(grammars, "t", (marker,))  # a verify row after a drafted marker is constrained
    assert digits and all(tok.decode([t]).isdigit() for t in digits)
    assert len(allowed(grammars, "t")) == V  # ... and the tentative marker was rolled back
    grammars.accept("t", [marker, *tok.encode("4")])
    assert all(tok.decode([t]).isdigit() for t in allowed(grammars, "t"))
    assert allowed(grammars, "t", tuple(tok.encode("2"))) == set(EOS)
    grammars.drop("t")


# --- in the engine (real weights, CPU) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load(resolve("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded, kv_blocks=256)


def _schema_requests(tok: Tokenizer, temperature: float) -> list[EngineRequest]:
    out = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        prompt = tok.encode(chat(f"Answer in JSON ({name}): {json.dumps(schema)}"))
        sp = SamplingParams(temperature=temperature, seed=11 + i, max_tokens=48,
                            constraint=Constraint("json_schema", json.dumps(schema)))
        out.append(EngineRequest(name, prompt, sp, 48))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_every_schema_of_the_corpus_validates(engine: Engine, tok: Tokenizer, temperature: float) -> None:
    out = run_to_completion(engine, _schema_requests(tok, temperature))
    for name, tokens in out.items():
        assert tokens[-1] in EOS, (name, tok.decode(tokens))  # the grammar ended the answer, not max_tokens
        jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMAS[name])
    assert not engine.grammars.states  # every finished request's matcher is gone


def test_regex_and_grammar_outputs_match(engine: Engine, tok: Tokenizer) -> None:
    prompt = tok.encode(chat("Give me a product code and say if it is in stock."))
    ebnf = 'root ::= "code: " [A-Z] [A-Z] [0-9] [0-9]? ", in stock: " ("yes" | "no")'
    reqs = [EngineRequest("re", prompt, SamplingParams(temperature=1.0, seed=5,
                                                       constraint=Constraint("regex", r"[A-Z]{3}-[0-9]{2,4}")), 30),
            EngineRequest("ebnf", prompt, SamplingParams(temperature=0.0, constraint=Constraint("grammar", ebnf)), 30)]
    out = {k: tok.decode(v) for k, v in run_to_completion(engine, reqs).items()}
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", out["re"]), out
    assert re.fullmatch(r"code: [A-Z]{2}[0-9]{1,2}, in stock: (yes|no)", out["ebnf"]), out


def test_the_constraint_survives_the_hand_over(engine: Engine, loaded: LoadedModel, tok: Tokenizer) -> None:
    """Prefill samples token 0 under the mask; decode rebuilds the matcher from it: the same tokens as one engine."""
    (whole,) = [r for r in _schema_requests(tok, 1.0) if r.request_id == "any_of"]
    expected = run_to_completion(engine, [whole])["any_of"]
    first = run_to_completion(engine, [EngineRequest("p", whole.token_ids, whole.sampling, 1)])["p"]
    decode = Engine(loaded, kv_blocks=64)
    rest = run_to_completion(decode, [EngineRequest("d", whole.token_ids + first, whole.sampling, 47,
                                                    output_offset=1)])["d"]
    assert first + rest == expected


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_speculative_drafts_never_change_a_constrained_output(engine: Engine, loaded: LoadedModel, tok: Tokenizer,
                                                              temperature: float) -> None:
    reqs = [r for r in _schema_requests(tok, temperature) if r.request_id in ("enum", "bounds")]
    plain = run_to_completion(engine, reqs)
    spec = Engine(loaded, kv_blocks=64, speculative_tokens=3, speculative_method="ngram")
    assert run_to_completion(spec, reqs) == plain
    assert spec.spec_drafted > 0  # drafts were verified under the mask, not skipped


# --- DeepSeek-V4 (tiny random weights, the real 129,280-token vocabulary) ---------------------------------------


def test_a_v4_answer_is_constrained_after_its_reasoning(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The served V4 tokenizer's vocabulary compiles; a continuation whose output so far is reasoning and </think>
    is constrained from the next token on (random weights: only the mask makes the answer three digits)."""
    from shared.deepseek_tokenizer import load_deepseek_tokenizer
    from tests import v4_checkpoints

    v4 = load_deepseek_tokenizer()
    end_think = v4.token_id("</think>")
    assert end_think is not None
    engine = Engine(str(v4_checkpoints.build_served(tmp_path_factory.mktemp("grammar-v4"))), kv_blocks=16)
    prompt = v4.encode("<｜User｜>Pick a number.<｜Assistant｜><think>")
    reasoning = [*v4.encode("Three digits, say"), end_think]
    sp = SamplingParams(temperature=1.0, seed=4, constraint=Constraint("regex", "[0-9]{3}", after_token=end_think))
    out = run_to_completion(engine, [EngineRequest("v4", prompt + reasoning, sp, 8, output_offset=len(reasoning))])
    tokens = out["v4"]
    assert tokens[-1] in engine.config.eos_ids and re.fullmatch("[0-9]{3}", v4.decode(tokens[:-1])), tokens
