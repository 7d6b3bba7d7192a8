"""min_p in both sampler paths, and the logits processors (repetition penalty, min_tokens), against direct
reference computations on small logits; the sampling fields' validation."""

from __future__ import annotations

import math

import pytest
import torch

from shared.engine.api import RequestError
from shared.engine.engine import sampling_spec
from shared.engine.processors import LogitsProcessors
from shared.engine.sampler import draw_key, hashed_exponential, sample, sample_on_device
from shared.engine.scheduler import Chunk
from shared.engine.sequence import SamplingSpec, Sequence
from shared.schemas.generate import SamplingParams

V = 64
CPU = torch.device("cpu")


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _reference_probs(row: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """The definition, step by step: temperature, then min_p (prob below min_p x the top prob), top-k, top-p
    (a token goes when the tokens ranked above it already hold top_p of what is left)."""
    x = row / spec.temperature
    probs = torch.softmax(x, dim=-1)
    keep = probs >= spec.min_p * probs.max()
    if 0 < spec.top_k < V:
        keep &= x >= torch.topk(x, spec.top_k).values[-1]
    q = torch.where(keep, probs, 0.0)
    q = q / q.sum()
    mass_above = 0.0
    for t in q.argsort(descending=True).tolist():
        if mass_above >= spec.top_p:
            q[t] = 0.0
        mass_above += float(q[t])
    return q


def _noise(spec: SamplingSpec, position: int, on_device: bool) -> torch.Tensor:
    key = draw_key(spec.seed, position)
    if on_device:
        return hashed_exponential(torch.tensor([key]), V)[0]
    gen = torch.Generator().manual_seed(key)
    return torch.empty(V).exponential_(generator=gen)


SPECS = [
    SamplingSpec(0.7, 0, 1.0, 11, min_p=0.1),
    SamplingSpec(1.3, 20, 1.0, 12, min_p=0.05),
    SamplingSpec(1.0, 0, 0.8, 13, min_p=0.02),
    SamplingSpec(1.0, 0, 1.0, 14),  # min_p off, in the same batch
]


@pytest.mark.parametrize("on_device", [False, True], ids=["per-row", "batched"])
def test_min_p_samples_exactly_the_reference(on_device: bool) -> None:
    logits = _logits(len(SPECS))
    draw = sample_on_device if on_device else sample
    for position in range(30):
        got = draw(logits, SPECS, [position] * len(SPECS))
        got = got.tolist() if on_device else got
        want = [int((_reference_probs(logits[i], s) / _noise(s, position, on_device)).argmax())
                for i, s in enumerate(SPECS)]
        assert got == want


@pytest.mark.parametrize("on_device", [False, True], ids=["per-row", "batched"])
def test_min_p_drops_the_unlikely_tokens(on_device: bool) -> None:
    logits = torch.tensor([[4.0, 3.5, 3.0, 1.0, 0.5] + [0.0] * (V - 5)])
    probs = torch.softmax(logits[0], dim=-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert allowed == {0, 1, 2}

    def drawn(min_p: float) -> set[int]:
        specs = [SamplingSpec(1.0, 0, 1.0, seed, min_p=min_p) for seed in range(300)]
        tokens = (sample_on_device if on_device else sample)(logits.expand(300, -1), specs, [0] * 300)
        return set(tokens.tolist() if on_device else tokens)

    assert drawn(0.2) == allowed
    assert drawn(0.0) - allowed  # without it the long tail gets drawn
    assert drawn(1.0) == {0}  # only the top token reaches min_p x itself


# --- logits processors --------------------------------------------------------------------------------------


def _seq(rid: str, tokens: list[int], spec: SamplingSpec, stop: frozenset[int] = frozenset()) -> Sequence:
    return Sequence(rid, list(tokens), spec, stop, max_new_tokens=16, output_offset=0, hold_kv=False)


def _decode(seq: Sequence, drafts: tuple[int, ...] = ()) -> Chunk:
    return Chunk(seq, seq.num_tokens - 1, 1 + len(drafts), True, drafts)


def _penalised(row: torch.Tensor, seen: set[int], p: float) -> torch.Tensor:
    out = row.clone()
    for t in seen:
        out[t] = row[t] / p if row[t] > 0 else row[t] * p
    return out


def test_repetition_penalty_matches_the_reference_and_follows_the_output() -> None:
    proc = LogitsProcessors(V, CPU)
    a = _seq("a", [3, 9, 3, 40], SamplingSpec(0.0, 0, 1.0, 0, repetition_penalty=1.5))
    b = _seq("b", [1, 2], SamplingSpec(0.8, 0, 1.0, 5))  # no penalty: untouched
    c = _seq("c", [7, 8], SamplingSpec(1.0, 0, 1.0, 6, repetition_penalty=0.5))  # < 1 favours repeats
    logits = _logits(3, seed=1)
    rows = [(_decode(a), 0), (_decode(b), 0), (_decode(c), 0)]
    out = proc.apply(logits, rows, [0, 0, 0])
    assert torch.equal(out[0], _penalised(logits[0], {3, 9, 40}, 1.5))
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[2], _penalised(logits[2], {7, 8}, 0.5))
    proc.record([11, 12, 13])  # the step's sampled tokens join a's and c's sets (token_ids not touched here)
    logits = _logits(3, seed=2)
    out = proc.apply(logits, rows, [1, 1, 1])
    assert torch.equal(out[0], _penalised(logits[0], {3, 9, 40, 11}, 1.5))
    assert torch.equal(out[2], _penalised(logits[2], {7, 8, 13}, 0.5))


def test_speculative_rows_see_the_drafts_before_them() -> None:
    proc = LogitsProcessors(V, CPU)
    a = _seq("a", [3, 4], SamplingSpec(0.0, 0, 1.0, 0, repetition_penalty=2.0))
    chunk = _decode(a, drafts=(20, 21, 22))
    logits = _logits(4, seed=3)
    out = proc.apply(logits, [(chunk, r) for r in range(4)], [5, 6, 7, 8])
    for r in range(4):  # row r follows drafts[:r]: the set plain decoding has there once they are accepted
        assert torch.equal(out[r], _penalised(logits[r], {3, 4, *chunk.drafts[:r]}, 2.0))
    proc.accept(a, [20, 30])  # draft 20 accepted, 30 the model's own token: 21 and 22 were rejected
    logits = _logits(1, seed=4)
    out = proc.apply(logits, [(_decode(a), 0)], [7])
    assert torch.equal(out[0], _penalised(logits[0], {3, 4, 20, 30}, 2.0))


def test_min_tokens_masks_the_stop_ids_until_then() -> None:
    proc = LogitsProcessors(V, CPU)
    spec = SamplingSpec(0.0, 0, 1.0, 0, min_tokens=3)
    seqs = [_seq(f"s{i}", [5, 6], spec, frozenset({2, 7})) for i in range(3)]
    logits = _logits(3, seed=5)
    out = proc.apply(logits, [(_decode(s), 0) for s in seqs], [0, 2, 3])
    for i in (0, 1):  # output positions 0 and 2: fewer than 3 tokens generated before them
        want = logits[i].clone()
        want[[2, 7]] = float("-inf")
        assert torch.equal(out[i], want)
    assert torch.equal(out[2], logits[2])  # position 3: released
    assert not proc.slots  # no repetition penalty: no token set kept


def test_rows_without_processors_cost_nothing_and_slots_are_reused_clean() -> None:
    proc = LogitsProcessors(V, CPU)
    plain = _seq("p", [1, 2, 3], SamplingSpec(1.0, 40, 0.9, 1, min_p=0.1))
    logits = _logits(1)
    assert proc.apply(logits, [(_decode(plain), 0)], [0]) is logits  # the very tensor, not a copy
    penalty = SamplingSpec(0.0, 0, 1.0, 0, repetition_penalty=3.0)
    proc.apply(logits, [(_decode(_seq("x", [1, 2, 3], penalty)), 0)], [0])
    proc.drop("x")
    out = proc.apply(logits, [(_decode(_seq("y", [9], penalty)), 0)], [0])
    assert proc.slots == {"y": 0}  # x's slot, now y's, with x's tokens gone
    assert torch.equal(out[0], _penalised(logits[0], {9}, 3.0))


def _openai_penalised(row: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's definition: mu[j] - c[j] x frequency - (c[j] > 0) x presence, c counted over the output only."""
    out = row.clone()
    for t in set(output):
        out[t] = row[t] - output.count(t) * frequency - presence
    return out


def test_presence_and_frequency_penalties_count_the_output_only() -> None:
    proc = LogitsProcessors(V, CPU)
    spec = SamplingSpec(0.0, 0, 1.0, 0, presence_penalty=0.5, frequency_penalty=0.25)
    # a continuation: prompt [1, 2, 3] then its own output [5, 5, 9] (output_offset 3), 3 also in the prompt
    a = Sequence("a", [1, 2, 3, 5, 5, 9], spec, frozenset(), max_new_tokens=16, output_offset=3, hold_kv=False)
    b = _seq("b", [5, 9], SamplingSpec(0.0, 0, 1.0, 0, presence_penalty=-1.0))  # negative: favours repeats
    logits = _logits(2, seed=6)
    out = proc.apply(logits, [(_decode(a), 0), (_decode(b), 0)], [3, 0])
    assert torch.allclose(out[0], _openai_penalised(logits[0], [5, 5, 9], 0.5, 0.25), atol=0, rtol=0)
    assert torch.equal(out[1], logits[1])  # nothing generated yet: the prompt's 5 and 9 are not counted
    proc.record([9, 5])
    logits = _logits(2, seed=7)
    out = proc.apply(logits, [(_decode(a), 0), (_decode(b), 0)], [4, 1])
    assert torch.equal(out[0], _openai_penalised(logits[0], [5, 5, 9, 9], 0.5, 0.25))
    assert torch.equal(out[1], _openai_penalised(logits[1], [5], -1.0, 0.0))


def test_output_counts_see_the_drafts_before_a_speculative_row() -> None:
    proc = LogitsProcessors(V, CPU)
    a = _seq("a", [3, 4], SamplingSpec(0.0, 0, 1.0, 0, frequency_penalty=1.5))
    chunk = _decode(a, drafts=(20, 20, 22))
    logits = _logits(4, seed=8)
    out = proc.apply(logits, [(chunk, r) for r in range(4)], [0, 1, 2, 3])
    for r in range(4):
        assert torch.equal(out[r], _openai_penalised(logits[r], list(chunk.drafts[:r]), 0.0, 1.5))
    proc.accept(a, [20, 30])
    logits = _logits(1, seed=9)
    out = proc.apply(logits, [(_decode(a), 0)], [2])
    assert torch.equal(out[0], _openai_penalised(logits[0], [20, 30], 0.0, 1.5))


def test_logit_bias_adds_to_the_biased_ids_and_bans_or_forces_them() -> None:
    proc = LogitsProcessors(V, CPU)
    a = _seq("a", [1], SamplingSpec(0.0, 0, 1.0, 0, logit_bias=((3, 2.5), (7, -1.0))))
    b = _seq("b", [1], SamplingSpec(0.0, 0, 1.0, 0))
    logits = _logits(2, seed=10)
    out = proc.apply(logits, [(_decode(a), 0), (_decode(b), 0)], [0, 0])
    want = logits[0].clone()
    want[3] += 2.5
    want[7] -= 1.0
    assert torch.equal(out[0], want) and torch.equal(out[1], logits[1])
    assert not proc.slots  # a bias needs no token history

    top = int(logits[0].argmax())
    last = int(logits[0].argmin())
    for on_device in (False, True):
        draw = sample_on_device if on_device else sample
        specs = [SamplingSpec(1.0, 0, 1.0, seed, logit_bias=((top, -100.0),)) for seed in range(200)]
        specs += [SamplingSpec(1.0, 0, 1.0, seed, logit_bias=((last, 100.0),)) for seed in range(200)]
        seqs = [_seq(f"s{i}", [1], s) for i, s in enumerate(specs)]
        x = proc.apply(logits[:1].expand(len(specs), -1), [(_decode(q), 0) for q in seqs], [0] * len(specs))
        got = draw(x, specs, [0] * len(specs))
        got = got.tolist() if on_device else got
        assert top not in got[:200]  # -100: never drawn (its probability underflows to 0)
        assert set(got[200:]) == {last}  # +100: always drawn, though it was the least likely


# --- validation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    {"min_p": -0.1}, {"min_p": 1.5}, {"min_p": math.nan},
    {"repetition_penalty": 0.0}, {"repetition_penalty": -1.0}, {"repetition_penalty": math.inf},
    {"repetition_penalty": math.nan}, {"min_tokens": -1}, {"min_tokens": 9, "max_tokens": 8},
    {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1},
    {"presence_penalty": 2.5}, {"presence_penalty": math.nan}, {"frequency_penalty": -2.1},
    {"logit_bias": {3: 100.5}}, {"logit_bias": {3: math.nan}},
])
def test_out_of_range_sampling_is_a_request_error_naming_the_field(bad: dict[str, float]) -> None:
    with pytest.raises(RequestError, match=next(k for k in bad if k != "max_tokens")):
        sampling_spec(SamplingParams(**bad))


