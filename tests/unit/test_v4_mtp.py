"""Speculative decoding with DeepSeek-V4's MTP layer: drafts verified in one step, rejected ones rolled back.

The output must be exactly what decoding without drafts gives, greedy and seeded sampling alike (the sampler is
a function of (seed, output position), so a verified row samples what the plain step would have). transformers
has no MTP, so the checkpoints are written in the hub's dialect with an MTP layer; random MTP weights draft badly
(the rollback path), an oracle drafter that knows the answer drafts well (the acceptance path).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine import verify_policy
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return v4_checkpoints.build_hub(tmp_path_factory.mktemp("v4"))


# Penalised requests may only sample these (every other id is a stop id, held back by min_tokens = max_tokens),
# so the repetition penalty decides nearly every token: a verified row that missed the drafts before it would
# pick another one.
FEW = list(range(100, 108))


def _requests(temperature: float, penalised: bool = False) -> list[EngineRequest]:
    prompts = {"a": 9, "b": 30, "c": 17}
    processors = {"repetition_penalty": 4.0, "min_p": 0.05, "min_tokens": 14} if penalised else {}
    stop = [t for t in range(512) if t not in FEW] if penalised else []
    out = []
    for i, (rid, n) in enumerate(prompts.items()):
        ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        sampling = SamplingParams(temperature=temperature, max_tokens=14, seed=100 + i, **processors)
        out.append(EngineRequest(rid, ids, sampling, max_new_tokens=14, stop_token_ids=stop))
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 3])
def test_drafts_never_change_the_output(checkpoint: Path, k: int, temperature: float) -> None:
    plain = run_to_completion(Engine(str(checkpoint), kv_blocks=64, max_batch_tokens=24), _requests(temperature))
    engine = Engine(str(checkpoint), kv_blocks=64, max_batch_tokens=24, speculative_tokens=k)
    assert run_to_completion(engine, _requests(temperature)) == plain
    assert engine.spec_drafted > 0  # drafts were made and verified (random MTP weights: few accepted)
    assert not engine.kv.states  # every request's state (MTP ring included) is freed


@pytest.mark.parametrize("temperature, graphs", [(0.0, False), (0.8, True)], ids=["greedy", "seeded-graphs"])
def test_overlapped_speculation_matches_plain_decoding(checkpoint: Path, temperature: float, graphs: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """MTP drafts with overlap on, the adaptive policy (confidence floor included) under a load cut-off of 3
    sequences: full-batch steps overlap (the MTP layer only advances), smaller ones draft and resolve first. The
    tokens are plain decoding's, and the layer's state is consistent (every ring freed at the end). `graphs`: the
    draft-free decode steps go through V4's decode-graph body (run eagerly on a CPU), whose streams the MTP layer
    advances on, as a GPU's speculative engine replays them."""
    monkeypatch.setattr(verify_policy, "LOAD_FULL", 1)
    monkeypatch.setattr(verify_policy, "LOAD_NONE", 3)
    plain = run_to_completion(Engine(str(checkpoint), kv_blocks=64, max_batch_tokens=24), _requests(temperature))
    engine = Engine(str(checkpoint), kv_blocks=64, max_batch_tokens=24, speculative_tokens=3,
                    speculative_policy="adaptive")
    engine.overlap = True
    replays = []
    if graphs:
        engine.model.attention.batched = True  # the batched torch path, as test_v4_kernels_decode runs it
        runner = engine.runner
        runner.graphs = engine.model.decode_graphs(engine.kv, engine.device, engine.max_tokens, (1, 2, 4),
                                                   runner.fed)
        run = runner.graphs.run
        runner.graphs.run = lambda chunks: replays.append(len(chunks)) or run(chunks)
    assert run_to_completion(engine, _requests(temperature)) == plain
    assert engine.spec_verifies > 0 and engine.overlapped > 0
    assert bool(replays) == graphs
    assert not engine.kv.states and not engine.policy_state() and not engine.policy.probs


@pytest.mark.parametrize("temperature, penalised", [(0.0, False), (0.0, True), (0.8, True)],
                         ids=["greedy", "greedy-penalised", "seeded-penalised"])
