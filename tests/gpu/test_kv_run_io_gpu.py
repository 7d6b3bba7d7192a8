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
