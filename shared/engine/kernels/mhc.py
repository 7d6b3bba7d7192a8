"""DeepSeek-V4's hyper-connection weights in one launch: per row, the pre / post gates and the doubly
stochastic mixing matrix (softmax, then Sinkhorn-Knopp), all in registers.

The torch version is ~125 small kernels per call (20 Sinkhorn iterations of sums and divisions over a 4 x 4
matrix), twice per layer: at decode batch sizes that launch overhead was a third of a V4 layer's time
(bench/results/v4_layer_notes.md). Here one program owns one row; n (hc_mult) is a power of two.

    mix   (T, (2 + n) n) float32    the row's projection: [pre logits | post logits | comb logits (n x n)]
    pre   = sigmoid(mix_pre * scale[0] + base_pre) + eps
    post  = 2 sigmoid(mix_post * scale[1] + base_post)
    comb  = softmax_rows(mix_comb * scale[2] + base_comb) + eps, then columns, then (iters - 1) x (rows, columns)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hc_weights_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, eps,
                       N: tl.constexpr, ITERS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = mix_ptr + t * (2 + N) * N
    i = tl.arange(0, N)
    r = tl.arange(0, N)[:, None]
    c = tl.arange(0, N)[None, :]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(row + i) * s0 + tl.load(base_ptr + i)) + eps
    post = 2.0 * tl.sigmoid(tl.load(row + N + i) * s1 + tl.load(base_ptr + N + i))
    logits = tl.load(row + 2 * N + r * N + c) * s2 + tl.load(base_ptr + 2 * N + r * N + c)
    e = tl.exp(logits - tl.max(logits, 1)[:, None])
    comb = e / tl.sum(e, 1)[:, None] + eps
    comb = comb / (tl.sum(comb, 0)[None, :] + eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, 1)[:, None] + eps)
        comb = comb / (tl.sum(comb, 0)[None, :] + eps)
    tl.store(pre_ptr + t * N + i, pre)
    tl.store(post_ptr + t * N + i, post)
    tl.store(comb_ptr + t * N * N + r * N + c, comb)


def hc_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix (T, (2 + n) n) float32 contiguous -> pre (T, n), post (T, n), comb (T, n, n), float32."""
    T = mix.shape[0]
    assert n & (n - 1) == 0 and mix.shape[1] == (2 + n) * n and mix.dtype == torch.float32
    pre = torch.empty(T, n, dtype=torch.float32, device=mix.device)
    post = torch.empty_like(pre)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=mix.device)
    if T:
        _hc_weights_kernel[(T,)](mix.contiguous(), base, scale, pre, post, comb, eps, N=n, ITERS=iters)
    return pre, post, comb


# --- the mix's projection: rms(streams) @ fn.T in one pass over the streams --------------------------------
# In torch at an 8K chunk this was three passes over (T, n D): the streams cast to float32 (a 0.5 GB copy), an
# RMSNorm of that copy, an fp32 GEMM reading it again; about 1 ms a call, twice per layer, 0.8 s of a 77K
# prefill at 43 layers. The norm is unweighted, so it is a per-row factor applied after the dot:
# rms(x) @ fn.T = (x @ fn.T) * rsqrt(mean(x^2) + eps). bf16 streams are exact in tf32, and fn is split into its
# tf32 part and the rest (two tf32 dots on tensor cores: 7e-5 relative off the fp32 GEMM on the H200, inside the
# bf16 streams' own 4e-3 step); fp32 streams take fp32 dots (2e-5 off).

MIX_ROWS = 256  # from this many rows the kernel (one program per 64 rows); fewer rows (decode) keep cuBLAS's GEMV


