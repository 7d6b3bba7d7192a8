"""The hand-over between two GPU workers of one host by CUDA IPC (`--kv-peer-transport cuda-ipc`, and `auto`'s
first choice): the bytes never leave device memory.

    prefill: the prompt's KV exported once into one device buffer (blocks, partial block, state: a gather on the
             device) -> its handle (`share`) and a digest in the pull's reply (KvPeerCuda)
    decode:  opens the handle (`open_shared`), copies the buffer device to device into its own, checks the
             copy's digest, lets go of the peer's memory at once (`done`), and its engine imports the blocks
             from that copy (kv_cache.DeviceBlob: one device copy a run)

The handle is torch's own route for CUDA tensors between processes (torch.multiprocessing.reductions), taken at
the storage level so nothing is pickled: `_share_cuda_` on the producer's storage gives plain data (ints, bytes,
a bool), `_new_shared_cuda` opens it. torch's IPC reference counter keeps the allocation out of the producer's
allocator while a consumer has it open, so prefill may drop its buffer (done, lease, cancel) at any time.

What it costs: the prompt's KV held in prefill's GPU memory until decode's copy is in (milliseconds; at most the
lease), and as much again in decode's for its copy until the engine has imported it. No host memory is touched;
the shm region (or the bytes) for the store and for a decode that cannot open the handle is exported after the
device buffer, off the hand-over's path.

Integrity: decode checks the 64-bit word sum of its copy against the one prefill took (wrapping, so the order
of the sum does not matter): a buffer freed and reused under a dead producer does not pass, and a copy that
fails goes to the store (or recomputes), as a corrupt item over shm or NATS does.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from shared.kv_arena import Arena
from shared.kv_heap import HeapMap
from shared.schemas.kv_peer import CudaHandle, KvPeerCuda

if TYPE_CHECKING:
    from shared.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

ALIGN = 8  # the buffer is whole 64-bit words (the digest's unit); the items start at 0, back to back


@lru_cache(maxsize=1)
def boot_id() -> str:
    """This host's kernel boot id: two processes with the same one share a host (and its GPUs' IPC)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU `uuid` names (CUDA_VISIBLE_DEVICES differ between workers), None: not
    visible here."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", i)) == uuid:
            return i
    return None


def digest(buf: torch.Tensor) -> int:
    """The 64-bit words of `buf` (uint8, a multiple of 8 bytes) summed modulo 2**64, as a signed int64: one
    pass at memory speed on the device; order-free, so both sides get the same whatever the kernel's order."""
    return int(buf.view(torch.int64).sum())


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def share(buf: torch.Tensor) -> CudaHandle:
    """A handle to `buf` (contiguous uint8 on CUDA, offset 0 in its storage); `buf` must stay alive until the
    other process has opened it (the hand-over holds it; torch's IPC counter holds the memory after that)."""
    assert buf.is_cuda and buf.dtype == torch.uint8 and buf.is_contiguous() and buf.storage_offset() == 0
    storage = buf.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, sync = storage._share_cuda_()
    return CudaHandle(device, bytes(handle), size, offset, bytes(ref_handle), ref_offset, bytes(event),
                      bool(sync), buf.numel())


def open_shared(h: CudaHandle, device: int | None = None) -> torch.Tensor:
    """A uint8 tensor over the memory `h` names (another process's), on `device` (this process's index of that
    GPU; default: the producer's index); copy out of it, then drop it."""
    index = h.device if device is None else device
    # torch's rebuild assumes a CUDA context current on this thread: in a fresh process (or a thread that has not
    # touched the GPU yet) opening the handle without one crashed the process (a segfault, seen on the H200)
    torch.cuda.init()
    with torch.cuda.device(index):
        storage = torch.UntypedStorage._new_shared_cuda(index, h.handle, h.size_bytes, h.offset_bytes,
                                                        h.ref_counter_handle, h.ref_counter_offset, h.event_handle,
                                                        h.event_sync_required)
        out = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    return out.set_(storage, 0, (h.nbytes,), (1,))


def pin_host(arena: Arena) -> bool:
    """Page-lock a shared-memory arena for the GPU (cudaHostRegister): copies between it and the device go as one
    DMA each (about 55 GB/s on the H200 against about 18 GB/s from pageable memory). For a GPU worker's arenas
    (the store's, the peer hand-over's), whose every byte crosses to or from the device. Undone when the arena
    closes. False where the driver refuses: the copies stay pageable (slower, not wrong)."""
    mapped = np.frombuffer(arena.mapping, dtype=np.uint8)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(mapped.ctypes.data, mapped.size, 0)
    if int(err) != 0:
        log.info("cudaHostRegister of %s (%d MiB) refused (%s): copies stay pageable", arena.path,
                 mapped.size >> 20, err)
        return False
    address = mapped.ctypes.data
    del mapped  # no export of the map may outlive close(): the address is all the undo needs
    arena.before_close.append(lambda: cudart.cudaHostUnregister(address))
    return True


HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly (CUDA 11.1+): the store's heap is mapped read-only


def pin_heap(heap: HeapMap) -> bool:
    """Page-lock a worker's read-only map of the store's heap (shared/kv_heap.py), as `pin_host` does an arena:
    a store hit's bytes cross to the device from it, so pinned they go as one DMA. Undone before the map goes.
    False where the driver refuses (no read-only registration): the copies stay pageable (slower, not wrong)."""
    address, size = heap.address()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, size, HOST_REGISTER_READ_ONLY)
    if int(err) != 0:
        log.info("cudaHostRegister of %s (%d MiB, read-only) refused (%s): copies stay pageable", heap.path,
                 size >> 20, err)
        return False
    heap.before_close.append(lambda: cudart.cudaHostUnregister(address))
    return True


# --- prefill: a hand-over's device buffer ---------------------------------------------------------------------


@dataclass
class DeviceRegion:
    """A hand-over's items in one device buffer: `blocks` full blocks, the partial block if `tail`, then the
    state as one item (when there is one). Held by the hand-over; dropping it ends prefill's hold."""

    buf: torch.Tensor
    lengths: list[int]
    blocks: int
    tail: bool
    descriptor: KvPeerCuda

    @property
    def state_parts(self) -> int:
        return len(self.lengths) - self.blocks - self.tail

    @classmethod
    def of(cls, buf: torch.Tensor, lengths: list[int], blocks: int, tail: bool) -> DeviceRegion:
        """The filled buffer (its pad zeroed), described for a pull's reply."""
        torch.cuda.synchronize(buf.device)  # the export's copies are in before a consumer opens the handle
        desc = KvPeerCuda(boot_id(), device_uuid(buf.device), share(buf), list(lengths), digest(buf))
        return cls(buf, list(lengths), blocks, tail, desc)


class CudaExporter:
    """A prefill worker's device buffers for hand-overs (none when its engine is not on a GPU)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()  # cuda_regions, cuda_no_room (the GPU had no room for the buffer)

    async def export(self, engine: AsyncEngine, request_id: str, tokens: int) -> DeviceRegion | None:
        """A held request's KV of its first `tokens` into a new device buffer: None when the GPU has no room for
        it (the hand-over goes through the host path alone)."""
        layout = engine.layout
        runs = -(-tokens // layout.block_tokens)  # full blocks and the partial one, exported full-size each
        state = await engine.export_state(request_id)
        lengths = [layout.block_bytes] * runs + ([len(state)] if state else [])
        try:
            buf = await engine.export_device(request_id, runs, state, padded(sum(lengths)))
        except torch.OutOfMemoryError:
            self.counts["cuda_no_room"] += 1
            log.info("%s: no GPU memory for a device hand-over of %d MiB: the host path", request_id,
                     sum(lengths) >> 20)
            return None
        self.counts["cuda_regions"] += 1
        return DeviceRegion.of(buf, lengths, tokens // layout.block_tokens, tokens % layout.block_tokens > 0)


# --- decode: the copy -----------------------------------------------------------------------------------------


class CudaImporter:
    """A decode worker's reads of peers' device buffers, into its own GPU's memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self, desc: KvPeerCuda) -> torch.Tensor | None:
        """A copy of the buffer `desc` names on this worker's GPU, its digest checked: None when the handle
        cannot be opened here (another host, a GPU not visible, the producer gone) or the copy is not what
        prefill described (a caller treats both as "not through CUDA IPC"; the digest one as corrupt).
        Blocking: call it off the event loop."""
        if desc.boot_id != boot_id() or not desc.boot_id:
            return None
        index = local_index(desc.uuid)
        if index is None:
            return None
        try:
            peer = open_shared(desc.handle, index)
        except RuntimeError as exc:  # the producer is gone, or this driver refuses the handle
            log.info("cannot open a peer's CUDA IPC handle: %s", exc)
            return None
        try:
            own = torch.empty(desc.handle.nbytes, dtype=torch.uint8, device=self.device)
            own.copy_(peer)  # one device-to-device copy (peer to peer between two GPUs)
            torch.cuda.synchronize(self.device)
        except torch.OutOfMemoryError:  # no room for the copy on this GPU now: through the host instead
            log.info("no GPU memory for a %d MiB hand-over copy: through the host", desc.handle.nbytes >> 20)
            return None
        finally:
            del peer  # the peer's memory is its own again (torch's IPC counter)
        return own

    @staticmethod
    def intact(own: torch.Tensor, desc: KvPeerCuda) -> bool:
        return own.numel() == padded(sum(desc.lengths)) and digest(own) == desc.digest
