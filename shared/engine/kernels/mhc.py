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
