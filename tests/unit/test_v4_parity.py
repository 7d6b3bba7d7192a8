"""DeepSeek-V4 in our engine against transformers' reference implementation, on tiny random checkpoints.

Logits within fp32 tolerance for full prefill, chunked prefill, token-by-token decode and batched decode of
sequences of different lengths; greedy generations identical token for token through the whole engine
(continuous batching, chunked prefill, the overlapped scheduler's take-backs); bounded replay and a
prefill -> decode hand-over of blocks + short-term state equal to computing everything in one place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints

ATOL = 1e-4
CONFIGS = sorted(v4_checkpoints.CONFIGS)


@pytest.fixture(scope="module", params=CONFIGS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"v4-{request.param}")
    reference = v4_checkpoints.build(path, request.param)
    return path, reference


def _ids(n: int, seed: int, vocab: int = v4_checkpoints.BASE["vocab_size"]) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _reference_logits(reference, ids: list[int]) -> torch.Tensor:
    return reference(torch.tensor([ids]), use_cache=False).logits[0]


class Driver:
    """Calls the model directly, chunk by chunk, as the model runner would (logits at every position)."""

    def __init__(self, engine: Engine) -> None:
        self.model, self.cache, self.bt = engine.model, engine.kv, engine.block_tokens
        self.next_block = 0

    def blocks(self, n: int) -> list[int]:
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def run(self, batch: list[tuple[str, list[int], list[int], int, int]]) -> list[torch.Tensor]:
        """batch: (request id, token ids, block table, start, end) per sequence -> logits of [start, end) each."""
        ids, pos, spans = [], [], []
        for rid, tokens, table, a, b in batch:
            spans.append(SeqSpan(len(ids), b - a, b, torch.tensor(table[: -(-b // self.bt)]), rid))
            ids += tokens[a:b]
            pos += range(a, b)
        meta = AttentionMetadata(torch.zeros(len(ids), dtype=torch.long), spans)
        logits = self.model.logits(self.model.forward(torch.tensor(ids), torch.tensor(pos), meta, self.cache))
        return list(logits.split([s.q_len for s in spans]))


@pytest.mark.parametrize("chunks", [[40], [13, 1, 17, 9], [1] * 40], ids=["full", "chunked", "decode"])
def test_logits_match_reference(checkpoint, chunks: list[int]) -> None:
    path, reference = checkpoint
    driver = Driver(Engine(str(path), kv_blocks=64))
    ids = _ids(40, seed=1)
    table = driver.blocks(4)
    driver.cache.begin("a", 0)
    got, at = [], 0
    for n in chunks:
        got += driver.run([("a", ids, table, at, at + n)])
        at += n
    torch.testing.assert_close(torch.cat(got), _reference_logits(reference, ids), atol=ATOL, rtol=0)


def test_batched_decode_of_mixed_lengths(checkpoint) -> None:
    path, reference = checkpoint
    driver = Driver(Engine(str(path), kv_blocks=64))
    seqs = {"short": _ids(19, seed=2), "long": _ids(45, seed=3), "mid": _ids(32, seed=4)}
    prompt = {"short": 11, "long": 33, "mid": 24}
    tables = {rid: driver.blocks(3) for rid in seqs}
    for rid in seqs:
        driver.cache.begin(rid, 0)
    driver.run([(rid, seqs[rid], tables[rid], 0, prompt[rid]) for rid in seqs])  # one batched prefill
    got: dict[str, list[torch.Tensor]] = {rid: [] for rid in seqs}
    for step in range(8):  # then decode all three together, each at its own position
        batch = [(rid, seqs[rid], tables[rid], prompt[rid] + step, prompt[rid] + step + 1) for rid in seqs]
        for (rid, *_), logits in zip(batch, driver.run(batch)):
            got[rid].append(logits)
    for rid, ids in seqs.items():
        want = _reference_logits(reference, ids)[prompt[rid] : prompt[rid] + 8]
        torch.testing.assert_close(torch.cat(got[rid]), want, atol=ATOL, rtol=0)


def _greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new, **kw)


@torch.no_grad()
def _reference_generate(reference, ids: list[int], max_new: int) -> list[int]:
    out = reference.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("overlap,kernels", [(False, "torch"), (True, "torch"), (False, "triton")],
                         ids=["sync", "overlapped", "triton"])
def test_greedy_generation_matches_reference(checkpoint, overlap: bool, kernels: str) -> None:
    """kernels="triton": the model's Triton kernels (mHC weights), under the interpreter on a CPU."""
    path, reference = checkpoint
    engine = Engine(str(path), kv_blocks=64, max_batch_tokens=24, kernels=kernels)  # chunked prefill, batched decode
    engine.overlap = overlap  # the overlapped scheduler takes back one token per stop: the rings roll back
    prompts = {"p0": _ids(7, seed=5), "p1": _ids(38, seed=6), "p2": _ids(21, seed=7)}
    new = 12
    if kernels == "triton":  # interpreted on a CPU (a minute a config): a short and a chunked prompt, fewer steps
        prompts, new = {k: prompts[k] for k in ("p0", "p1")}, 6
    requests = [EngineRequest(rid, ids, _greedy(new), max_new_tokens=new) for rid, ids in prompts.items()]
    got = run_to_completion(engine, requests)
    for rid, ids in prompts.items():
        assert got[rid] == _reference_generate(reference, ids, new), rid


