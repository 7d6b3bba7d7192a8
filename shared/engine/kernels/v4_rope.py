"""DeepSeek-V4's RoPE in place: the trailing 2 * half channels of each row rotated in interleaved pairs.

Only the rotated channels are read and written (64 of a head's 512 at V4-Flash's shape). The functional torch
version (models/deepseek_v4/rope.py `rotate`) concatenates the untouched channels back, so it moves the whole
tensor: ~1.2 ms a call for an 8K chunk's queries (8K x 64 heads x 512), five calls a layer.

    x (N, ..., D), rows contiguous in their leading dims; cos, sin (N, half) float32 (pass -sin to undo)

`rotate_` checks the layout itself (the one place for it) and declines, returning None, what it cannot rotate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rows"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, rows, per_token, stride_row, start,
                 HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    # each row's 2 * HALF rotated channels as one contiguous load and store (pairs split in registers): loading
    # the pairs' halves as two stride-2 vectors ran at about a quarter of the copy rate on an 8K chunk
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (r < rows)[:, None]
    tok = (r // per_token).to(tl.int64)
    at = x_ptr + r.to(tl.int64)[:, None] * stride_row + start + tl.arange(0, 2 * HALF)[None, :]
    a, b = tl.split(tl.reshape(tl.load(at, mask=ok, other=0.0).to(tl.float32), (BLOCK_R, HALF, 2)))
    i = tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + tok[:, None] * HALF + i, mask=ok, other=0.0)
    s = tl.load(sin_ptr + tok[:, None] * HALF + i, mask=ok, other=0.0)
    out = tl.reshape(tl.join(a * c - b * s, b * c + a * s), (BLOCK_R, 2 * HALF))
    tl.store(at, out.to(x_ptr.dtype.element_ty), mask=ok)


BLOCK_R = 32


def _rows(x: torch.Tensor, half: int) -> torch.Tensor | None:
    """x as (rows, D) without a copy, or None where the kernel cannot rotate it in place: half not a power of two
    (tl.arange), channels not at unit stride, or leading dims with no single row stride."""
    if half & (half - 1) or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dims not mergeable: not one row stride
        return None


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate x's trailing 2 * half channels in place (see the module docstring) and return x; None, x untouched,
    where its layout does not fit the kernel (the caller then rotates another way)."""
    half = cos.shape[-1]
    rows = _rows(x, half)
    if rows is None:
        return None
    R, D = rows.shape
    if R == 0:
        return x
    per_token = R // cos.shape[0]
    _rope_kernel[(triton.cdiv(R, BLOCK_R),)](rows, cos.float().contiguous(), sin.float().contiguous(), R,
                                             per_token, rows.stride(0), D - 2 * half, HALF=half, BLOCK_R=BLOCK_R)
    return x
