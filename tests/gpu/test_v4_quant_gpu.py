"""Quantized DeepSeek-V4 weights on a GPU (marked gpu: skipped without CUDA): the FP8 block GEMM at V4-Flash's
projection shapes, weight-only and with FP8 activations, and the fused MoE on FP4 experts at V4-Flash's expert
shape, each against dequantize-then-multiply on the same weights; then the tiny hub checkpoint served by the
engine with its weights kept quantized (--quantization auto) gives the dequantized engine's greedy tokens.

Tolerances, and why: the dequantized weights are exact in bfloat16 (e4m3 or e2m1 codes times power-of-two scales),
so weight-only results differ from the reference only by float32 summation order and the final bf16 rounding
(<= 2^-8 relative per element: atol 1 % of the output's largest magnitude). FP8 activations round x to e4m3
(3 mantissa bits): each product is off by up to 2^-4 relative, random signs, so a sum's relative error is ~2-3 %;
the bound is 6 % of the output's norm, and the kernel must match a torch emulation of the same rounding closely."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.models.deepseek_v4.moe import experts, shared_expert
from shared.engine.models.deepseek_v4.weights import Experts
from shared.engine.quant import Fp4Weight, Fp8Weight, quantize_fp4, quantize_fp8
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# V4-Flash's FP8 projections (N, K): wq_a, wq_b, wkv, wo_b, a CSA compressor's wkv, the indexer's wq_b
SHAPES = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (1024, 4096), (8192, 1024)]
ROWS = [1, 8, 32, 64, 512, 4096]  # decode (split-K) and prefill tiles


def _weight(N: int, K: int, seed: int) -> Fp8Weight:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return quantize_fp8(torch.randn(N, K, device="cuda", generator=g) / K**0.5)


def _emulated_fp8_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded as the kernel's per-token path rounds it: e4m3 with one scale per (row, 128 columns)."""
    tiles = x.float().unflatten(-1, (-1, block))
    scale = tiles.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return ((tiles / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2)


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("N,K", SHAPES[:4])
def test_fp8_gemm_flash_shapes(N: int, K: int, M: int) -> None:
    from shared.engine.kernels.fp8_gemm import fp8_gemm

    w = _weight(N, K, seed=N + K)
    x = torch.randn(M, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M)).to(torch.bfloat16)
    dense = w.dequantize(torch.float32)
    want = x.float() @ dense.T
    got = fp8_gemm(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.01 * float(want.abs().max()), rtol=0.01)
    act = fp8_gemm(x, w, "fp8").float()
    assert float((act - want).norm() / want.norm()) < 0.06
    emulated = _emulated_fp8_rows(x, 128) @ dense.T
    torch.testing.assert_close(act, emulated, atol=0.01 * float(emulated.abs().max()), rtol=0.01)


@pytest.mark.parametrize("M", [1, 32, 4096])
def test_fp8_gemm_grouped_wo_a(M: int) -> None:
    """V4-Flash's wo_a: 8 groups of 1024 rows, each over its group's 4096 of the 32768 head channels."""
    from shared.engine.kernels.fp8_gemm import fp8_gemm

    w = _weight(8 * 1024, 4096, seed=3)
    x = torch.randn(M, 8 * 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M))
    x = x.to(torch.bfloat16)
    dense = w.dequantize(torch.float32)
    want = torch.bmm(x.float().view(M, 8, 4096).transpose(0, 1), dense.view(8, 1024, 4096).mT).transpose(0, 1)
    got = fp8_gemm(x, w, groups=8).float()
    torch.testing.assert_close(got, want.reshape(M, -1), atol=0.01 * float(want.abs().max()), rtol=0.01)


def test_fp8_gemm_no_host_sync_and_graph_capture() -> None:
    from shared.engine.kernels.fp8_gemm import fp8_linear

    w = _weight(1024, 4096, seed=1)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    fp8_linear(x, w)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8_linear(x, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x, w), atol=0, rtol=0)


# ---- FP4 experts ----------------------------------------------------------------------------------------------

E, D, I, TOP = 256, 4096, 2048, 6
LIMIT = 10.0