@triton.jit(do_not_specialize=["T"])
def _hc_mix_kernel(x_ptr, fn_ptr, out_ptr, T, K, stride_x, eps, N: tl.constexpr, N_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_TF32: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    n = tl.arange(0, N_PAD)
    nmask = n < N
    acc = tl.zeros([BLOCK_M, N_PAD], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        squares += tl.sum(x * x, 1)
        w = tl.load(fn_ptr + n[None, :] * K + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if SPLIT_TF32:
            hi = w.to(tl.uint32, bitcast=True) & 0xFFFFE000  # tf32's 10 mantissa bits (truncated)
            hi = hi.to(tl.float32, bitcast=True)
            acc += tl.dot(x, hi, input_precision="tf32")
            acc += tl.dot(x, w - hi, input_precision="tf32")
        else:
            acc += tl.dot(x, w, input_precision="ieee")
    r = 1.0 / tl.sqrt(squares / K + eps)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + n[None, :], acc * r[:, None],
             mask=rmask[:, None] & nmask[None, :])


def hc_mix(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, K) the flattened streams (bf16 or fp32, rows at unit stride), fn (N, K) float32 contiguous -> the
    mix (T, N) float32 = RMSNorm(x in float32, unweighted) @ fn.T."""
    T, K = x.shape
    N = fn.shape[0]
    assert x.stride(1) == 1 and fn.is_contiguous() and fn.dtype == torch.float32 and fn.shape[1] == K
    out = torch.empty(T, N, dtype=torch.float32, device=x.device)
    if T:
        block_m = 64 if x.element_size() <= 2 else 32
        _hc_mix_kernel[(triton.cdiv(T, block_m),)](x, fn, out, T, K, x.stride(0), eps, N=N,
                                                   N_PAD=max(16, triton.next_power_of_2(N)), BLOCK_M=block_m,
                                                   BLOCK_K=64, SPLIT_TF32=x.dtype != torch.float32, num_warps=4)
    return out


# --- the streams' collapse and expansion: pure bandwidth, a (row, channel tile) per program -------------------
# torch.compile with dynamic shapes made the collapse a reduction of one program per row and the expansion a
# batched 4 x 4 GEMM per token (cuBLAS, 8K batches of it): 2.5 ms each per layer at an 8K prefill chunk, where
# the bytes take ~0.1 ms.


@triton.jit
def _collapse_kernel(pre_ptr, s_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = c < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(N):
        w = tl.load(pre_ptr + t * N + j)
        acc += w * tl.load(s_ptr + (t * N + j) * D + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _expand_kernel(o_ptr, post_ptr, comb_ptr, s_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = c < D
    o = tl.load(o_ptr + t * D + c, mask=ok, other=0.0).to(tl.float32)
    for k in tl.static_range(N):
        acc = tl.load(post_ptr + t * N + k) * o
        for j in tl.static_range(N):
            w = tl.load(comb_ptr + (t * N + j) * N + k)  # comb[t, j, k]: stream j's share in new stream k
            acc += w * tl.load(s_ptr + (t * N + j) * D + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + (t * N + k) * D + c, acc.to(out_ptr.dtype.element_ty), mask=ok)


BLOCK_D = 1024


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """pre (T, n) float32, streams (T, n, D) -> sum_j pre[:, j] streams[:, j]: (T, D) in streams' dtype."""
    T, n, D = streams.shape
    out = torch.empty(T, D, dtype=streams.dtype, device=streams.device)
    if T:
        _collapse_kernel[(T, triton.cdiv(D, BLOCK_D))](pre.float().contiguous(), streams.contiguous(), out, D,
                                                      N=n, BLOCK_D=BLOCK_D)
    return out


def hc_expand(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block output out (T, D) into the streams (T, n, D): new_k = post_k out + sum_j comb[:, j, k] s_j,
    accumulated in float32, rounded once to streams' dtype."""
    T, n, D = streams.shape
    new = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if T:
        _expand_kernel[(T, triton.cdiv(D, BLOCK_D))](out.contiguous(), post.float().contiguous(),
                                                    comb.float().contiguous(), streams.contiguous(), new, D,
                                                    N=n, BLOCK_D=BLOCK_D)
    return new
