"""A store hit imported on the GPU straight from a worker's read-only map of the store's shared heap
(shared/kv_heap.py), page-locked read-only (`pin_heap`): the same bytes as the CPU layout, adjacent blobs as one
host->device copy; the registration is undone before the map goes."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from services.kvcache.heap import Heap, HeapPayloads
from shared.kv_heap import HeapMap, heap_path
from shared.worker.kv_cuda_ipc import pin_heap
from tests.gpu.test_kv_run_io_gpu import _to
from tests.unit.test_kv_run_io import _llama, _v4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("make", [_llama, _v4], ids=["llama", "v4"])
def test_a_store_hit_imports_on_the_gpu_from_the_pinned_heap(make) -> None:
    cpu = make(6)
    blocks = [4, 1, 5, 0]
    want = cpu.read_blocks(blocks)
    heap = Heap(heap_path("test-heap-gpu"), 8 * cpu.block_bytes)
    payloads = HeapPayloads(heap)
    try:
        refs = [payloads.keep(blob) for blob in want]
        assert None not in refs
        reader = HeapMap.open(str(heap.path), heap.token)
        assert reader is not None
        pinned = pin_heap(reader)
        views = reader.lend([r.offset for r in refs], [r.length for r in refs], time.monotonic() + 30, lambda: None)
        assert views is not None
        gpu = _to(make(6), torch.device("cuda"))
        gpu.write_blocks([0, 1, 2, 3], views)
        torch.cuda.synchronize()
        assert gpu.read_blocks([0, 1, 2, 3]) == want
        del views, reader
        gc.collect()  # the map goes: its registration first
        print(f"pinned read-only: {pinned}")
    finally:
        heap.close()
