"""The KV cache: a long-term paged tier (prefix-cacheable blocks) and a short-term per-request tier.

Two tiers because DeepSeek-V4 needs both: its compressed KV entries are long-term (hashable, shareable,
stored for days), its sliding-window rings are per-request state (restored or replayed on a hit). Llama keeps
all of its K and V long-term, so its per-request state is empty, but the interface is the same.

Long-term layout, one tensor for the whole engine:

    kv[layer, kind, block, slot, kv_head, head_dim]        kind 0 = K, 1 = V; slot = position % BLOCK_TOKENS

        layer 0                                    layer 1 ...
        +-- K --------------+-- V --------------+  +-----
        | block 0 [16 slots]| block 0 [16 slots]|  |
        | block 1           | block 1           |  |
        | ...               | ...               |  |
        +-------------------+-------------------+  +-----

    A token at position p of a sequence with block table T lives in block T[p // 16], slot p % 16; its flat
    slot index within one layer's K (or V) is T[p // 16] * 16 + p % 16 (the "slot mapping").

A block's blob (what moves between engines and the kvcache service) is kv[:, :, block] made contiguous:
(layer, kind, slot, kv_head, head_dim) in the cache dtype, `bytes_per_block` bytes, slots past the sequence's
end hold whatever was there (the importer overwrites them when it computes those positions).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from shared.engine.kv_quant import FP8, Fp8Rows, RowLayout, quantize

HostBuffer = Union[bytes, bytearray, memoryview, np.ndarray, torch.Tensor]  # contiguous host memory; or, for a
# run's export and import only, a flat uint8 tensor on the cache's GPU (a hand-over by CUDA IPC: no host copy)


@dataclass(frozen=True)
class DeviceBlob:
    """A block's bytes in device memory: `run[offset : offset + nbytes]` of a flat uint8 tensor on the GPU (a
    hand-over copied from a peer GPU, shared/worker/kv_cuda_ipc.py). Blobs of one run lying back to back are
    imported with one device copy."""

    run: torch.Tensor
    offset: int
    nbytes: int

    def __len__(self) -> int:
        return self.nbytes

    def view(self) -> torch.Tensor:
        return self.run[self.offset : self.offset + self.nbytes]


Blob = Union[bytes, bytearray, memoryview, DeviceBlob]


@dataclass(frozen=True)
class PagedSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    @property
    def fp8(self) -> bool:
        """FP8 (kv_quant.py): each token's head stored as one packed row, e4m3 values and their float32 scales."""
        return self.dtype == FP8

    @property
    def rows(self) -> RowLayout:
        return RowLayout(self.head_dim, 0)  # Llama rotates every channel: no bf16 tail, all of it quantized

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """(L, 2, B, K, D), of storage_dtype (FP8: D is the packed row's bytes)."""
        width = self.rows.row_bytes if self.fp8 else self.head_dim
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, width)

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_shape) * self.storage_dtype.itemsize


@dataclass(frozen=True)
class CacheSpec:
    """What a model keeps per token (paged, long-term) and per request (short-term).

    `paged` describes Llama's K/V pages; a model with its own long-term layout (DeepSeek-V4's compressed
    entries) leaves it None and gives its block size in bytes and tokens instead."""

    paged: PagedSpec | None
    per_request_state_bytes: int  # sliding-window rings etc.; 0 for Llama
    block_bytes: int = 0  # when paged is None
    block_tokens: int = 0  # when paged is None
    kv_dtype: str = ""  # when paged is None: how the blocks store KV ("float8_e4m3fn": kv_quant.py's packed rows)

    @property
    def bytes_per_block(self) -> int:
        return self.paged.bytes_per_block if self.paged is not None else self.block_bytes

    @property
    def tokens_per_block(self) -> int:
        return self.paged.block_tokens if self.paged is not None else self.block_tokens

    def layout_id(self) -> str:
        """Part of the engine's cache identity: blobs only move between engines with the same layout."""
        p = self.paged
        if p is None:
            dtype = f":{self.kv_dtype}" if self.kv_dtype else ""  # bf16 and FP8 blocks never mix
            return f"blocks{self.block_bytes}xB{self.block_tokens}{dtype}:s{self.per_request_state_bytes}"
        paged = f"L{p.num_layers}xK{p.num_kv_heads}xD{p.head_dim}xB{p.block_tokens}"
        return f"{paged}:{str(p.dtype).removeprefix('torch.')}:s{self.per_request_state_bytes}"


