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

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PagedSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        n = self.num_layers * 2 * self.block_tokens * self.num_kv_heads * self.head_dim
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class CacheSpec:
    """What a model keeps per token (paged, long-term) and per request (short-term).

    `paged` describes Llama's K/V pages; a model with its own long-term layout (DeepSeek-V4's compressed
    entries) leaves it None and gives its block size in bytes and tokens instead."""

    paged: PagedSpec | None
    per_request_state_bytes: int  # sliding-window rings etc.; 0 for Llama
    block_bytes: int = 0  # when paged is None
    block_tokens: int = 0  # when paged is None

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
            return f"blocks{self.block_bytes}xB{self.block_tokens}:s{self.per_request_state_bytes}"
        paged = f"L{p.num_layers}xK{p.num_kv_heads}xD{p.head_dim}xB{p.block_tokens}"
        return f"{paged}:{str(p.dtype).removeprefix('torch.')}:s{self.per_request_state_bytes}"


class KVCache:
    backtrack = 0  # a request is never taken back past its computed tokens (no speculative drafts)
    replay_tokens = 0  # every K/V is long-term: a restored prefix needs nothing recomputed

    def __init__(self, spec: CacheSpec, num_blocks: int, device: torch.device) -> None:
        assert spec.paged is not None, "models without a paged tier arrive with DeepSeek-V4"
        self.spec = spec
        self.num_blocks = num_blocks
        p = spec.paged
        self.kv = torch.zeros(
            (p.num_layers, 2, num_blocks, p.block_tokens, p.num_kv_heads, p.head_dim), dtype=p.dtype, device=device
        )

    @property
    def block_bytes(self) -> int:
        assert self.spec.paged is not None
        return self.spec.paged.bytes_per_block

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each (num_blocks, block_tokens, kv_heads, head_dim)."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new keys/values (T, kv_heads, head_dim) at flat slots (T,)."""
        k_cache, v_cache = self.layer(layer)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))

    # --- long-term blocks as bytes ----------------------------------------------------------------------------

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        if not blocks:
            return []
        if self.kv.device.type == "cpu":
            # (L, 2, N, B*K*D) bytes: each blob is the L*2 rows of its block, copied once by numpy (a 6-D permute
            # through torch copies at about a thirtieth of that on CPU)
            rows = self._rows()
            return [rows[:, :, b].tobytes() for b in blocks]
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        # (L, 2, n, B, K, D) -> (n, L, 2, B, K, D): one blob per block, one device->host copy for all of them
        data = self.kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        raw = data.view(len(blocks), -1).view(torch.uint8).numpy()
        return [raw[i].tobytes() for i in range(len(blocks))]

    def write_blocks(self, blocks: list[int], blobs: list[bytes]) -> None:
        assert len(blocks) == len(blobs)
        if not blocks:
            return
        assert self.spec.paged is not None
        for blob in blobs:
            if len(blob) != self.block_bytes:
                raise ValueError(f"KV blob of {len(blob)} bytes, expected {self.block_bytes}")
        if self.kv.device.type == "cpu":
            rows = self._rows()
            for b, blob in zip(blocks, blobs):
                rows[:, :, b] = np.frombuffer(blob, dtype=np.uint8).reshape(rows.shape[0], rows.shape[1], -1)
            return
        raw = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
        data = raw.view(self.kv.dtype).view(len(blocks), *self.spec.paged.block_shape).to(self.kv.device)
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, index, data.permute(1, 2, 0, 3, 4, 5))

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
