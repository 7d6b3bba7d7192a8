"""CUDA IPC for the peer hand-over between two GPU workers of one host: the mechanism, not yet the transport.

What exists: `share` turns a device buffer (a uint8 CUDA tensor: a prompt's KV exported into one device run)
into a plain-data handle (ints, bytes, a bool: msgpack-able, no pickle), and `open_shared` opens that handle in
another process as a tensor over the same device memory, from which decode copies device to device. It is
torch's own route for CUDA tensors between processes (torch.multiprocessing.reductions: `_share_cuda_` on the
storage, `_new_shared_cuda` to rebuild), taken at the storage level so nothing is pickled. tests/gpu/
test_kv_cuda_ipc_gpu.py hands a buffer between two processes this way and checks the bytes.

What is left for `--kv-peer-transport cuda-ipc` (kv_peer_transport.py lists it as planned, and runs it as auto):
- the engine's side: an export of a run into a device buffer and an import from one (today export_run /
  import_run take host buffers), both for Llama's paged cache and DeepSeek-V4's;
- the protocol: a KvPeerCuda descriptor (the handle below, the device's UUID and the host's boot id) in the
  reply beside KvPeerShm, offered by decode in `via` only when its engine is on CUDA; decode opens it, copies,
  synchronises, drops its tensor, then says done;
- the buffer's life on the prefill side: held by the hand-over (done, lease, cancel), as the shm region is. A
  consumer that dies leaves nothing to unlock (the producer owns the allocation); the producer dying frees the
  memory under the consumer, so decode checks each item's checksum after its copy, as over shm.
Costs: device memory of the prompt's KV held on the prefill GPU for up to the lease; one device-to-device
copy (NVLink / PCIe peer-to-peer between two GPUs; a local copy on one), no host memory touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CudaHandle:
    """A CUDA allocation shared with another process (what `_share_cuda_` gives, as plain data)."""

    device: int
    handle: bytes  # cudaIpcMemHandle of the allocation the buffer lies in
    size_bytes: int  # the storage's
    offset_bytes: int  # the storage's start inside that allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int  # of the buffer (the storage may be larger: the caching allocator's block)


def share(buf: torch.Tensor) -> CudaHandle:
    """A handle to `buf` (contiguous uint8 on CUDA, offset 0 in its storage); `buf` must stay alive until the
    other process is done with it (the hand-over holds it)."""
    assert buf.is_cuda and buf.dtype == torch.uint8 and buf.is_contiguous() and buf.storage_offset() == 0
    storage = buf.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, sync = storage._share_cuda_()
    return CudaHandle(device, bytes(handle), size, offset, bytes(ref_handle), ref_offset, bytes(event),
                      bool(sync), buf.numel())


def open_shared(h: CudaHandle) -> torch.Tensor:
    """A uint8 tensor over the memory `h` names (another process's), on its device; copy out of it, then drop it."""
    storage = torch.UntypedStorage._new_shared_cuda(h.device, h.handle, h.size_bytes, h.offset_bytes,
                                                    h.ref_counter_handle, h.ref_counter_offset, h.event_handle,
                                                    h.event_sync_required)
    out = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}")
    return out.set_(storage, 0, (h.nbytes,), (1,))
