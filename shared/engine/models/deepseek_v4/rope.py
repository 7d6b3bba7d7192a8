"""DeepSeek-V4's rotary embedding: interleaved pairs on the trailing `rope_head_dim` channels of a head.

Two tables per model: "main" (plain, rope_theta) for sliding-only layers and "compress" (compress_rope_theta,
optionally YaRN-scaled, never multiplied by YaRN's attention factor) for CSA / HCA layers, their compressors and
the indexer. Angles are computed in float32 exactly as the reference does (position * inv_freq), so positions in
the hundreds of thousands round the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shared.engine.fusion import fused
from shared.engine.kernels import HAVE_TRITON

if HAVE_TRITON:
    from shared.engine.kernels.v4_rope import rotate_ as rotate_rows_


def inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """(dim / 2,) float32 inverse frequencies; `scaling` holds YaRN's parameters (None = plain RoPE)."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    plain = 1.0 / base
    if scaling is None:
        return plain
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the channel whose wavelength fits `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(correction_dim(fast)), 0), min(math.ceil(correction_dim(slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate (divided by factor)
    return (1.0 / (factor * base)) * (1 - keep) + plain * keep


class Rotary:
    """cos / sin of one table for a batch of positions, and the rotation itself."""

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device) -> None:
        self.dim = dim
        self.inv_freq = inv_freq(dim, theta, scaling).to(device)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (N,) -> cos, sin (N, dim / 2) float32."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq
        return freqs.cos(), freqs.sin()


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x's trailing 2 * cos.shape[-1] channels rotated in interleaved pairs, in x's dtype."""
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    rope = x[..., -2 * half :].float().unflatten(-1, (half, 2))
    a, b = rope[..., 0], rope[..., 1]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)


@fused
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x (N, ..., D) in interleaved pairs; cos/sin (N, dim/2).

    Pass -sin to undo a rotation (V4 un-rotates the attention output at the query's position). Pure: for
    functions fused as a whole (fusion.py); a fresh tensor that may change in place takes `rotate_`."""
    return torch.cat((x[..., : -2 * cos.shape[-1]], _rotated(x, cos, sin)), dim=-1)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate` in place, returning x: only the rotated channels are read and written (on CUDA one Triton
    launch, kernels/v4_rope.py). x must be the caller's own tensor (a fresh projection or attention output)."""
    if x.is_cuda and HAVE_TRITON and rotate_rows_(x, cos, sin) is not None:  # None: a layout it declines
        return x
    x[..., -2 * cos.shape[-1] :] = _rotated(x, cos, sin)
    return x
