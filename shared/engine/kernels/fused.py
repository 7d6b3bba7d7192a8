"""Fused elementwise kernels: each replaces several torch ops (and their round trips through memory).

    embed          weight[ids] with placeholder ids -(r + 1) read from fed[r] (overlapped scheduling)
    rope_write     qkv (T, (H + 2 KV) * hd) from the fused projection: rotate q in place, rotate k and store
                   k, v into their pages (slot < 0 = padding row, not stored). One program per token.
    add_rms_norm   x += delta (rounded to the activation dtype, as the torch path does); h = RMSNorm(x)
    silu_mul       (T, 2 I) gate|up -> (T, I) silu(gate) * up
All arithmetic in float32; results rounded once to the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _embed_kernel(ids_ptr, fed_ptr, w_ptr, out_ptr, D: tl.constexpr, BLOCK: tl.constexpr, HAS_FED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    if HAS_FED:
        if tok < 0:
            tok = tl.load(fed_ptr + (-tok - 1)).to(tl.int64)
    for c0 in range(0, D, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        mask = c < D
        tl.store(out_ptr + t * D + c, tl.load(w_ptr + tok * D + c, mask=mask), mask=mask)


def embed(ids: torch.Tensor, weight: torch.Tensor, fed: torch.Tensor | None) -> torch.Tensor:
    """ids (T,) int32/int64, weight (V, D) contiguous, fed (R,) int64 or None -> (T, D)."""
    T = ids.shape[0]
    D = weight.shape[1]
    out = torch.empty((T, D), dtype=weight.dtype, device=weight.device)
    if T:
        block = min(triton.next_power_of_2(D), 2048)
        _embed_kernel[(T,)](ids, ids if fed is None else fed, weight, out, D=D, BLOCK=block,
                            HAS_FED=fed is not None)
    return out


@triton.jit
def _rope_write_kernel(
    qkv_ptr, pos_ptr, slot_ptr, rope_ptr, k_ptr, v_ptr, stride_t, stride_ks, stride_kh,
    H: tl.constexpr, KV: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(rope_ptr + pos * 2 * HALF + i)[None, :]  # rope table (P, 2, hd/2): cos then sin
    sin = tl.load(rope_ptr + pos * 2 * HALF + HALF + i)[None, :]
    head = tl.arange(0, HEADS_PAD)[:, None]  # q heads then k heads: H + KV rows of hd
    hmask = head < H + KV
    row = qkv_ptr + t * stride_t + head * (2 * HALF)
    x1 = tl.load(row + i[None, :], mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + i[None, :], mask=hmask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty)
    qmask = head < H
    tl.store(row + i[None, :], y1, mask=qmask)
    tl.store(row + HALF + i[None, :], y2, mask=qmask)
    if slot >= 0:
        kmask = (head >= H) & hmask
        kh = head - H
        dst = k_ptr + slot * stride_ks + kh * stride_kh
        tl.store(dst + i[None, :], y1.to(k_ptr.dtype.element_ty), mask=kmask)
        tl.store(dst + HALF + i[None, :], y2.to(k_ptr.dtype.element_ty), mask=kmask)
        vh = tl.arange(0, HEADS_PAD)[:, None]
        vmask = vh < KV
        d = tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(qkv_ptr + t * stride_t + (H + KV + vh) * (2 * HALF) + d, mask=vmask, other=0.0)
        tl.store(v_ptr + slot * stride_ks + vh * stride_kh + d, v.to(v_ptr.dtype.element_ty), mask=vmask)


def rope_write(
    qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rope: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
) -> None:
    """qkv (T, (H + 2 KV) * hd) rows contiguous; positions, slots (T,); rope (P, 2, hd / 2) float32;
    caches (num_blocks, B, KV, hd) contiguous. q rotated in place; k, v written at their slots."""
    T = qkv.shape[0]
    if T == 0:
        return
    _rope_write_kernel[(T,)](
        qkv, positions, slots, rope, k_cache, v_cache, qkv.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=num_heads, KV=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
        HALF=head_dim // 2,
    )


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, h_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
    HAS_W: tl.constexpr = True,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < N
    x = tl.load(x_ptr + t * N + c, mask=mask, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_ptr + t * N + c, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + t * N + c, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    h = xf * rstd
    if HAS_W:
        h = h * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + t * N + c, h.to(h_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, eps: float
                 ) -> torch.Tensor:
    """x (T, D) contiguous, updated in place to x + delta when delta is given; returns RMSNorm(x) (T, D), times
    weight unless it is None."""
    T, D = x.shape
    h = torch.empty_like(x)
    if T:
        _add_rms_norm_kernel[(T,)](
            x, x if delta is None else delta, x if weight is None else weight, h, eps, N=D,
            BLOCK=triton.next_power_of_2(D), HAS_DELTA=delta is not None, HAS_W=weight is not None,
            num_warps=4 if D <= 2048 else (8 if D <= 8192 else 16),
        )
    return h


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < I
    gate = tl.load(gu_ptr + t * 2 * I + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * 2 * I + I + c, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * I + c, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2 I) contiguous -> (T, I)."""
    T, I2 = gate_up.shape
    out = torch.empty((T, I2 // 2), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if T:
        _silu_mul_kernel[(T, triton.cdiv(I2 // 2, block))](gate_up, out, I=I2 // 2, BLOCK=block)
    return out
