"""Small-batch linear layers (M <= 16 rows: decode at batch 1-8) with the neighbouring elementwise ops fused in.

At batch 1 a decode step is a chain of GEMVs whose weights are read once: the time is bytes over bandwidth
plus the gaps between kernels. cuBLAS reaches ~3.1 TB/s on the 8B's qkv/o shapes and adds a split-K reduce
kernel to each (seen on the H200), and the RMSNorm, residual add and SwiGLU are kernels of their own. Here
one kernel per linear layer:

    out = act(RMSNorm(x) @ W^T)            NORM: the norm in the prologue (each program recomputes the rows'
                                           rstd from x: M x K values, from L2), so no normed copy of x
    res += (x @ W^T).to(dtype)             RESIDUAL: the residual add in the epilogue, in place
    out = silu(x @ Wg^T) * (x @ Wu^T)      SWIGLU: W = [Wg; Wu] (2 I, K), program n reads rows n of both halves

Program p owns output columns [p * BLOCK_N, (p + 1) * BLOCK_N) and loops over K; the M rows are padded to 16
for tl.dot (rows past M are masked: each row's result depends on that row only, whatever M is). Rounding
follows the unfused ops: the GEMM result is rounded to the activation dtype before the add / the SwiGLU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, nw_ptr, M, N, K, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    m = tl.arange(0, M_PAD)
    mmask = m < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    if NORM:
        ss = tl.zeros([M_PAD], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            xs = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None] & (k < K)[None, :], other=0.0)
            xs = xs.to(tl.float32)
            ss += tl.sum(xs * xs, 1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    if SWIGLU:
        acc_up = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            xt = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=nmask[:, None], other=0.0)
        else:
            kmask = k < K
            xt = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            if EVEN_K:
                nw = tl.load(nw_ptr + k).to(tl.float32)
            else:
                nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            xt = (xt.to(tl.float32) * rstd[:, None] * nw[None, :]).to(w_ptr.dtype.element_ty)
        acc += tl.dot(xt, tl.trans(w), input_precision=PRECISION)  # (M_PAD, BLOCK_N)
        if SWIGLU:
            if EVEN_K:
                wu = tl.load(w_rows + N * K + k[None, :], mask=nmask[:, None], other=0.0)
            else:
                wu = tl.load(w_rows + N * K + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)
            acc_up += tl.dot(xt, tl.trans(wu), input_precision=PRECISION)
    omask = mmask[:, None] & nmask[None, :]
    optr = out_ptr + m[:, None] * N + n[None, :]
    dtype = out_ptr.dtype.element_ty
    if SWIGLU:
        g = acc.to(dtype).to(tl.float32)
        u = acc_up.to(dtype).to(tl.float32)
        tl.store(optr, (g / (1.0 + tl.exp(-g)) * u).to(dtype), mask=omask)
    elif RESIDUAL:
        r = tl.load(optr, mask=omask, other=0.0).to(tl.float32)
        tl.store(optr, (r + acc.to(dtype).to(tl.float32)).to(dtype), mask=omask)
    else:
        tl.store(optr, acc.to(dtype), mask=omask)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
    residual: torch.Tensor | None = None, swiglu: bool = False, block_n: int = 16,
) -> torch.Tensor:
    """x (M, K) contiguous, M <= 16; weight (N, K) contiguous ((2 I, K) with swiglu). Returns
    RMSNorm_norm(x) @ W^T (norm given), silu/mul of the halves (swiglu: (M, I)), or residual (M, N) updated in
    place to residual + x @ W^T (residual given)."""
    M, K = x.shape
    N = weight.shape[0] // (2 if swiglu else 1)
    assert M <= MAX_ROWS and weight.shape[1] == K and not (swiglu and residual is not None)
    if residual is not None:
        out = residual
    else:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_k = 256 if K % 256 == 0 else 128 if K % 128 == 0 else 64
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, out, x if norm is None else norm, M, N, K, eps,
        M_PAD=16, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        NORM=norm is not None, RESIDUAL=residual is not None, SWIGLU=swiglu,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=4 if x.dtype.itemsize == 2 else 2,  # fp32 tiles are twice the shared memory
    )
    return out
