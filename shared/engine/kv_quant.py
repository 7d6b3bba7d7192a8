"""FP8 KV storage: rows of e4m3 values with float32 scales, read and written as compute-dtype rows.

One row (a token's key, a compressed entry, an indexer key) is packed into bytes as FlashMLA's `fp8_ds_mla`
packs an MLA token (vLLM's FP8 layout for DeepSeek):

    [ nope channels as e4m3 | one float32 scale per `group` of them | rope channels as bfloat16 ]

The scale of a group is its amax / 448 (e4m3's largest finite value), so every group uses the whole FP8 range;
RoPE's channels stay bfloat16 because a rotation's small components lose their angle in 3 mantissa bits (and
they are a small share of the row). Groups are 64 channels where the width allows (gcd with 64): DeepSeek-V4's
448 non-RoPE channels are 7 of them (FlashMLA's 128 does not divide 448). One packed uint8 tensor per store keeps
a block's blob what it was (each paged tensor's rows, flattened): the FP8 bytes and their scales travel together.

`Fp8Rows` wraps such a tensor so the model's code indexes it as it indexes a compute-dtype tensor: reading
`rows[idx]` dequantizes the gathered rows, `rows[idx] = x` quantizes x. Only leading dims are ever indexed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
ROPE_DTYPE = torch.bfloat16
GROUP = 64  # channels per scale at most
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")  # --kv-cache-dtype: the model's dtype | bfloat16 | e4m3 with scales


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype's name -> the cache's storage dtype (FP8 stands for the packed rows of this module)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {name!r}")
    return {"auto": model_dtype, "bf16": torch.bfloat16, "fp8": FP8}[name]


@dataclass(frozen=True)
class RowLayout:
    """How a row of `width` channels (the last `rope` of them RoPE's) packs into bytes."""

    width: int
    rope: int

    @property
    def nope(self) -> int:
        return self.width - self.rope

    @property
    def group(self) -> int:
        return math.gcd(self.nope, GROUP) if self.nope else 1

    @property
    def groups(self) -> int:
        return self.nope // self.group

    @property
    def rope_at(self) -> int:
        """Byte offset of the RoPE channels in a row (past the e4m3 bytes and their scales)."""
        return self.nope + 4 * self.groups

    @property
    def row_bytes(self) -> int:
        return self.rope_at + ROPE_DTYPE.itemsize * self.rope


def quantize(x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """(..., width) -> (..., row_bytes) uint8. Pure tensor ops, no host sync (a CUDA graph can capture it)."""
    lead = x.shape[:-1]
    x = x.float()
    nope = x[..., : layout.nope].reshape(*lead, layout.groups, layout.group)
    scale = nope.abs().amax(-1) / FP8_MAX  # (..., groups); 0 for an all-zero group: stored as 0, read as 0
    q = (nope / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    parts = [q.reshape(*lead, layout.nope).view(torch.uint8), scale.contiguous().view(torch.uint8)]
    if layout.rope:
        parts.append(x[..., layout.nope :].to(ROPE_DTYPE).contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1)


def dequantize(raw: torch.Tensor, layout: RowLayout, dtype: torch.dtype) -> torch.Tensor:
    """(..., row_bytes) uint8 -> (..., width) in `dtype`."""
    lead, n, g = raw.shape[:-1], layout.nope, layout.groups
    q = raw[..., :n].contiguous().view(FP8).float().view(*lead, g, layout.group)
    scale = raw[..., n : layout.rope_at].contiguous().view(torch.float32)
    out = (q * scale[..., None]).view(*lead, n)
    if layout.rope:
        out = torch.cat([out, raw[..., layout.rope_at :].contiguous().view(ROPE_DTYPE).float()], dim=-1)
    return out.to(dtype)


class Fp8Rows:
    """A packed FP8 store (`raw`: (..., row_bytes) uint8) seen as (..., width) rows of `dtype`."""

    def __init__(self, raw: torch.Tensor, layout: RowLayout, dtype: torch.dtype) -> None:
        assert raw.dtype == torch.uint8 and raw.shape[-1] == layout.row_bytes
        self.raw, self.layout, self.dtype = raw, layout, dtype

    @classmethod
    def zeros(cls, shape: tuple[int, ...], layout: RowLayout, dtype: torch.dtype, device: torch.device) -> Fp8Rows:
        return cls(torch.zeros(*shape, layout.row_bytes, dtype=torch.uint8, device=device), layout, dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.raw.shape[:-1], self.layout.width))

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def __getitem__(self, index: Any) -> torch.Tensor:
        return dequantize(self.raw[index], self.layout, self.dtype)

    def __setitem__(self, index: Any, value: torch.Tensor) -> None:
        self.raw[index] = quantize(value, self.layout)

    def row(self, i: int) -> Fp8Rows:
        """A view of row i of the leading dim (a request's ring in a pool): writes go to the pool."""
        return Fp8Rows(self.raw[i], self.layout, self.dtype)


def storage(t: torch.Tensor | Fp8Rows) -> torch.Tensor:
    """The tensor that holds a store's bytes (what blobs and snapshots copy)."""
    return t.raw if isinstance(t, Fp8Rows) else t
