"""Run-level KV import / export (KVCache and V4Cache `export_run` / `import_run`): a run of blocks into one
caller-given buffer and back, the same bytes as the per-block blobs, straight from an arena slot's views."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec, runs_of, staged_runs
from shared.engine.models.deepseek_v4.cache import V4Cache
from shared.engine.models.deepseek_v4.spec import CSA, HCA, DeepseekV4Spec
from shared.kv_arena import Arena, arena_path


def _llama(blocks: int) -> KVCache:
    spec = CacheSpec(PagedSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_tokens=4, dtype=torch.bfloat16), 0)
    cache = KVCache(spec, blocks, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape).to(torch.bfloat16))
    return cache


def _v4(blocks: int) -> V4Cache:
    kinds = (HCA, CSA, CSA, "sliding")
    spec = DeepseekV4Spec(
        vocab_size=64, hidden_size=32, num_heads=2, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=1,
        o_lora_rank=16, window=8, index_heads=2, index_head_dim=8, index_topk=4, num_experts=2, experts_per_token=1,
        num_shared_experts=1, moe_intermediate=16, num_layers=4, kinds=kinds, ratios=(16, 4, 4, 0), hash_layers=0,
        scoring="softmax", norm_topk_prob=True, routed_scale=1.0, swiglu_limit=10.0, hc_mult=2, hc_iters=2,
        hc_eps=1e-6, rope_theta=1e4, compress_rope_theta=1e4, compress_rope_scaling=None, rms_eps=1e-6,
        max_position=4096, num_mtp_layers=0, mtp_kinds=(), mtp_ratios=())
    cache = V4Cache(spec, blocks, torch.device("cpu"), torch.bfloat16)
    for t in cache._paged:
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    return cache


@pytest.mark.parametrize("make", [_llama, _v4], ids=["llama", "v4"])
def test_a_run_goes_out_and_back_through_one_buffer_as_its_blobs(make) -> None:
    src, dst = make(6), make(6)
    bb = src.block_bytes
    blocks = [4, 1, 5]
    out = bytearray(len(blocks) * bb)
    src.export_run(blocks, memoryview(out))
    blobs = src.read_blocks(blocks)  # the bytes API (NATS) gives the same bytes, block by block
    assert [bytes(out[i * bb : (i + 1) * bb]) for i in range(3)] == blobs
    assert len(set(blobs)) == 3  # three different blocks, not one repeated
    before = dst.read_blocks([3])
    dst.import_run([0, 2, 5], torch.frombuffer(out, dtype=torch.uint8))  # a host tensor works as well
    assert dst.read_blocks([0, 2, 5]) == blobs and dst.read_blocks([3]) == before  # nothing else written
    with pytest.raises(ValueError):
        dst.import_run([0], out)  # a buffer of three blocks for one
    with pytest.raises(ValueError):
        dst.write_blocks([0], [blobs[0][:-1]])


@pytest.mark.parametrize("make", [_llama, _v4], ids=["llama", "v4"])
def test_blocks_import_straight_from_the_arena_views(make) -> None:
    """What get_run gives through shared memory: read-only views of a slot, imported from where they lie; the
    slot comes back once the engine dropped them."""
    src, dst = make(4), make(4)
    bb = src.block_bytes
    arena = Arena(arena_path(f"unit-runio-{os.getpid()}"), slots=2, slot_bytes=3 * bb)
    try:
        offset = arena.take()
        assert offset is not None
        src.export_run([3, 0, 2], arena.view(offset, 3 * bb))  # one copy: cache -> arena
        views = arena.lend(offset, [bb] * 3)
        loose = [bytes(views[1])]  # a blob from elsewhere between two runs
        blobs = [views[0], views[1], *loose, views[2]]
        runs = [(a, b) for a, b, _ in runs_of(blobs, False)]
        assert runs == [(0, 2), (2, 4)]  # back-to-back views coalesce into one view; the rest joined into one copy
        assert [(a, b) for a, b, _ in runs_of([*loose, *loose, views[0], views[1], *loose], False)] == [
            (0, 2), (2, 4), (4, 5)]  # loose blobs joined into one buffer per stretch of them
        dst.write_blocks([0, 1, 2, 3], blobs)
        assert dst.read_blocks([0, 1, 2, 3]) == src.read_blocks([3, 0, 0, 2])
        assert arena.free_slots == 1
        del views, blobs, runs
        assert arena.free_slots == 2
    finally:
        arena.close()


def test_a_gpu_import_is_staged_in_few_buffers_each_piece_copied_once() -> None:
    """staged_runs (what a GPU cache's write_blocks imports from), run here on CPU tensors: scattered blobs and runs
    of adjacent views land in buffers of at most max_bytes, in order, each byte where its block goes."""
    bb = 8
    backing = bytearray(np.arange(10 * bb, dtype=np.uint8).tobytes())
    run = memoryview(backing)
    views = [run[i * bb : (i + 1) * bb] for i in range(10)]
    loose = [bytes([200 + i]) * bb for i in range(3)]
    blobs = [loose[0], views[2], views[3], views[4], loose[1], views[7], loose[2], views[8], views[9]]
    staged = list(staged_runs(blobs, bb, torch.device("cpu"), max_bytes=4 * bb))
    assert [(a, b) for a, b, _ in staged] == [(0, 4), (4, 8), (8, 9)]  # by buffer, not by piece (6 pieces)
    got = b"".join(bytes(t.numpy()) for _, _, t in staged)
    assert got == b"".join(bytes(b) for b in blobs)
    one = list(staged_runs(views[2:6], bb, torch.device("cpu"), max_bytes=bb))
    assert [(a, b) for a, b, _ in one] == [(0, 4)]  # one piece already: as it is, not copied again
