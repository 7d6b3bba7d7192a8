"""The mHC collapse / expansion and the in-place tail RoPE on a GPU at V4-Flash's widths (hidden 4096 x 4 streams,
64 heads of 512 with 64 rotated channels), fp32 and bf16, against the torch ops they replace; a CUDA graph captures
them (marked gpu: skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.kernels.mhc import hc_collapse, hc_expand, hc_mix
from shared.engine.models.deepseek_v4.rope import rotate, rotate_

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 8192])
def test_mhc_kernels_match_torch(T: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(T)
    streams = torch.randn(T, 4, 4096, device="cuda", generator=g).to(dtype)
    pre = torch.rand(T, 4, device="cuda", generator=g)
    out = torch.randn(T, 4096, device="cuda", generator=g).to(dtype)
    post = torch.rand(T, 4, device="cuda", generator=g) * 2
    comb = torch.rand(T, 4, 4, device="cuda", generator=g)
    s32 = streams.float()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(hc_collapse(pre, streams).float(), (pre.unsqueeze(-1) * s32).sum(1), **tol)
    want = post.unsqueeze(-1) * out.float().unsqueeze(1) + comb.transpose(-1, -2) @ s32
    torch.testing.assert_close(hc_expand(out, post, comb, streams).float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_in_place_matches_the_functional_rotation(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2048, 64, 512, device="cuda", generator=g).to(dtype)
    angles = torch.rand(2048, 32, device="cuda", generator=g) * 1000
    cos, sin = angles.cos(), angles.sin()
    want = rotate(x, cos, sin)
    got = rotate_(x.clone(), cos, sin)
    # fp32: as torch's separate products within rounding (the compiler may fuse a * c - b * s into one FMA)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6) if dtype == torch.float32 else \
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mix_is_the_normed_streams_times_fn(dtype: torch.dtype) -> None:
    """kernels/mhc.py hc_mix at a prefill chunk's shape (V4-Flash: 4 streams of 4096, 24 outputs) against the
    float32 torch ops it replaces: fp32 dots for fp32 rows (measured 2e-5 off at mix values up to 5), split tf32
    for bf16 rows (measured 3.2e-4 off: 7e-5 relative, well inside the 4e-3 step of the bf16 streams it reads)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(2048, 16384, device="cuda", generator=g).to(dtype)
    fn = torch.randn(24, 16384, device="cuda", generator=g) / 128
    h = x.float()
    want = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6)) @ fn.T
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(hc_mix(x, fn, 1e-6), want, rtol=tol, atol=tol)


def test_a_cuda_graph_captures_them() -> None:
    streams = torch.randn(4, 4, 4096, device="cuda")
    pre, post = torch.rand(4, 4, device="cuda"), torch.rand(4, 4, device="cuda")
    comb, out = torch.rand(4, 4, 4, device="cuda"), torch.randn(4, 4096, device="cuda")
    q = torch.randn(4, 64, 512, device="cuda")
    cos, sin = torch.rand(4, 32, device="cuda"), torch.rand(4, 32, device="cuda")
    want = (hc_collapse(pre, streams), hc_expand(out, post, comb, streams), rotate(q, cos, sin))
    rotate_(q.clone(), cos, sin)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, b, c = hc_collapse(pre, streams), hc_expand(out, post, comb, streams), rotate_(q, cos, sin)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(a, want[0])
    torch.testing.assert_close(b, want[1])
    torch.testing.assert_close(c, want[2])
