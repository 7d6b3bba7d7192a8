"""The mHC collapse / expansion (kernels/mhc.py) and the in-place tail RoPE (kernels/v4_rope.py) against the torch
reference ops they replace on CUDA (interpreter, fp32): widths that are not a multiple of the channel tile, several
heads per token, a fresh tensor and a view of a larger one, undoing a rotation with -sin."""

from __future__ import annotations

import pytest
import torch

from shared.engine.models.deepseek_v4.rope import _rotated, rotate

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (tests/gpu covers CUDA)")

pytest.importorskip("triton")

from shared.engine.kernels.mhc import hc_collapse, hc_expand, hc_mix  # noqa: E402
from shared.engine.kernels.v4_rope import rotate_ as rotate_rows_  # noqa: E402


def _mix(T: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    post = torch.rand(T, n, generator=g) * 2
    comb = torch.rand(T, n, n, generator=g)
    return post, comb / comb.sum(-1, keepdim=True)


@pytest.mark.parametrize("T,n,D", [(1, 4, 64), (5, 4, 1100), (3, 2, 2048)])
def test_collapse_and_expand_equal_the_torch_ops(T: int, n: int, D: int) -> None:
    g = torch.Generator().manual_seed(T * 131 + D)
    streams = torch.randn(T, n, D, generator=g)
    pre = torch.rand(T, n, generator=g)
    out = torch.randn(T, D, generator=g)
    post, comb = _mix(T, n, g)
    torch.testing.assert_close(hc_collapse(pre, streams), (pre.unsqueeze(-1) * streams).sum(1), rtol=1e-6, atol=1e-5)
    want = post.unsqueeze(-1) * out.unsqueeze(1) + comb.transpose(-1, -2) @ streams
    torch.testing.assert_close(hc_expand(out, post, comb, streams), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("T,K,N,dtype", [(1, 64, 24, torch.float32), (70, 1100, 24, torch.float32),
                                         (33, 256, 8, torch.bfloat16)])
def test_the_mix_is_the_normed_streams_times_fn(T: int, K: int, N: int, dtype: torch.dtype) -> None:
    """hc_mix = rms(x in float32, unweighted) @ fn.T, K not a multiple of the tile; bf16 rows take the split-tf32
    dots (exact under the interpreter, whose dots are float32)."""
    g = torch.Generator().manual_seed(T + K)
    x = (torch.randn(T, K, generator=g) * 3).to(dtype)
    fn = torch.randn(N, K, generator=g) / K**0.5
    h = x.float()
    want = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6)) @ fn.T
    torch.testing.assert_close(hc_mix(x, fn, 1e-6), want, rtol=1e-5, atol=1e-5)
    assert hc_mix(x[:0], fn, 1e-6).shape == (0, N)


def test_an_empty_step_collapses_and_expands_to_nothing() -> None:
    streams = torch.zeros(0, 4, 64)
    assert hc_collapse(torch.zeros(0, 4), streams).shape == (0, 64)
    assert hc_expand(torch.zeros(0, 64), torch.zeros(0, 4), torch.zeros(0, 4, 4), streams).shape == (0, 4, 64)


@pytest.mark.parametrize("shape,half", [((7, 3, 40), 8), ((17, 96), 16), ((1, 64, 512), 32)])
def test_rotate_in_place_equals_the_functional_rotation(shape: tuple[int, ...], half: int) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    angles = torch.rand(shape[0], half, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    want = rotate(x, cos, sin)
    got = x.clone()
    assert rotate_rows_(got, cos, sin) is got
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[..., : -2 * half], x[..., : -2 * half], rtol=0, atol=0)  # untouched channels
    rotate_rows_(got, cos, -sin)  # the inverse rotation restores x
    torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-5)


def test_rotate_in_place_of_a_view_leaves_the_rest_of_its_base() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 4, 48, generator=g)
    keep = base.clone()
    x = base[1:4]  # rows contiguous: one row stride
    angles = torch.rand(3, 8, generator=g)
    want = _rotated(x, angles.cos(), angles.sin())
    rotate_rows_(x, angles.cos(), angles.sin())
    torch.testing.assert_close(base[1:4, ..., -16:], want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(base[0], keep[0], rtol=0, atol=0)
    torch.testing.assert_close(base[4:], keep[4:], rtol=0, atol=0)


def test_rotate_in_place_declines_what_it_cannot_rotate_and_touches_nothing() -> None:
    """The kernel's layout check is the only one (models/deepseek_v4/rope.py falls back on None): a half that is
    not a power of two, channels at a stride, leading dims with no single row stride."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 6, 32, generator=g)
    cases = [(base, 6), (base.transpose(1, 2)[..., :6], 2), (base[:, 1:3], 8)]  # odd half; strided; 2 row strides
    for x, half in cases:
        keep = x.clone()
        angles = torch.rand(x.shape[0], half, generator=g)
        assert rotate_rows_(x, angles.cos(), angles.sin()) is None
        torch.testing.assert_close(x, keep, rtol=0, atol=0)
    angles = torch.rand(4, 8, generator=g)
    assert rotate_rows_(base[:, ::2], angles.cos(), angles.sin()) is not None  # the control: (4, 3) rows merge
