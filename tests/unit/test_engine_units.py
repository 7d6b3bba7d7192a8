"""Engine parts without a model: block manager, scheduler plans, sampler, KV blobs."""

from __future__ import annotations

import pytest
import torch

from shared import hashing
from shared.engine.block_manager import BlockManager
from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec
from shared.engine.sampler import sample
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import SamplingSpec, Sequence, Status

BT = hashing.BLOCK_TOKENS
NS = hashing.namespace("test")
GREEDY = SamplingSpec(0.0, 0, 1.0, 0)


def seq(rid: str, n: int, max_new: int = 4, first: int = 0) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), GREEDY, frozenset(), max_new, 0, False)


# --- block manager ------------------------------------------------------------------------------------------


def test_allocate_until_full_then_none() -> None:
    bm = BlockManager(4, BT)
    a = bm.allocate(3)
    assert a is not None and len(set(a)) == 3 and bm.num_free == 1
    assert bm.allocate(2) is None and bm.num_free == 1  # all or nothing
    bm.free(a)
    assert bm.num_free == 4


def test_grow_covers_tokens_and_fails_cleanly() -> None:
    bm = BlockManager(3, BT)
    table: list[int] = []
    assert bm.grow(table, 17) and len(table) == 2
    assert bm.grow(table, 32) and len(table) == 2  # still fits in two blocks
    assert not bm.grow(table, 49) and len(table) == 2  # needs 4 blocks: refused, nothing taken
    assert bm.num_free == 1


def test_prefix_cache_shares_and_survives_free_until_reused() -> None:
    bm = BlockManager(4, BT)
    hashes = hashing.block_hashes(list(range(40)), NS)  # 2 full blocks
    a = bm.allocate(2)
    assert a is not None
    for block, h in zip(a, hashes):
        bm.publish(block, h)
    shared = bm.match(hashes)
    assert shared == a and bm.ref_count(a[0]) == 2
    bm.free(a)
    bm.free(shared)
    assert bm.num_free == 4 and bm.cached_prefix(hashes) == 2  # freed but still cached
    again = bm.match(hashes)
    assert again == a and bm.num_free == 2
    bm.free(again)
    assert bm.allocate(4) is not None  # reusing every block evicts the cached prefix
    assert bm.cached_prefix(hashes) == 0


def test_match_stops_at_first_miss() -> None:
    bm = BlockManager(4, BT)
    hashes = hashing.block_hashes(list(range(48)), NS)
    a = bm.allocate(3)
    assert a is not None
    bm.publish(a[0], hashes[0])
    bm.publish(a[2], hashes[2])  # a hole at block 1: block 2 is unreachable through the chain
    assert bm.match(hashes) == [a[0]]


def test_double_free_is_an_invariant_violation() -> None:
    bm = BlockManager(2, BT)
    a = bm.allocate(1)
    assert a is not None
    bm.free(a)
    with pytest.raises(AssertionError):
        bm.free(a)


# --- scheduler ----------------------------------------------------------------------------------------------


def test_schedule_decode_first_then_chunked_prefill() -> None:
    sched = Scheduler(BlockManager(16, BT), NS, max_batch_tokens=20, max_running=8)
    a, b = seq("a", 30), seq("b", 50)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks] == [("a", 0, 20, False)]
    sched.postprocess(plan, [])
    plan = sched.schedule()  # a finishes its prompt (10), b starts with what is left of the budget (10)
    assert [(c.seq.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [("a", 10, True), ("b", 10, False)]
    outs = sched.postprocess(plan, [7])
    assert outs[0].token_ids == [7] and outs[1].token_ids == [] and outs[1].finish_reason is None
    plan = sched.schedule()  # a decodes (1 token) before b's next chunk (19)
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 19)]


def test_preemption_when_blocks_run_out() -> None:
    sched = Scheduler(BlockManager(4, BT), NS, max_batch_tokens=64, max_running=8)
    a, b = seq("a", 32, max_new=40), seq("b", 31, max_new=40, first=100)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert len(plan.chunks) == 2 and sched.blocks.num_free == 0
    sched.postprocess(plan, [1, 2])
    # a now needs a third block for position 32: the youngest (b) is preempted and recomputed later
    plan = sched.schedule()
    assert [c.seq.request_id for c in plan.chunks] == ["a"]
    assert b.status is Status.WAITING and b.num_computed == 0 and sched.waiting[0] is b


def test_local_prefix_hit_skips_full_blocks_but_not_the_last_token() -> None:
    sched = Scheduler(BlockManager(8, BT), NS, max_batch_tokens=64, max_running=8)
    a = seq("a", 32, max_new=1)
    sched.add(a)
    sched.postprocess(sched.schedule(), [5])
    assert "a" not in sched.seqs and sched.blocks.num_free == 8
    b = seq("b", 32, max_new=1)  # same 32 tokens: block 0 is reused, block 1 holds the last token
    sched.add(b)
    plan = sched.schedule()
    assert plan.chunks[0].start == 16 and b.num_cached == 16


