"""Run-level KV import / export on CUDA caches: one device<->host copy into and out of a caller's buffer (an arena
slot, a pinned tensor, pageable memory), the same bytes as the CPU layout, arena views coalesced into one copy."""

from __future__ import annotations

import os

import pytest
import torch

from shared.kv_arena import Arena, arena_path
from tests.unit.test_kv_run_io import _llama, _v4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _to(cache, device: torch.device):
    """The same cache contents on `device` (the CPU factories fill random numbers)."""
    if hasattr(cache, "kv"):
        out = type(cache)(cache.spec, cache.num_blocks, device)
        out.kv.copy_(cache.kv)
        return out
    out = type(cache)(cache.spec, cache.num_blocks, device, cache.dtype)
    for a, b in zip(out._paged, cache._paged):
        a.copy_(b)
    return out


@pytest.mark.parametrize("make", [_llama, _v4], ids=["llama", "v4"])
def test_cuda_run_io_matches_the_cpu_layout_through_every_kind_of_buffer(make) -> None:
    cpu = make(6)
    gpu, back = _to(cpu, torch.device("cuda")), _to(make(6), torch.device("cuda"))
    bb, blocks = cpu.block_bytes, [4, 1, 5]
    want = cpu.read_blocks(blocks)
    pinned = torch.empty(3 * bb, dtype=torch.uint8, pin_memory=True)
    gpu.export_run(blocks, pinned)
    assert [bytes(pinned[i * bb : (i + 1) * bb].numpy()) for i in range(3)] == want
    pageable = bytearray(3 * bb)
    gpu.export_run(blocks, memoryview(pageable))
    assert bytes(pageable) == b"".join(want)
    assert gpu.read_blocks(blocks) == want  # the bytes API on top of it

    arena = Arena(arena_path(f"gpu-runio-{os.getpid()}"), slots=1, slot_bytes=3 * bb)
    try:
        offset = arena.take()
        gpu.export_run(blocks, arena.view(offset, 3 * bb))
        views = arena.lend(offset, [bb] * 3)
        back.write_blocks([0, 2, 3], views)  # one host->device copy for the three
        torch.cuda.synchronize()
        assert back.read_blocks([0, 2, 3]) == want
        del views
        assert arena.free_slots == 1
    finally:
        arena.close()


@pytest.mark.parametrize("make", [_llama, _v4], ids=["llama", "v4"])
def test_scattered_blobs_import_through_few_staging_buffers_exactly(make, monkeypatch) -> None:
    """The store's get gives a long prompt's blocks as many arena slots and loose blobs: a GPU import stages them
    into device buffers (shared/engine/kv_cache.py: staged_runs) and scatters each once; the bytes land exactly
    where the CPU cache puts them, with buffers smaller than the prompt too."""
    import shared.engine.kv_cache as kv_cache

    cpu_src, cpu_dst = make(12), make(12)
    bb = cpu_src.block_bytes
    monkeypatch.setattr(kv_cache, "STAGE_BYTES", 3 * bb)  # several buffers for the 10 blocks below
    monkeypatch.setattr(kv_cache.staged_runs, "__defaults__", (3 * bb,))
    blobs = cpu_src.read_blocks(list(range(10)))
    backing = bytearray(b"".join(blobs[2:6]))  # four adjacent views, like an arena slot's
    views = [memoryview(backing)[i * bb : (i + 1) * bb] for i in range(4)]
    mixed = [blobs[0], blobs[1], *views, blobs[6], blobs[7], blobs[8], blobs[9]]
    targets = [11, 0, 5, 3, 9, 1, 7, 2, 10, 4]
    gpu = _to(cpu_dst, torch.device("cuda"))
    gpu.write_blocks(targets, mixed)
    cpu_dst.write_blocks(targets, mixed)
    assert gpu.read_blocks(list(range(12))) == cpu_dst.read_blocks(list(range(12)))


@pytest.mark.parametrize("make", [_llama, _v4], ids=["llama", "v4"])
def test_a_put_rounds_parts_export_through_few_staging_buffers_exactly(make) -> None:
    """A put round exports a prompt into many arena slots: a GPU gathers them into device buffers
    (kv_cache.export_staged), here smaller than the round, and each slot gets the bytes the CPU layout gives
    its blocks, pinned and pageable slots alike."""
    from shared.engine.kv_cache import export_staged

    cpu = make(12)
    gpu, bb = _to(cpu, torch.device("cuda")), cpu.block_bytes
    runs = [[4, 1, 5], [0], [11, 2], [7, 8, 9, 3]]
    outs = [torch.empty(3 * bb, dtype=torch.uint8, pin_memory=True), bytearray(bb),
            torch.empty(2 * bb, dtype=torch.uint8, pin_memory=True), memoryview(bytearray(4 * bb))]
    export_staged(gpu.export_run, list(zip(runs, outs)), bb, torch.device("cuda"), max_bytes=4 * bb)
    for blocks, out in zip(runs, outs):
        got = out.numpy().tobytes() if isinstance(out, torch.Tensor) else bytes(out)
        assert got == b"".join(cpu.read_blocks(blocks))