def test_sampling_fields_reach_the_spec() -> None:
    sp = SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.2, min_tokens=8,
                        max_tokens=8, seed=3)
    assert sampling_spec(sp) == SamplingSpec(0.5, 7, 0.9, 3, min_p=0.05, repetition_penalty=1.2, min_tokens=8)
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, logit_bias={9: -3, 2: 1.5, 4: 0}, seed=1)
    assert sampling_spec(sp) == SamplingSpec(1.0, 0, 1.0, 1, presence_penalty=0.5, frequency_penalty=-1.0,
                                             logit_bias=((2, 1.5), (9, -3.0)))  # sorted; a zero bias is no bias


def test_the_reasoning_budget_forces_the_end_token_from_its_position_until_it_occurs() -> None:
    """Budget 3, end id 9: positions 0-2 are free, position 3 can only be 9; a sequence whose output already has
    9 is left alone; a speculative row counts the drafts before it (a draft 9 closes the reasoning)."""
    proc = LogitsProcessors(V, CPU)
    spec = SamplingSpec(0.0, 0, 1.0, 0, reasoning_budget=3, reasoning_end=9)
    early, due, closed = (_seq(r, [5, 6, 20, 21, 22], spec) for r in ("e", "d", "c"))
    for seq, output in ((early, 2), (due, 3), (closed, 3)):
        seq.num_generated = output  # the last `output` ids are its output
    closed.token_ids[-2] = 9
    logits = _logits(3, seed=7)
    out = proc.apply(logits, [(_decode(early), 0), (_decode(due), 0), (_decode(closed), 0)], [2, 3, 3])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert int(out[1].argmax()) == 9 and torch.isinf(out[1]).sum() == V - 1
    proc.record([30, 9, 31])  # the forced 9 now counts for d: position 4 is free again
    out = proc.apply(_logits(1, seed=8), [(_decode(due), 0)], [4])
    assert not torch.isinf(out[0]).any()
    spec_row = _seq("s", [5, 6, 20, 21], spec)
    spec_row.num_generated = 2
    chunk = _decode(spec_row, drafts=(9, 40))  # rows at positions 2, 3, 4: the draft 9 is before rows 1 and 2
    out = proc.apply(_logits(3, seed=9), [(chunk, r) for r in range(3)], [2, 3, 4])
    assert not torch.isinf(out).any()