def test_import_takes_local_blocks_first_and_recomputes_the_last_token() -> None:
    sched = Scheduler(BlockManager(8, BT), NS, max_batch_tokens=64, max_running=8)
    warm = seq("warm", 20, max_new=1)
    sched.add(warm)
    warm_plan = sched.schedule()
    warm_block = warm.block_table[0]
    sched.postprocess(warm_plan, [5])  # block 0 (tokens 0..15) is now in the local prefix cache
    b = seq("b", 40, max_new=1)  # same first 16 tokens
    b.prefix_blobs, b.prefix_tokens = [b"0", b"1", b"2"], 40  # every token's KV offered
    sched.add(b)
    plan = sched.schedule()
    assert [blob for _, blob in plan.imports] == [b"1", b"2"]  # block 0 came from the local cache
    assert (plan.chunks[0].start, plan.chunks[0].num_tokens) == (39, 1)  # logits need the last token computed
    assert b.num_cached == 39 and b.block_table[0] == warm_block
    assert sched.blocks.ref_count(b.block_table[0]) == 1 and len(b.block_table) == 3


def test_abort_everywhere_frees_blocks() -> None:
    bm = BlockManager(8, BT)
    sched = Scheduler(bm, NS, max_batch_tokens=16, max_running=8)
    for i in range(3):
        sched.add(seq(str(i), 20))
    sched.schedule()  # "0" running (chunk 16), the others waiting
    for rid in ("0", "1", "2", "unknown"):
        sched.abort(rid)
    assert bm.num_free == 8 and not sched.running and not sched.waiting and not sched.seqs


# --- sampler ------------------------------------------------------------------------------------------------


def test_sampler_greedy_topk1_and_stateless_seed() -> None:
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [GREEDY] * 3, [0, 1, 2]) == greedy
    assert sample(logits, [SamplingSpec(1.0, 1, 1.0, 9)] * 3, [0, 1, 2]) == greedy
    hot = SamplingSpec(2.0, 0, 1.0, 1234)
    one = sample(logits[1:2], [hot], [5])
    assert sample(logits, [GREEDY, hot, GREEDY], [0, 5, 0])[1] == one[0]  # same (seed, position) anywhere
    draws = {sample(logits[:1], [hot], [p])[0] for p in range(20)}
    assert len(draws) > 5  # positions get different draws


def test_sampler_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.tensor([[5.0, 4.9, -10.0, -10.0] + [-20.0] * 96])
    spec = [SamplingSpec(1.0, 0, 0.5, s) for s in range(50)]
    tokens = sample(logits.expand(50, -1), spec, [0] * 50)
    assert set(tokens) == {0}  # token 0 alone already holds > 50 % of the mass


# --- KV blobs -----------------------------------------------------------------------------------------------


def test_kv_blob_roundtrip_and_size_check() -> None:
    spec = CacheSpec(PagedSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=BT, dtype=torch.bfloat16), 0)
    kv = KVCache(spec, 3, torch.device("cpu"))
    kv.kv.copy_(torch.randn_like(kv.kv, dtype=torch.float32).to(torch.bfloat16))
    blobs = kv.read_blocks([2, 0])
    assert [len(b) for b in blobs] == [spec.paged.bytes_per_block] * 2 == [2 * 2 * BT * 4 * 2] * 2
    # the layout every device exports (CPU copies rows with numpy, CUDA gathers and permutes): kv[:, :, block]
    assert blobs[0] == kv.kv[:, :, 2].contiguous().view(torch.uint8).numpy().tobytes()
    other = KVCache(spec, 3, torch.device("cpu"))
    other.write_blocks([1, 0], blobs)
    assert torch.equal(other.kv[:, :, 1], kv.kv[:, :, 2]) and torch.equal(other.kv[:, :, 0], kv.kv[:, :, 0])
    with pytest.raises(ValueError):
        other.write_blocks([0], [blobs[0][:-1]])
    assert kv.export_state("x", 0) == b"" and spec.per_request_state_bytes == 0


def test_block_manager_tells_its_listener_what_becomes_findable() -> None:
    bm = BlockManager(2, 16)
    heard: list[tuple[str, list[bytes]]] = []
    bm.listener = lambda op, hashes: heard.append((op, hashes))
    (a,) = bm.allocate(1)
    bm.publish(a, b"h-a")
    bm.publish(a, b"h-a")  # already findable: nothing new
    bm.free([a])
    assert heard == [("stored", [b"h-a"])] and bm.cached_hashes() == [b"h-a"]
    bm.allocate(2)  # both blocks taken: the cached one is overwritten
    assert heard[-1] == ("removed", [b"h-a"]) and bm.cached_hashes() == []
