"""The quantized-weight kernels under TRITON_INTERPRET=1 in fp32 on a CPU, each against dequantize-then-multiply
on the same weights: the FP8 block-scaled GEMM (kernels/fp8_gemm.py) at decode and prefill tiles, split-K and
partial blocks; the fused MoE with FP4 experts (kernels/moe.py W_FP4), the shared expert riding or beside; and
the tiny hub-dialect model end to end with its FP8 linears and FP4 experts kept quantized.

Tolerances: the kernels' weights are exactly the dequantized ones (e4m3 -> fp32 is exact; e2m1 times an e8m0
power of two is exact), so the only difference is the order of the float32 sums: ~K ulp of the result, well
under 1e-4 here. The per-token FP8 activation path rounds x to e4m3, which is no longer exact; the interpreter
(Triton 3.9) also converts float32 -> e4m3 wrongly where rounding carries into the exponent (127.9 -> 64, not 128),
so here it runs only on activations e4m3 holds exactly (each row's tile scaled by a power of two), where it must
equal the emulation; tests/gpu/test_v4_quant_gpu.py checks it on random activations on the H200."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.loader import hf
from shared.engine.models.deepseek_v4 import model as model_module
from shared.engine.models.deepseek_v4 import weights as v4_weights
from shared.engine.models.deepseek_v4.moe import experts, moe, shared_expert
from shared.engine.models.deepseek_v4.weights import Experts
from shared.engine.quant import Fp4Weight, Fp8Weight, linear, quantize_fp4, quantize_fp8
from tests import v4_checkpoints

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (tests/gpu covers CUDA)")

triton = pytest.importorskip("triton")
from shared.engine.kernels.fp8_gemm import Config, config, fp8_gemm  # noqa: E402
from shared.engine.kernels.moe import Config as MoeConfig  # noqa: E402
from shared.engine.kernels.moe import fused_moe  # noqa: E402

LIMIT = 1.5


def _fp8(N: int, K: int, block: int, seed: int) -> Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-3, 3, (N, 1), generator=g).float())  # rows of other magnitudes: scales differ
    w = torch.randn(N, K, generator=g) * rows
    return quantize_fp8(w / K**0.5, block)


# ---- FP8 GEMM -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,N,K,block", [
    (1, 96, 160, 32),  # decode: split K, N and K past the last whole block
    (3, 64, 256, 128),  # DeepSeek's 128 x 128 blocks
    (40, 80, 96, 32),  # 32-row tiles
    (70, 130, 64, 32),  # prefill tiles, N not a tile multiple
])
def test_fp8_gemm_weight_only_equals_dequantized_matmul(M: int, N: int, K: int, block: int) -> None:
    w = _fp8(N, K, block, seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + 1))
    want = x @ w.dequantize(torch.float32).T
    torch.testing.assert_close(fp8_gemm(x, w), want, atol=1e-4, rtol=1e-5)


def test_fp8_gemm_split_k_and_tiles_agree() -> None:
    """One decode shape through several tilings: split over K or not, tiles smaller than one scale block."""
    w = _fp8(64, 256, 32, seed=5)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    want = x @ w.dequantize(torch.float32).T
    assert config(5, 64, 256, w.block, x.device).split > 1
    for cfg in (Config(16, 64, 32, 1, 4, 1), Config(16, 32, 16, 4, 4, 1), Config(16, 16, 32, 8, 4, 1)):
        torch.testing.assert_close(fp8_gemm(x, w, cfg=cfg), want, atol=1e-4, rtol=1e-5)


def test_fp8_gemm_fp8_activations_on_representable_rows() -> None:
    """act="fp8": per (row, K tile) scale amax / 448; with e4m3 codes times a power of two per row and tile (one
    of them +-448 times it) the quantized x is x itself, so the result is the dequantized matmul's."""
    M, N, K, block = 20, 64, 128, 32
    g = torch.Generator().manual_seed(7)
    codes = torch.randn(M, K, generator=g).mul(60).to(torch.float8_e4m3fn).float()
    codes[:, ::block] = 448.0
    x = codes * torch.exp2(torch.randint(-6, 2, (M, K // block), generator=g).float()).repeat_interleave(block, 1)
    w = _fp8(N, K, block, seed=8)
    got = fp8_gemm(x, w, "fp8", cfg=Config(16, 64, 32, 1, 4, 1))
    torch.testing.assert_close(got, x @ w.dequantize(torch.float32).T, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("M", [2, 70])
def test_fp8_gemm_grouped_is_the_per_group_product(M: int) -> None:
    """wo_a: 4 groups of 64 rows, group g reading x's g-th 48 columns, in one launch."""
    w = _fp8(4 * 64, 48, 32, seed=11)
    x = torch.randn(M, 4 * 48, generator=torch.Generator().manual_seed(12))
    dense = w.dequantize(torch.float32)
    want = torch.cat([x[:, 48 * g : 48 * (g + 1)] @ dense[64 * g : 64 * (g + 1)].T for g in range(4)], dim=1)
    got = fp8_gemm(x, w, groups=4, cfg=Config(16, 64, 32, 2, 4, 1) if M < 64 else Config(64, 32, 32, 1, 4, 1))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear(x, w, groups=4), linear(x, dense, groups=4), atol=1e-4, rtol=1e-5)


def test_linear_dispatches_by_weight_kind() -> None:
    w = _fp8(48, 64, 32, seed=9)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(10))
    dense = w.dequantize(torch.float32)
    torch.testing.assert_close(linear(x, w), linear(x, dense), atol=1e-4, rtol=1e-5)
    assert linear(x, w).shape == (2, 3, 48)


# ---- the fused MoE with FP4 experts -------------------------------------------------------------------------


def _fp4_experts(E: int, D: int, I: int, seed: int) -> tuple[Experts, Experts]:
    g = torch.Generator().manual_seed(seed)
    routed = Experts(quantize_fp4(torch.randn(E, 2 * I, D, generator=g) / D**0.5),
                     quantize_fp4(torch.randn(E, D, I, generator=g) / I**0.5))
    shared = Experts(quantize_fp4(torch.randn(1, 2 * I, D, generator=g) / D**0.5),
                     quantize_fp4(torch.randn(1, D, I, generator=g) / I**0.5))
    return routed, shared


def _dense(ex: Experts) -> Experts:
    return Experts(ex.w13.dequantize(torch.float32), ex.w2.dequantize(torch.float32))


@pytest.mark.parametrize("T,with_shared,cfg", [
    (1, True, None), (5, False, None), (12, True, MoeConfig(16, 16, 16, 32, 4, 1)),
])
def test_fused_moe_fp4_equals_dequantized(T: int, with_shared: bool, cfg: MoeConfig | None) -> None:
    E, D, I, k = 8, 64, 96, 2
    routed, shared = _fp4_experts(E, D, I, seed=T)
    g = torch.Generator().manual_seed(T + 1)
    x = 3 * torch.randn(T, D, generator=g)  # some gate / up values past the limit
    chosen = torch.stack([torch.randperm(E - 2, generator=g)[:k] for _ in range(T)])  # two experts unused
    w = torch.rand(T, k, generator=g) + 0.1
    want = experts(_dense(routed), x, chosen, w, LIMIT)
    if with_shared:
        want = want + shared_expert(_dense(shared), x, LIMIT)
    got = fused_moe(x, chosen, w, routed.w13, routed.w2, LIMIT,
                    (shared.w13[0], shared.w2[0]) if with_shared else None, cfg)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- the tiny hub model, quantized end to end ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v4-quant")
    # o_lora_rank 32: each of wo_a's 2 groups is one whole 32-row scale block, so it stays FP8 (grouped GEMM)
    model = v4_checkpoints.build(root / "hf", "mixed", o_lora_rank=32)
    v4_checkpoints.save_hub_dialect(model, root / "hub", quantize=True)
    return root / "hub"


def test_moe_layer_with_fp4_experts_and_fp8_shared(hub: Path) -> None:
    """The hub's layout: FP4 routed experts, an FP8 shared expert (which then runs beside the grouped launch)."""
    config, kept = hf.load(hub, keep_quantized=True)
    s = config.spec
    q = v4_weights.load(s, kept, torch.device("cpu"), torch.float32, quantized=True)
    ref = v4_weights.load(s, kept, torch.device("cpu"), torch.float32)
    T = 6
    ids = torch.randint(0, s.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    x = torch.randn(T, s.hidden_size, generator=torch.Generator().manual_seed(2))
    for layer_q, layer in zip(q.layers[:2], ref.layers[:2]):  # a hash-routed and a top-k layer
        assert isinstance(layer_q.experts.w13, Fp4Weight) and isinstance(layer_q.shared.w13, Fp8Weight)
        torch.testing.assert_close(moe(s, layer_q, x, ids, triton=True), moe(s, layer, x, ids), atol=1e-5, rtol=1e-5)


def test_quantized_model_matches_dequantized(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model with the loader's keep-quantized weights (FP8 GEMMs for every projection and the head, the fused
    MoE on FP4 experts) against the same checkpoint dequantized on the torch path: a batched prefill of two
    sequences, then a decode step. The rest of the model stays on the torch path (the interpreter's attention and
    mHC kernels would cost minutes; tests/gpu runs them all together)."""
    g = torch.Generator().manual_seed(9)
    seqs = {rid: torch.randint(0, 512, (16,), generator=g).tolist() for rid in ("a", "b")}
    steps = [(0, 12), (12, 13)]
    want = v4_checkpoints.batched_logits(Engine(str(hub), kv_blocks=16), seqs, steps)
    engine = Engine(str(hub), kv_blocks=16)
    config, kept = hf.load(hub, keep_quantized=True)
    model = engine.model
    model.weights = v4_weights.load(config.spec, kept, torch.device("cpu"), torch.float32, quantized=True)
    model.layers, model.mtp = model.weights.layers, model.weights.mtp
    assert isinstance(model.layers[0].wq.weights[0], Fp8Weight) and isinstance(model.weights.head, Fp8Weight)
    assert isinstance(model.layers[0].wo_a, Fp8Weight)
    calls = []

    def fused(s, layer, x, input_ids, triton=False, counts=None, real=None):
        calls.append(type(layer.experts.w13))
        return moe(s, layer, x, input_ids, True, counts, real)

    monkeypatch.setattr(model_module, "moe", fused)
    got = v4_checkpoints.batched_logits(engine, seqs, steps)
    assert calls == [Fp4Weight] * 8
    for g_, ref in zip(got, want):
        torch.testing.assert_close(g_, ref, atol=1e-4, rtol=0)
        assert bool((g_.argmax(-1) == ref.argmax(-1)).all())