def test_accepted_drafts_advance_several_tokens_a_step(checkpoint: Path, temperature: float, penalised: bool
                                                       ) -> None:
    """An oracle drafter that knows the plain output (but gets every third draft wrong): accepted drafts make
    steps emit several tokens, rejected ones roll the rings back, and the output is unchanged."""
    requests = _requests(temperature, penalised)
    plain = run_to_completion(Engine(str(checkpoint), kv_blocks=64), requests)
    if penalised:
        assert all(len(v) == 14 and set(v) <= set(FEW) for v in plain.values())
    engine = Engine(str(checkpoint), kv_blocks=64, speculative_tokens=3)
    calls = {"n": 0}
    real_draft = engine.model.mtp_draft

    def oracle(kv, request_id, out, position, k, floor=0.0):
        real_draft(kv, request_id, out, position, k, floor)  # keep the MTP layer's own bookkeeping exercised
        prompt = next(len(r.token_ids) for r in requests if r.request_id == request_id)
        truth = plain[request_id][position + 1 - prompt :][:k]
        calls["n"] += 1
        drafts = [t if (calls["n"] + i) % 3 else (t + 1) % 512 for i, t in enumerate(truth)]
        return drafts, [1.0] * len(drafts)

    engine.model.mtp_draft = oracle
    steps = 0
    engine_requests = _requests(temperature, penalised)
    for r in engine_requests:
        engine.add(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in engine_requests}
    while engine.has_work():
        steps += 1
        for o in engine.step():
            got[o.request_id] += o.token_ids
    assert got == plain
    assert 0 < engine.spec_accepted < engine.spec_drafted  # some accepted, some rolled back
    stats = engine.stats()  # what the worker reports as its MTP acceptance rate
    assert (stats.drafted, stats.accepted) == (engine.spec_drafted, engine.spec_accepted)
    assert steps < 14 + 3  # fewer steps than one token per step would take (prefill chunks included)
    assert not engine.processors.slots


def test_speculative_decoding_needs_an_mtp_layer(tmp_path: Path) -> None:
    v4_checkpoints.build(tmp_path, "mixed")  # save_pretrained writes no MTP weights
    with pytest.raises(ValueError, match="no MTP layer"):
        Engine(str(tmp_path), kv_blocks=16, speculative_tokens=2)


def test_state_with_mtp_moves_between_engines(checkpoint: Path) -> None:
    """The MTP ring rides in the short-term state: a decode engine that imports it keeps drafting."""
    prompt = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    prefill = Engine(str(checkpoint), kv_blocks=64, speculative_tokens=2)
    first = run_to_completion(prefill, [EngineRequest("r", prompt, greedy, max_new_tokens=1, hold_kv=True)])
    blocks = prefill.export_blocks("r", 0, -(-len(prompt) // prefill.block_tokens))
    state = prefill.export_state("r")
    decode = Engine(str(checkpoint), kv_blocks=64, speculative_tokens=2)
    rest = run_to_completion(decode, [EngineRequest("r", prompt + first["r"], greedy, max_new_tokens=9,
                                                    output_offset=1, prefix_blocks=blocks,
                                                    prefix_tokens=len(prompt), prefix_state=state)])
    plain = run_to_completion(Engine(str(checkpoint), kv_blocks=64), [EngineRequest("r", prompt, greedy, 10)])
    assert first["r"] + rest["r"] == plain["r"]
    assert decode.spec_drafted > 0


def test_verified_drafts_carry_the_logprobs_plain_decoding_reports(checkpoint: Path) -> None:
    """A chunk's rows are its positions in order: the accepted drafts' and the model's own token's logprobs are
    those rows', the same numbers as one token a step."""
    def requests() -> list[EngineRequest]:
        return [EngineRequest(r.request_id, r.token_ids, SamplingParams(temperature=0.8, seed=r.sampling.seed,
                                                                        logprobs=2), 14) for r in _requests(0.8)]

    def run(engine: Engine) -> dict[str, list[tuple[int, float, list[int]]]]:
        got: dict[str, list[tuple[int, float, list[int]]]] = {}
        for r in requests():
            engine.add(r)
        while engine.has_work():
            for o in engine.step():
                assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) or not o.token_ids
                got.setdefault(o.request_id, []).extend(
                    (t, lp.logprob, lp.top_ids) for t, lp in zip(o.token_ids, o.logprobs or []))
        return got

    plain = run(Engine(str(checkpoint), kv_blocks=64))
    engine = Engine(str(checkpoint), kv_blocks=64, speculative_tokens=3)
    real_draft = engine.model.mtp_draft
    truth = {rid: [t for t, _, _ in v] for rid, v in plain.items()}
    prompts = {r.request_id: len(r.token_ids) for r in requests()}

    def oracle(kv, request_id, out, position, k, floor=0.0):
        real_draft(kv, request_id, out, position, k, floor)
        drafts = truth[request_id][position + 1 - prompts[request_id]:][:k]
        return drafts, [1.0] * len(drafts)

    engine.model.mtp_draft = oracle
    got = run(engine)
    assert engine.spec_accepted > 0
    for rid, want in plain.items():  # the same tokens and ranks; the numbers as close as one forward to another
        assert [(t, ids) for t, _, ids in got[rid]] == [(t, ids) for t, _, ids in want]
        assert [lp for _, lp, _ in got[rid]] == pytest.approx([lp for _, lp, _ in want], abs=1e-3)
