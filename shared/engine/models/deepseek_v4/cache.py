"""DeepSeek-V4's cache, split in two tiers.

Long-term (paged, prefix-cacheable, what the kvcache service stores for days): the compressed entries. A block
covers `block_tokens` tokens (a multiple of every compress ratio, 128 for the real models) and holds, for every
compressed layer, the entries of the windows inside it; CSA layers also hold their indexer keys.

    block b of a sequence, layer l with ratio m:   entries[l][table[b], j] = entry of window (b * BT / m + j)

Short-term (per request, a TTL of minutes): what the next token needs besides the entries, as rings indexed by
position % capacity:

    swa[l]       K = V of the last (window - 1) tokens, every layer
    comp[l]      raw compressor projections (kv, gate) of the last 2 windows (CSA: entry w mixes windows w-1, w)
                 or 1 window (HCA): the tokens of a window still open, and the one before it
    index[l]     the same for the indexer's own compressor (CSA only)

Every ring has `backtrack` spare slots, so up to that many tokens can be taken back (a rejected speculative
draft, the overlapped scheduler's one-token lag) by moving `length` back: nothing is overwritten that a
re-computation needs. Which entries a query sees follows from its position alone ((p + 1) // m closed windows),
so an entry built from a taken-back token is simply never read before it is rebuilt.

Pooled. Every ring is one row of a per-layer pool, (slots, cap, width), and a RequestState holds its slot and views
of that row: the per-sequence path reads and writes the views, a batched decode step indexes the pools with the
batch's slot ids (decode.py). There are `slots` rows, sized by the engine to max_running plus as many again for
requests held after they finish (their state waits for export until release); a request that finds none free
fails with a clear error rather than overwriting another's. One more row, and one more paged block, are scratch:
the padding rows of a CUDA-graph decode step (graphs.py) write there and nobody reads them.

Bounded replay. A request that finds its prefix's blocks but not its short-term state recomputes only the last
`replay_tokens` tokens before the restored prefix end C, with the entries of [0, C) frozen (never rewritten).
A layer-l key of token p depends on tokens (p - l (W - 1) - ..., p]: the sliding windows of the layers below
widen the cone by W - 1 tokens per layer, so `num_layers * (window - 1)` tokens rebuild every ring exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.engine.kv_cache import (Blob, HostBuffer, check_blobs, device_run, host_bytes, runs_of, split_blobs,
                                    staged_runs, sync_device, to_device)
from shared.engine.kv_quant import FP8, Fp8Rows, RowLayout, storage
from shared.engine.models.deepseek_v4.spec import CSA, DeepseekV4Spec

HEADER = 24  # length, begin, mtp_length as int64


@dataclass
class RequestState:
    """One request's short-term state; `length` tokens processed, rings valid for positions >= `begin`."""

    length: int
    slot: int  # its row of the cache's pools; swa, comp, index and pending are views of that row
    begin: int  # positions before this were never computed here (bounded replay starts here)
    frozen: int  # entries of windows ending at or before this position are restored: never rewritten
    swa: list[torch.Tensor | Fp8Rows]  # per layer (cap_swa, head_dim), then the MTP layer's if the model drafts
    comp: list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer (cap, C) kv, gate; None: sliding layer
    index: list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer; CSA only
    # MTP: pairs (main streams at j, token j + 1) for j < mtp_length are in the MTP ring; the main streams at
    # position mtp_length wait in `pending` for their next token while mtp_length < length
    mtp_length: int = 0
    pending: torch.Tensor | None = None  # (hc, D)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the state's bytes (an FP8 ring's packed rows), in snapshot order."""
        out = [storage(t) for t in self.swa] + ([] if self.pending is None else [self.pending])
        for pair in (*self.comp, *self.index):
            if pair is not None:
                out += pair
        return out