def test_bounded_replay_equals_full_prefill(checkpoint) -> None:
    """A request that finds its prefix's blocks but no short-term state recomputes num_layers * (window - 1)
    tokens before the restored end, and gets the logits of a full prefill; one window alone is not enough."""
    path, reference = checkpoint
    driver = Driver(Engine(str(path), kv_blocks=64))
    bt = driver.bt
    ids = _ids(3 * bt + 5, seed=8)
    want = _reference_logits(reference, ids)
    table = driver.blocks(4)
    driver.cache.begin("first", 0)
    driver.run([("first", ids, table, 0, 2 * bt)])  # its first two blocks hold the compressed entries
    restored = 2 * bt
    start = driver.cache.begin("replay", restored)
    assert start == max(0, restored - driver.cache.replay_tokens)
    replay_table = table[:2] + driver.blocks(2)  # shares the restored blocks, read-only
    (got,) = driver.run([("replay", ids, replay_table, start, len(ids))])
    torch.testing.assert_close(got[restored - start :], want[restored:], atol=ATOL, rtol=0)
    for i in range(2):  # the replay never rewrote the shared blocks' entries
        assert driver.cache.read_blocks([table[i]]) == driver.cache.read_blocks([replay_table[i]])
    # a replay of a single window misses the layers below's cone and drifts
    short = restored - (driver.model.spec.window - 1)
    driver.cache.states["short"] = driver.cache._fresh(short, short, restored)
    (drift,) = driver.run([("short", ids, table[:2] + driver.blocks(2), short, len(ids))])
    assert (drift[restored - short :] - want[restored:]).abs().max() > 100 * ATOL


def test_engine_replays_a_locally_cached_prefix(checkpoint) -> None:
    path, reference = checkpoint
    engine = Engine(str(path), kv_blocks=64)
    bt = engine.block_tokens
    prefix = _ids(2 * bt + 3, seed=9)
    run_to_completion(engine, [EngineRequest("first", prefix, _greedy(4), max_new_tokens=4)])
    follow = prefix + _ids(9, seed=10)
    engine.add(EngineRequest("second", follow, _greedy(6), max_new_tokens=6))
    tokens, cached = [], None
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            cached = out.num_cached_tokens
    assert cached == max(0, 2 * bt - engine.kv.replay_tokens)  # tokens skipped thanks to the prefix blocks
    assert tokens == _reference_generate(reference, follow, 6)


def test_prefill_decode_handover_of_blocks_and_state(checkpoint) -> None:
    """Disaggregated: one engine prefills (blocks + short-term state exported), another imports them and
    decodes; the tokens are those of one engine doing everything, and of the reference."""
    path, reference = checkpoint
    prompt = _ids(37, seed=11)
    prefill = Engine(str(path), kv_blocks=64)
    first = run_to_completion(prefill, [EngineRequest("r", prompt, _greedy(1), max_new_tokens=1, hold_kv=True)])
    blocks = prefill.export_blocks("r", 0, -(-len(prompt) // prefill.block_tokens))
    state = prefill.export_state("r")
    assert len(state) == prefill.model.cache_spec(0, prefill.dtype).per_request_state_bytes
    decode = Engine(str(path), kv_blocks=64)
    decode.add(EngineRequest("r", prompt + first["r"], _greedy(10), max_new_tokens=9, output_offset=1,
                             prefix_blocks=blocks, prefix_tokens=len(prompt), prefix_state=state))
    rest, cached = [], None
    while decode.has_work():
        for out in decode.step():
            rest += out.token_ids
            cached = out.num_cached_tokens
    assert cached == len(prompt)  # the imported state was used: nothing replayed
    assert not decode.kv.states  # a finished request's short-term state is freed
    assert first["r"] + rest == _reference_generate(reference, prompt, 10)