def test_a_reasoning_budget_without_its_end_token_is_refused() -> None:
    with pytest.raises(RequestError, match="reasoning_end"):
        sampling_spec(SamplingParams(reasoning_budget=4))
    spec = sampling_spec(SamplingParams(seed=1, reasoning_budget=4, reasoning_end=7))
    assert (spec.reasoning_budget, spec.reasoning_end, spec.processed) == (4, 7, True)


def test_the_device_sampler_never_draws_a_masked_token() -> None:
    """A grammar masks all but a few tokens (-inf). The device path's noise must be > 0 everywhere: a column
    whose uniform rounded to 1 in float32 had noise -0.0, a masked token's 0 / -0.0 was NaN, and argmax took it
    (found on the H200: a JSON-schema request sampled token 33561 outside its grammar, seed 7, position 4)."""
    vocab, key = 49152, draw_key(7, 4)
    noise = hashed_exponential(torch.tensor([key]), vocab)[0]
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    logits = torch.full((1, vocab), float("-inf"))
    allowed = [5, 901, 17000, 40000]
    logits[0, allowed] = torch.tensor([0.1, 1.2, 1.5, -0.4])
    spec = SamplingSpec(0.8, 0, 1.0, 7)
    assert int(sample_on_device(logits, [spec], [4])[0]) in allowed