class KVCache:
    # no short-term state: a rejected draft's K/V row is just overwritten by the next step, so any number of tokens
    # can be taken back; this bounds only how many drafts a step may verify (--speculative-tokens)
    backtrack = 16
    replay_tokens = 0  # every K/V is long-term: a restored prefix needs nothing recomputed

    def __init__(self, spec: CacheSpec, num_blocks: int, device: torch.device,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        assert spec.paged is not None, "models without a paged tier arrive with DeepSeek-V4"
        self.spec = spec
        self.num_blocks = num_blocks
        p = spec.paged
        L, kinds, B, K, D = p.block_shape
        self.kv = torch.zeros((L, kinds, num_blocks, B, K, D), dtype=p.storage_dtype, device=device)
        self.compute_dtype = compute_dtype  # what an FP8 cache's reads give

    @property
    def block_bytes(self) -> int:
        assert self.spec.paged is not None
        return self.spec.paged.bytes_per_block

    def layer(self, layer: int) -> tuple[Any, Any]:
        """K and V of one layer, each (num_blocks, block_tokens, kv_heads, head_dim): tensors, or for FP8 the
        packed rows seen as such (Fp8Rows: indexing dequantizes; the torch attention path only)."""
        assert self.spec.paged is not None
        if self.spec.paged.fp8:
            rows = self.spec.paged.rows
            return Fp8Rows(self.kv[layer, 0], rows, self.compute_dtype), Fp8Rows(self.kv[layer, 1], rows,
                                                                                 self.compute_dtype)
        return self.kv[layer, 0], self.kv[layer, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new keys/values (T, kv_heads, head_dim) at flat slots (T,)."""
        assert self.spec.paged is not None
        for kind, new in ((0, k), (1, v)):
            cache = self.kv[layer, kind]
            flat = cache.view(-1, *cache.shape[2:])
            if self.spec.paged.fp8:
                new = quantize(new, self.spec.paged.rows)
            flat.index_copy_(0, slots, new.to(flat.dtype))

    # --- long-term blocks as bytes ----------------------------------------------------------------------------
    # A run of blocks moves through one caller-given buffer (the shm arena's slot, a pinned host buffer), the
    # blobs one after another: one copy each way (on a GPU one device<->host transfer), never a `bytes` per block.

    def export_run(self, blocks: list[int], out: HostBuffer) -> None:
        """The blobs of `blocks` one after another into `out` (len(blocks) * block_bytes bytes, writable)."""
        on_device = device_run(out, len(blocks) * self.block_bytes)
        dst = None if on_device is not None else host_bytes(out, len(blocks) * self.block_bytes)
        if not blocks:
            return
        if self.kv.device.type == "cpu":
            assert dst is not None, "a CPU cache exports into host memory"
            # (L, 2, N, B*K*D) bytes: each blob is the L*2 rows of its block, copied once by numpy (a 6-D permute
            # through torch copies at about a thirtieth of that on CPU)
            rows = self._rows()
            per_block = dst.reshape(len(blocks), rows.shape[0], rows.shape[1], -1)
            for i, b in enumerate(blocks):
                per_block[i] = rows[:, :, b]
            return
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        # (L, 2, n, B, K, D) -> (n, L, 2, B, K, D) on the device, then one copy out (device->host, or on the device)
        data = self.kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
        (on_device if on_device is not None else torch.from_numpy(dst)).copy_(data.view(-1).view(torch.uint8))

    def import_run(self, blocks: list[int], src: HostBuffer) -> None:
        """Write `blocks` from `src`, their blobs one after another (what export_run wrote)."""
        assert self.spec.paged is not None
        on_device = device_run(src, len(blocks) * self.block_bytes)
        data = None if on_device is not None else host_bytes(src, len(blocks) * self.block_bytes)
        if not blocks:
            return
        if self.kv.device.type == "cpu":
            assert data is not None, "a CPU cache imports from host memory"
            rows = self._rows()
            per_block = data.reshape(len(blocks), rows.shape[0], rows.shape[1], -1)
            for i, b in enumerate(blocks):
                rows[:, :, b] = per_block[i]
            return
        # one host->device copy, or none (a peer GPU's run: one device copy, the index_copy_ below)
        raw = on_device.to(self.kv.device) if on_device is not None else to_device(data, self.kv.device)
        runs = raw.view(self.kv.dtype).view(len(blocks), *self.spec.paged.block_shape)  # FP8: uint8 rows
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, index, runs.permute(1, 2, 0, 3, 4, 5))

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        """The blobs of `blocks` as bytes (the NATS path): export_run, then one bytes per block."""
        return split_blobs(self.export_run, blocks, self.block_bytes)

    def write_blocks(self, blocks: list[int], blobs: Sequence[Blob]) -> None:
        """Write blobs (bytes, or views of a buffer such as the arena's: imported from where they lie)."""
        assert len(blocks) == len(blobs)
        check_blobs(blobs, self.block_bytes)
        device = self.kv.device
        runs = runs_of(blobs, True) if device.type == "cpu" else staged_runs(blobs, self.block_bytes, device)
        for at, end, data in runs:
            self.import_run(blocks[at:end], data)
        sync_device(device)

    def _rows(self) -> np.ndarray:
        """The cache's bytes as a writable (L, 2, N, B*K*D*itemsize) array, no copy (CPU only)."""
        L, kinds, n = self.kv.shape[:3]
        return self.kv.view(L, kinds, n, -1).view(torch.uint8).numpy()

    # --- short-term per-request state (empty for Llama) -------------------------------------------------------

    def export_state(self, request_id: str, length: int) -> bytes:
        assert self.spec.per_request_state_bytes == 0, "Llama keeps no per-request state"
        return b""

    def import_state(self, request_id: str, state: bytes) -> None:
        if len(state) != self.spec.per_request_state_bytes:
            raise ValueError(f"per-request state of {len(state)} bytes, expected {self.spec.per_request_state_bytes}")

    def drop_state(self, request_id: str) -> None:
        """Forget a request's short-term state (nothing to forget for Llama)."""

    def begin(self, request_id: str, restored: int) -> int:
        """A request is admitted with `restored` tokens' KV in its blocks: compute from there (all of Llama's
        KV is long-term, nothing to rebuild)."""
        return restored


# --- host buffers (shared with models that have their own long-term layout) --------------------------------------


def host_bytes(buf: HostBuffer, nbytes: int) -> np.ndarray:
    """`buf` as a flat uint8 array over the same memory, no copy (a CPU tensor, a numpy array, a bytes-like)."""
    if isinstance(buf, torch.Tensor):
        assert buf.device.type == "cpu" and buf.is_contiguous(), "a contiguous host tensor"
        arr = buf.detach().reshape(-1).view(torch.uint8).numpy()
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.size != nbytes:
        raise ValueError(f"a buffer of {arr.size} bytes for a run of {nbytes}")
    return arr


def device_run(buf: object, nbytes: int) -> torch.Tensor | None:
    """`buf` as a flat uint8 tensor when it lies on a GPU (checked to be `nbytes`), else None (host memory)."""
    if not isinstance(buf, torch.Tensor) or buf.device.type == "cpu":
        return None
    assert buf.dtype == torch.uint8 and buf.is_contiguous(), "a contiguous uint8 device tensor"
    flat = buf.reshape(-1)
    if flat.numel() != nbytes:
        raise ValueError(f"a device buffer of {flat.numel()} bytes for a run of {nbytes}")
    return flat


def to_device(data: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host->device copy of `data` (read-only memory is fine: nothing writes through the host tensor)."""
    return _host_tensor(data).to(device)


def check_blobs(blobs: Sequence[Blob], block_bytes: int) -> None:
    for blob in blobs:
        if len(blob) != block_bytes:
            raise ValueError(f"KV blob of {len(blob)} bytes, expected {block_bytes}")


def split_blobs(export: Callable[[list[int], HostBuffer], None], blocks: list[int], block_bytes: int) -> list[bytes]:
    buf = memoryview(bytearray(len(blocks) * block_bytes))
    export(blocks, buf)
    return [bytes(buf[i * block_bytes : (i + 1) * block_bytes]) for i in range(len(blocks))]


def runs_of(blobs: Sequence[Blob], each: bool, join: bool = True
            ) -> Iterator[tuple[int, int, np.ndarray | torch.Tensor]]:
    """(start, end, bytes) covering `blobs` in order: blobs that lie back to back in one buffer (a run the arena
    lent) as one view of it, so a run crosses to the device in one copy; the others joined into one copy per
    stretch of them, so an import is a few large copies, not one per blob (`join` False: each of those on its
    own, for a caller that copies them into one buffer itself). `each`: every blob on its own, no join (where
    one copy per block costs nothing more, as Llama's on the CPU). Blobs in device memory (DeviceBlob) come as
    device tensors, back-to-back ones of one run as one."""
    if any(isinstance(b, DeviceBlob) for b in blobs):
        yield from _device_runs(blobs, join)
        return
    if each:
        for i, blob in enumerate(blobs):
            yield i, i + 1, np.frombuffer(blob, dtype=np.uint8)
        return
    if not join:
        at = 0
        while at < len(blobs):
            end, view = _adjacent(blobs, at)
            yield at, end, view
            at = end
        return
    loose = 0  # the stretch of blobs that lie nowhere in particular starts here
    at = 0
    while at < len(blobs):
        end, view = _adjacent(blobs, at)
        if end - at > 1:
            if loose < at:
                yield loose, at, _joined(blobs[loose:at])
            yield at, end, view
            loose = end
        at = end
    if loose < len(blobs):
        yield loose, len(blobs), _joined(blobs[loose:])


def _device_runs(blobs: Sequence[Blob], join: bool) -> Iterator[tuple[int, int, np.ndarray | torch.Tensor]]:
    """runs_of for a list that has device blobs: each stretch of them lying back to back in one run as one
    tensor, the host blobs between as runs_of gives them."""
    at = 0
    while at < len(blobs):
        first = blobs[at]
        if not isinstance(first, DeviceBlob):
            end = next((i for i in range(at, len(blobs)) if isinstance(blobs[i], DeviceBlob)), len(blobs))
            for lo, hi, data in runs_of(blobs[at:end], False, join):
                yield at + lo, at + hi, data
            at = end
            continue
        end, nbytes = at + 1, first.nbytes
        while end < len(blobs):
            nxt = blobs[end]
            if not isinstance(nxt, DeviceBlob) or nxt.run is not first.run or nxt.offset != first.offset + nbytes:
                break
            end, nbytes = end + 1, nbytes + nxt.nbytes
        yield at, end, first.run[first.offset : first.offset + nbytes]
        at = end


STAGE_BYTES = 64 << 20  # a GPU import's staging buffer: a few of them for a long prompt, not one per arena slot


def staged_runs(blobs: Sequence[Blob], block_bytes: int, device: torch.device, max_bytes: int = STAGE_BYTES
                ) -> Iterator[tuple[int, int, np.ndarray | torch.Tensor]]:
    """runs_of for a GPU cache's import: the blobs gathered into device buffers of up to `max_bytes` (each piece,
    a blob or a run of adjacent ones, copied into its place once, host->device or on the device), so the import
    scatters each buffer into the paged tensors once (a model with many paged tensors, as V4's 43 layers of
    entries and indexer keys, pays its launches per buffer, not per arena slot). Blobs that are one piece already
    come as they are. The host->device copies are asynchronous: the caller synchronises before the host bytes
    may go (sync_device)."""
    pieces = list(runs_of(blobs, False, join=False))
    if len(pieces) <= 1:
        yield from pieces
        return
    per = max(1, max_bytes // block_bytes)
    for lo in range(0, len(blobs), per):
        hi = min(len(blobs), lo + per)
        staged = torch.empty((hi - lo) * block_bytes, dtype=torch.uint8, device=device)
        for start, end, data in pieces:
            s, e = max(start, lo), min(end, hi)
            if s >= e:
                continue
            part = data[(s - start) * block_bytes : (e - start) * block_bytes]
            src = part if isinstance(part, torch.Tensor) else _host_tensor(part)
            staged[(s - lo) * block_bytes : (e - lo) * block_bytes].copy_(src, non_blocking=True)
        yield lo, hi, staged


def export_staged(export_run: Callable[[list[int], HostBuffer], None], parts: Sequence[tuple[list[int], HostBuffer]],
                  block_bytes: int, device: torch.device, max_bytes: int = STAGE_BYTES) -> None:
    """Each part's blocks into its host buffer (a put round's arena slots), as export_run would one part at a
    time, but on a GPU through device buffers of up to `max_bytes`: each buffer gathered from the paged tensors
    once (one export_run on the device), then copied out to its parts' buffers asynchronously, and one
    synchronise at the end. A V4 cache pays its ~64 gathers and one wait per buffer, not per 4 MiB slot. The
    buffers need no waits between them: the gathers and copies run in order on one stream."""
    if device.type != "cuda" or len(parts) <= 1:
        for blocks, out in parts:
            export_run(blocks, out)
        return
    per = max(1, max_bytes // block_bytes)
    at = 0
    while at < len(parts):
        end, count = at + 1, len(parts[at][0])
        while end < len(parts) and count + len(parts[end][0]) <= per:
            count += len(parts[end][0])
            end += 1
        staged = torch.empty(count * block_bytes, dtype=torch.uint8, device=device)
        export_run([b for blocks, _ in parts[at:end] for b in blocks], staged)
        offset = 0
        for blocks, out in parts[at:end]:
            nbytes = len(blocks) * block_bytes
            torch.from_numpy(host_bytes(out, nbytes)).copy_(staged[offset : offset + nbytes], non_blocking=True)
            offset += nbytes
        at = end
    sync_device(device)


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued copies (a staged import's, before its host bytes are let go)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _host_tensor(data: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable": it is only read
        return torch.from_numpy(data)


def _adjacent(blobs: Sequence[Blob], at: int) -> tuple[int, np.ndarray]:
    """The end of the run of views from `at` on that lie back to back in one buffer, and one view of the run."""
    first = np.frombuffer(blobs[at], dtype=np.uint8)
    owner = blobs[at].obj if isinstance(blobs[at], memoryview) else None
    end, nbytes = at + 1, first.size
    while owner is not None and end < len(blobs):
        nxt = blobs[end]
        if not isinstance(nxt, memoryview) or nxt.obj is not owner:
            break
        if np.frombuffer(nxt, dtype=np.uint8).ctypes.data != first.ctypes.data + nbytes:
            break
        end, nbytes = end + 1, nbytes + len(nxt)
    if end - at == 1:
        return end, first
    whole = np.frombuffer(owner, dtype=np.uint8)
    offset = first.ctypes.data - whole.ctypes.data
    return end, whole[offset : offset + nbytes]


def _joined(blobs: Sequence[Blob]) -> np.ndarray:
    return np.frombuffer(blobs[0], dtype=np.uint8) if len(blobs) == 1 else np.frombuffer(b"".join(blobs), np.uint8)