@pytest.fixture(scope="module")
def fp4_experts() -> tuple[Experts, Experts, Experts, Experts]:
    """FP4 routed experts (3.2 GB with scales) and the shared one, quantized from random weights one expert at a
    time, and their bf16 dequantized copies (13 GB)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def fp4(n: int, rows: int, cols: int) -> Fp4Weight:
        parts = [quantize_fp4(torch.randn(rows, cols, device="cuda", generator=g) / cols**0.5) for _ in range(n)]
        return Fp4Weight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]), 32)

    routed, shared = Experts(fp4(E, 2 * I, D), fp4(E, D, I)), Experts(fp4(1, 2 * I, D), fp4(1, D, I))
    return routed, shared, _dequantized(routed), _dequantized(shared)


def _dequantized(ex: Experts) -> Experts:
    """bf16 copies, one expert at a time (the whole stack at once would take ~40 GB of float32 temporaries)."""
    return Experts(*(torch.stack([w[e].dequantize() for e in range(w.shape[0])]) for w in (ex.w13, ex.w2)))


@pytest.mark.parametrize("T", [1, 8, 32, 512, 4096])
def test_fused_moe_fp4_flash_shape(fp4_experts: tuple[Experts, ...], T: int) -> None:
    from shared.engine.kernels.moe import fused_moe

    routed, shared, dense, dense_shared = fp4_experts
    g = torch.Generator(device="cuda").manual_seed(T)
    x = (6 * torch.randn(T, D, device="cuda", generator=g)).to(torch.bfloat16)
    scores = torch.rand(T, E, device="cuda", generator=g)
    weights, chosen = scores.topk(TOP, dim=-1)
    got = fused_moe(x, chosen, weights, routed.w13, routed.w2, LIMIT, (shared.w13[0], shared.w2[0]))
    want_bf16 = fused_moe(x, chosen, weights, dense.w13, dense.w2, LIMIT, (dense_shared.w13[0], dense_shared.w2[0]))
    # the same bf16 weights and tiles: only the order of float32 sums differs (the even / odd column split)
    torch.testing.assert_close(got.float(), want_bf16.float(), atol=0.02 * float(want_bf16.float().abs().max()),
                               rtol=0.02)
    if T <= 32:  # the torch path in float32 on the same weights (the reference moe.py keeps)
        d32 = Experts(dense.w13.float(), dense.w2.float())
        want32 = experts(d32, x.float(), chosen, weights, LIMIT) + shared_expert(
            Experts(dense_shared.w13.float(), dense_shared.w2.float()), x.float(), LIMIT)
        assert float((got.float() - want32).norm() / want32.norm()) < 0.02


# ---- the engine, quantized end to end ---------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def quantized_hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v4q")
    model = v4_checkpoints.build(root / "hf", "mixed")
    v4_checkpoints.save_hub_dialect(model, root / "hub", quantize=True)
    return root / "hub"


def _requests() -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(i)).tolist(),
                          GREEDY, max_new_tokens=16, stop_token_ids=[]) for i, n in enumerate((5, 40, 23))]


def test_quantized_engine_gives_dequantized_tokens(quantized_hub: Path) -> None:
    """fp32: the quantized kernels' weights are exactly the dequantized ones, so every greedy token agrees (CUDA
    graphs on). bf16: different GEMM tilings round apart (2^-8 relative) and a random model's logits are nearly
    flat, so only each request's first token is compared (on 2026-12-02 a request's second token flipped at a
    near-tie while fp32 stayed exact: the fp32 check is the kernels' proof), and the quantized engine holds fewer
    bytes."""
    kw = dict(device="cuda", kv_blocks=64)
    quantized = Engine(str(quantized_hub), dtype=torch.float32, quantization="auto", **kw)
    assert isinstance(quantized.model.layers[1].wq.weights[0], Fp8Weight)
    assert isinstance(quantized.model.layers[1].experts.w13, Fp4Weight)
    dense = Engine(str(quantized_hub), dtype=torch.float32, quantization="bf16", **kw)
    assert isinstance(dense.model.layers[1].wq.weights[0], torch.Tensor)
    assert run_to_completion(quantized, _requests()) == run_to_completion(dense, _requests())
    q16 = Engine(str(quantized_hub), quantization="auto", **kw)
    d16 = Engine(str(quantized_hub), quantization="bf16", **kw)
    got, want = run_to_completion(q16, _requests()), run_to_completion(d16, _requests())
    assert {r: t[:1] for r, t in got.items()} == {r: t[:1] for r, t in want.items()}
    assert q16.memory().weight_bytes < d16.memory().weight_bytes
