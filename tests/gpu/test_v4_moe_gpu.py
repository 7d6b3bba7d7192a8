"""The fused MoE (shared/engine/kernels/moe.py) on a GPU at V4-Flash's shape (256 experts of 2048, hidden 4096,
top 6, one shared expert) against the torch path of moe.py, fp32 and bf16; no host sync on its path and a
CUDA graph captures it (marked gpu: skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from shared.engine import cuda_graphs
from shared.engine.models.deepseek_v4.moe import experts, shared_expert
from shared.engine.models.deepseek_v4.weights import Experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, D, I, K = 256, 4096, 2048, 6
LIMIT = 10.0  # V4-Flash's swiglu_limit


@pytest.fixture(scope="module")
def weights() -> tuple[Experts, Experts]:
    """fp32 weights (26 GB); the bf16 cases cast them."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g) / fan_in**0.5

    return (Experts(randn(E, 2 * I, D, fan_in=D), randn(E, D, I, fan_in=I)),
            Experts(randn(1, 2 * I, D, fan_in=D), randn(1, D, I, fan_in=I)))


def _inputs(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = 6 * torch.randn(T, D, device="cuda", generator=g)  # gate / up ~ N(0, 36): ~10 % past the limit
    scores = torch.rand(T, E, device="cuda", generator=g)
    scores[:, E // 2 :] -= 1  # half the experts are hit by no row
    weights, chosen = scores.topk(K, dim=-1)
    return x, chosen, weights.abs() + 0.1


def _reference(routed: Experts, shared: Experts, x, chosen, weights) -> torch.Tensor:
    return experts(routed, x, chosen, weights, LIMIT) + shared_expert(shared, x, LIMIT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 8, 32, 128, 1024, 4096])  # the three tile configs
def test_flash_shape_against_torch(weights, T: int, dtype: torch.dtype) -> None:
    from shared.engine.kernels.moe import fused_moe

    routed32, shared32 = weights
    x32, chosen, w = _inputs(T, seed=T)
    want32 = _reference(routed32, shared32, x32, chosen, w)
    if dtype == torch.float32:
        got = fused_moe(x32, chosen, w, routed32.w13, routed32.w2, LIMIT, (shared32.w13[0], shared32.w2[0]))
        torch.testing.assert_close(got, want32, atol=1e-3, rtol=1e-3)  # K = 2048-4096 sums: accumulation order
        return
    routed = Experts(routed32.w13.to(dtype), routed32.w2.to(dtype))
    shared = Experts(shared32.w13.to(dtype), shared32.w2.to(dtype))
    x = x32.to(dtype)
    got = fused_moe(x, chosen, w, routed.w13, routed.w2, LIMIT, (shared.w13[0], shared.w2[0]))
    want = _reference(routed, shared, x, chosen, w)
    assert got.dtype == dtype
    # both bf16 paths land as close to the fp32 result as each other (bf16 rounding of h and of the output)
    scale = want32.abs().mean()
    err_ours = (got.float() - want32).abs().mean() / scale
    err_torch = (want.float() - want32).abs().mean() / scale
    assert err_ours < 1.5 * err_torch + 1e-3, (err_ours, err_torch)
    torch.testing.assert_close(got.float(), want.float(), atol=0.05 * float(want32.abs().max()), rtol=0.05)


@pytest.mark.parametrize("T", [8, 64])  # the one-program align and the torch ops' align
def test_no_host_sync_and_graph_capture(weights, T: int) -> None:
    """The path from routing to output syncs with the host nowhere, so one CUDA graph per batch size replays
    it for any routing."""
    from shared.engine.kernels.moe import fused_moe

    routed32, shared32 = weights
    routed = Experts(routed32.w13[:32].to(torch.bfloat16), routed32.w2[:32].to(torch.bfloat16))
    shared = (shared32.w13[0].to(torch.bfloat16), shared32.w2[0].to(torch.bfloat16))
    x, chosen, w = _inputs(T, seed=1)
    x, chosen = x.to(torch.bfloat16), chosen % 32

    def run() -> torch.Tensor:
        return fused_moe(x, chosen, w, routed.w13, routed.w2, LIMIT, shared)

    run()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, out = cuda_graphs.capture(run, None)  # the engine's own warm-up-then-capture
    for seed in (2, 3):  # new rows and a new routing, copied into the captured inputs
        x2, chosen2, w2 = _inputs(T, seed=seed)
        x.copy_(x2.to(torch.bfloat16))
        chosen.copy_(chosen2 % 32)
        w.copy_(w2)
        graph.replay()
        torch.testing.assert_close(out, run(), atol=0, rtol=0)
