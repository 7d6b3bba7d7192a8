"""Manifold-constrained hyper-connections: hc_mult residual streams per token, collapsed into one block input
and expanded back, with a doubly stochastic (Sinkhorn) mix of the streams. Also the float32 RMSNorm every part
of the forward uses."""

from __future__ import annotations

import torch

from shared.engine.kernels import HAVE_TRITON
from shared.engine.models.deepseek_v4.spec import DeepseekV4Spec
from shared.engine.models.deepseek_v4.weights import HcParams

if HAVE_TRITON:
    from shared.engine.kernels.fused import add_rms_norm
    from shared.engine.kernels.mhc import MIX_ROWS, hc_collapse, hc_expand, hc_mix, hc_weights


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32 over the last dim, back to x's dtype; weight None = unweighted. On CUDA one Triton
    launch (a row per program: torch.compile's dynamic-shape reductions ran a single program per row and took
    18-38 us at batch 1); inside a function being compiled (fusion.py), the torch ops, fused with the rest."""
    if x.is_cuda and HAVE_TRITON and not torch.compiler.is_compiling():
        D = x.shape[-1]
        return add_rms_norm(x.reshape(-1, D).contiguous(), None, weight, eps).view(x.shape)
    h = x.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (h if weight is None else h * weight).to(x.dtype)


def hc_pre(s: DeepseekV4Spec, streams: torch.Tensor, hc: HcParams, triton: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> post (T, hc), comb (T, hc, hc) doubly stochastic, the collapsed block input (T, D)."""
    n = s.hc_mult
    fn, base, scale = hc
    mix = mix_of(streams.flatten(1), fn, s.rms_eps, triton)  # (T, (2 + n) n)
    if triton:  # one launch for the gates and the Sinkhorn loop below
        pre, post, comb = hc_weights(mix, base, scale, n, s.hc_iters, s.hc_eps)
        return post, comb, collapse(pre, streams)
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + s.hc_eps
    post = 2 * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = torch.softmax(mix[:, 2 * n :].view(-1, n, n) * scale[2] + base[2 * n :].view(n, n), dim=-1) + s.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + s.hc_eps)
    for _ in range(s.hc_iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to one
        comb = comb / (comb.sum(-1, keepdim=True) + s.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + s.hc_eps)
    return post, comb, collapse(pre, streams)


def mix_of(flat: torch.Tensor, fn: torch.Tensor, eps: float, triton: bool) -> torch.Tensor:
    """The mix's projection rms(flat in float32) @ fn.T: (T, N) float32. From MIX_ROWS rows on CUDA one pass
    over the streams (kernels/mhc.py hc_mix); fewer rows (decode) the torch ops, as the reference."""
    if (triton and flat.is_cuda and flat.shape[0] >= MIX_ROWS and fn.dtype == torch.float32 and fn.is_contiguous()
            and flat.stride(1) == 1 and not torch.compiler.is_compiling()):
        return hc_mix(flat, fn, eps)
    return rms(flat.float(), None, eps) @ fn.T


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams (T, hc, D) weighted by pre (T, hc) and summed: the block input (T, D). On CUDA one Triton
    launch (kernels/mhc.py: compiled with dynamic shapes it ran a program per row, 2.5 ms at an 8K chunk)."""
    if streams.is_cuda and HAVE_TRITON:
        return hc_collapse(pre, streams)
    return (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)


def hc_post(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """Expand the block output into the streams and mix the residual: out_k post_k + sum_j comb[j, k] s_j. On
    CUDA one Triton launch, in float32 (compiled, the mix was a batched 4 x 4 GEMM per token)."""
    if streams.is_cuda and HAVE_TRITON:
        return hc_expand(out, post, comb, streams)
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dt).transpose(-1, -2) @ streams


def hc_head(s: DeepseekV4Spec, streams: torch.Tensor, hc: HcParams) -> torch.Tensor:
    """The head's collapse of the streams (N, hc, D) -> (N, D): sigmoid gates, no Sinkhorn mix."""
    fn, base, scale = hc
    flat = rms(streams.flatten(1).float(), None, s.rms_eps)
    pre = torch.sigmoid(flat @ fn.T * scale + base) + s.hc_eps  # (N, hc)
    return (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