class V4Cache:
    def __init__(self, spec: DeepseekV4Spec, num_blocks: int, device: torch.device, dtype: torch.dtype,
                 backtrack: int = 4, mtp: bool = False, slots: int = 8, kv_dtype: torch.dtype | None = None) -> None:
        """dtype: the model's compute dtype; kv_dtype: the cache's (None: the same). FP8 (kv_quant.py) packs the
        compressed entries, indexer keys and sliding-window rings as e4m3 rows with float32 scales; the
        compressors' raw rings and MTP's pending streams stay in the compute dtype (they feed a softmax's gates
        and a whole hidden state, and are a small share of the bytes; DeepSeek's reference keeps them wide).
        backtrack: tokens that can be taken back (speculative drafts rejected); mtp: keep the MTP layer's
        ring and pending streams too; slots: requests whose short-term state can be live at once."""
        self.spec = spec
        self.mtp = mtp
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype  # what readers get
        self.kv_dtype = kv_dtype or dtype
        self.fp8 = self.kv_dtype == FP8
        # rope channels trail an entry / a window key (kept bf16 under FP8); the indexer key is quantized whole
        self._kv_rows = RowLayout(spec.head_dim, spec.rope_head_dim)
        self._index_rows = RowLayout(spec.index_head_dim, 0)
        self.block_tokens = spec.block_tokens
        self.backtrack = backtrack
        self.cap_swa = spec.window - 1 + backtrack
        # per compressed layer: entries (num_blocks, BT / m, head_dim); CSA: indexer keys too
        # one row past the pool's: the scratch block, where the padding rows of a captured decode step write
        self.scratch_block = num_blocks
        self.entries: list[torch.Tensor | None] = []
        self.index_keys: list[torch.Tensor | None] = []
        rows = num_blocks + 1
        for kind, m in zip(spec.kinds, spec.ratios):
            per = self.block_tokens // m if m else 0
            self.entries.append(self._store((rows, per), self._kv_rows) if m else None)
            self.index_keys.append(self._store((rows, per), self._index_rows) if kind == CSA else None)
        # what a block's blob holds: each store's bytes (FP8: packed rows), uint8 or the cache dtype
        self._paged = [storage(t) for pair in zip(self.entries, self.index_keys) for t in pair if t is not None]
        self.states: dict[str, RequestState] = {}
        self._pending: dict[str, bytes] = {}  # imported short-term state, installed at admission
        self._pools(slots)

    def _store(self, shape: tuple[int, ...], layout: RowLayout) -> torch.Tensor | Fp8Rows:
        """A zeroed store of rows of `layout.width` channels: packed FP8 rows, or a tensor of the cache dtype."""
        if self.fp8:
            return Fp8Rows.zeros(shape, layout, self.dtype, self.device)
        return torch.zeros(*shape, layout.width, dtype=self.kv_dtype, device=self.device)

    def _pools(self, slots: int) -> None:
        s, dev, dt = self.spec, self.device, self.kv_dtype if not self.fp8 else self.dtype
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.scratch_slot = slots  # a row past the lent ones: padding rows of a captured decode step use it
        slots += 1

        def pair(layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
            cap = self.comp_capacity(layer)
            return (torch.zeros(slots, cap, width, dtype=dt, device=dev),
                    torch.zeros(slots, cap, width, dtype=dt, device=dev))

        rings = s.num_layers + (1 if self.mtp else 0)
        self.swa_pool = [self._store((slots, self.cap_swa), self._kv_rows) for _ in range(rings)]
        self.comp_pool: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.index_pool: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer, kind in enumerate(s.kinds):
            csa = kind == CSA
            self.comp_pool.append(pair(layer, (2 if csa else 1) * s.head_dim) if s.ratios[layer] else None)
            self.index_pool.append(pair(layer, 2 * s.index_head_dim) if csa else None)
        self.pending_pool = torch.zeros(slots, s.hc_mult, s.hidden_size, dtype=dt, device=dev) if self.mtp else None

    # --- sizes ------------------------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._paged)

    @property
    def state_bytes(self) -> int:
        """One request's exported state: the header and its row of every pool."""
        pools = [storage(t) for t in self.swa_pool] + ([] if self.pending_pool is None else [self.pending_pool])
        for pair in (*self.comp_pool, *self.index_pool):
            if pair is not None:
                pools += pair
        return HEADER + sum(t.shape[1:].numel() * t.element_size() for t in pools)

    @property
    def pool_bytes(self) -> int:
        """Device memory of the per-request pools (allocated up front: count it with the KV pool)."""
        return (self.slots + 1) * (self.state_bytes - HEADER)

    @property
    def replay_tokens(self) -> int:
        return self.spec.num_layers * (self.spec.window - 1)

    def comp_capacity(self, layer: int) -> int:
        m = self.spec.ratios[layer]
        return (2 if self.spec.kinds[layer] == CSA else 1) * m + self.backtrack

    # --- the request lifecycle --------------------------------------------------------------------------------

    def begin(self, request_id: str, restored: int) -> int:
        """A request is admitted with `restored` tokens' blocks in its table (a multiple of block_tokens, or
        its imported prefix); returns the position to compute from."""
        old = self.states.pop(request_id, None)  # a preempted request resumes: its old state is recomputed
        if old is not None:
            self._free.append(old.slot)
        blob = self._pending.get(request_id)  # kept until drop_state: an admission that fails comes back
        if blob is not None and int(np.frombuffer(blob[:8], dtype=np.int64)[0]) == restored:
            self.states[request_id] = self._decode(blob)
            return restored
        start = max(0, restored - self.replay_tokens) if restored else 0
        self.states[request_id] = self._fresh(start, start, restored)
        return start

    def state(self, request_id: str, start: int) -> RequestState:
        """The state a chunk starting at `start` continues (positions after `start` are taken back)."""
        state = self.states[request_id]
        if not state.begin <= start <= state.length or state.length - start > self.backtrack:
            raise ValueError(f"{request_id}: chunk at {start}, state holds [{state.begin}, {state.length})")
        state.length = start
        return state

    def drop_state(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self._free.append(state.slot)
        self._pending.pop(request_id, None)

    # --- long-term blocks as bytes ----------------------------------------------------------------------------
    # A block's blob: every paged tensor's row of that block, flattened, in `_paged` order. A run moves through
    # one caller-given buffer with one copy each way (kv_cache.KVCache.export_run has the contract).

    def export_run(self, blocks: list[int], out: HostBuffer) -> None:
        on_device = device_run(out, len(blocks) * self.block_bytes)
        if on_device is None:
            dst = host_bytes(out, len(blocks) * self.block_bytes).reshape(len(blocks), -1)  # (n, block_bytes)
        if not blocks:
            return
        if self.device.type == "cpu":
            assert on_device is None, "a CPU cache exports into host memory"
            at = 0
            for t in self._paged:  # each tensor's rows of the run, gathered straight into their columns
                rows = t.view(torch.uint8).reshape(t.shape[0], -1).numpy()  # (N, row bytes)
                np.take(rows, blocks, axis=0, out=dst[:, at : at + rows.shape[1]], mode="clip")
                at += rows.shape[1]
            return
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        parts = [t.index_select(0, index).flatten(1) for t in self._paged]  # each (n, elems), on the device
        data = torch.cat(parts, dim=1).view(torch.uint8)  # (n, block_bytes)
        if on_device is not None:  # a peer GPU's hand-over (CUDA IPC): no host copy
            on_device.view(len(blocks), -1).copy_(data)
        else:
            torch.from_numpy(dst).copy_(data)  # one device->host copy

    def import_run(self, blocks: list[int], src: HostBuffer) -> None:
        on_device = device_run(src, len(blocks) * self.block_bytes)
        if on_device is None:
            data = host_bytes(src, len(blocks) * self.block_bytes).reshape(len(blocks), -1)
        if not blocks:
            return
        if self.device.type == "cpu":
            assert on_device is None, "a CPU cache imports from host memory"
            at = 0
            for t in self._paged:
                rows = t.view(torch.uint8).reshape(t.shape[0], -1).numpy()
                rows[blocks] = data[:, at : at + rows.shape[1]]
                at += rows.shape[1]
            return
        # one host->device copy, or a device copy of a peer GPU's run
        raw = on_device.to(self.device) if on_device is not None else to_device(data, self.device)
        run = raw.view(len(blocks), -1)  # bytes: the paged tensors may differ in dtype
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        at = 0
        for t in self._paged:
            n = t[0].numel() * t.element_size()
            rows = run[:, at : at + n].contiguous().view(t.dtype)  # contiguous: aligned for the dtype's view
            t.index_copy_(0, index, rows.reshape(len(blocks), *t.shape[1:]))
            at += n

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        return split_blobs(self.export_run, blocks, self.block_bytes)

    def write_blocks(self, blocks: list[int], blobs: Sequence[Blob]) -> None:
        assert len(blocks) == len(blobs)
        check_blobs(blobs, self.block_bytes)
        # per run, not per blob: a few large copies per tensor; on a GPU per staging buffer (see staged_runs)
        runs = runs_of(blobs, False) if self.device.type == "cpu" else staged_runs(blobs, self.block_bytes, self.device)
        for at, end, data in runs:
            self.import_run(blocks[at:end], data)
        sync_device(self.device)

    # --- short-term state as bytes ----------------------------------------------------------------------------

    def export_state(self, request_id: str, length: int) -> bytes:
        """The state after `length` tokens (a token computed past it, e.g. the overlapped scheduler's taken-back
        one, is rolled back first)."""
        state = self.state(request_id, length)
        header = np.array([state.length, state.begin, state.mtp_length], dtype=np.int64).tobytes()
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.tensors()]).cpu()  # pool rows: contiguous
        return header + flat.numpy().tobytes()

    def import_state(self, request_id: str, blob: bytes) -> None:
        if len(blob) != self.state_bytes:
            raise ValueError(f"per-request state of {len(blob)} bytes, expected {self.state_bytes}")
        self._pending[request_id] = blob

    def _decode(self, blob: bytes) -> RequestState:
        length, begin, mtp_length = (int(v) for v in np.frombuffer(blob[:HEADER], dtype=np.int64))
        state = self._fresh(length, begin, length)
        state.mtp_length = mtp_length
        flat = torch.frombuffer(bytearray(blob[HEADER:]), dtype=torch.uint8).to(self.device)
        at = 0
        for t in state.tensors():
            n = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(flat[at : at + n])  # a pool row is contiguous: a view of it
            at += n
        return state

    def _fresh(self, length: int, begin: int, frozen: int) -> RequestState:
        """A zeroed state in a free slot (the caller puts it in `states`, drop_state frees the slot)."""
        if not self._free:
            raise RuntimeError(f"DeepSeek-V4 per-request state: all {self.slots} slots are in use (running and "
                               "held requests); release held requests or size the pool for more")
        slot = self._free.pop()
        swa = [pool.row(slot) if isinstance(pool, Fp8Rows) else pool[slot] for pool in self.swa_pool]
        comp = [None if p is None else (p[0][slot], p[1][slot]) for p in self.comp_pool]
        index = [None if p is None else (p[0][slot], p[1][slot]) for p in self.index_pool]
        pending = None if self.pending_pool is None else self.pending_pool[slot]
        state = RequestState(length, slot, begin, frozen, swa, comp, index, mtp_length=begin, pending=pending)
        for t in state.tensors():
            t.zero_()
        return state
