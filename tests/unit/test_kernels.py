"""Triton kernels against the plain torch reference ops, on fresh random inputs (never zeros).

Without CUDA they run under TRITON_INTERPRET=1 in fp32 and fp16 (bf16 is broken in the interpreter) on tiny
shapes; with CUDA (marked gpu) in bf16 and fp32 on the GPU. Tolerances are by dtype.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

triton = pytest.importorskip("triton")

from shared.engine.attention import AttentionMetadata, SeqSpan, paged_attention  # noqa: E402
from shared.engine.kernels import attention as ka  # noqa: E402
from shared.engine.kernels import fused  # noqa: E402
from shared.engine.kernels.gemv import gemv  # noqa: E402
from shared.engine.models.llama import apply_rotary, rms_norm, rotary_tables  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative L2 error
BT = 4  # tokens per page: tiny, so a short context already spans many pages
pytestmark = [pytest.mark.gpu] if CUDA else []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def paged_setup(
    ctx: list[int], q_lens: list[int], H: int, KV: int, D: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Random caches with each sequence's pages scattered (shuffled), random queries; (q, k, v, tables, bt)."""
    pages = [-(-c // BT) for c in ctx]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for n in pages:
        tables.append(perm[used : used + n].to(DEVICE))
        used += n
    k = torch.randn(num_blocks, BT, KV, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_blocks, BT, KV, D, generator=gen).to(DEVICE, dtype)
    q = torch.randn(sum(q_lens), H, D, generator=gen).to(DEVICE, dtype)
    width = max(pages) + 2
    bt = torch.zeros(len(ctx), width, dtype=torch.int32, device=DEVICE)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t.to(torch.int32)
    return q, k, v, tables, bt


def reference(q, k, v, tables, ctx, q_lens, scale):
    spans, start = [], 0
    for t, c, n in zip(tables, ctx, q_lens):
        spans.append(SeqSpan(start, n, c, t.long()))
        start += n
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), spans)
    return paged_attention(q.float(), k.float(), v.float(), meta, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KV", [(4, 2), (3, 1)])
def test_decode_attention_matches_reference(dtype: torch.dtype, H: int, KV: int) -> None:
    gen = torch.Generator().manual_seed(hash((str(dtype), H)) % 2**31)
    D = 16
    ctx = [1, 37, 9, 70]  # one short, several partitions long (part 32 below)
    q, k, v, tables, bt = paged_setup(ctx, [1] * len(ctx), H, KV, D, dtype, gen)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    out = ka.decode_attention(q, k, v, bt, ctx_t, D**-0.5, max_context=bt.shape[1] * BT, part=32, block_n=16)
    ref = reference(q, k, v, tables, ctx, [1] * len(ctx), D**-0.5)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_attention_padding_rows_are_zero() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v, _, bt = paged_setup([5, 5], [1, 1], 2, 1, 16, torch.float32, gen)
    ctx_t = torch.tensor([5, 0], dtype=torch.int32, device=DEVICE)
    out = ka.decode_attention(q, k, v, bt, ctx_t, 0.25, max_context=16, part=8, block_n=16)
    assert out[1].abs().max() == 0 and out[0].abs().max() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_over_cached_prefix(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    H, KV, D = 4, 2, 16
    ctx, q_lens = [23, 7, 40], [23, 3, 1]  # a fresh prompt, a chunk after a prefix, a decode row
    q, k, v, tables, bt = paged_setup(ctx, q_lens, H, KV, D, dtype, gen)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 23, 26], **i32)
    out = ka.prefill_attention(q, k, v, bt, starts, torch.tensor(q_lens, **i32), torch.tensor(ctx, **i32),
                               max(q_lens), D**-0.5, block_m=16, block_n=16)
    ref = reference(q, k, v, tables, ctx, q_lens, D**-0.5)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    H, KV, hd, T, num_blocks = 3, 1, 16, 5, 4
    rope = rotary_tables(hd, 64, 10000.0, torch.device(DEVICE))
    qkv = torch.randn(T, (H + 2 * KV) * hd, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 7, 8, 33, 63], device=DEVICE)
    slots = torch.tensor([1, 6, -1, 9, 15], device=DEVICE)  # -1: a padding row, never stored
    k_cache = torch.randn(num_blocks, BT, KV, hd, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, BT, KV, hd, generator=gen).to(DEVICE, dtype)
    k_ref, v_ref = k_cache.clone().view(-1, KV, hd), v_cache.clone().view(-1, KV, hd)
    cos, sin = rope[positions].unsqueeze(2).unbind(1)
    q, k, v = qkv.float().split([H * hd, KV * hd, KV * hd], dim=-1)
    q_ref = apply_rotary(q.view(T, H, hd), cos, sin)
    keep = slots >= 0
    k_ref[slots[keep]] = apply_rotary(k.view(T, KV, hd), cos, sin)[keep].to(dtype)
    v_ref[slots[keep]] = v.view(T, KV, hd)[keep].to(dtype)
    fused.rope_write(qkv, positions, slots, rope, k_cache, v_cache, H, KV, hd)
    assert rel_err(qkv[:, : H * hd].view(T, H, hd), q_ref) < TOL[dtype]
    assert rel_err(k_cache.view(-1, KV, hd), k_ref) < TOL[dtype]
    assert torch.equal(v_cache.view(-1, KV, hd), v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_and_silu_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    T, D, I = 3, 40, 24  # D not a power of two: the masked tail
    x = torch.randn(T, D, generator=gen).to(DEVICE, dtype)
    delta = torch.randn(T, D, generator=gen).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(DEVICE, dtype)
    x_ref = x + delta
    h = fused.add_rms_norm(x, delta, w, 1e-5)
    assert rel_err(x, x_ref) < TOL[dtype]
    assert rel_err(h, rms_norm(x_ref.float(), w.float(), 1e-5)) < TOL[dtype]
    assert rel_err(fused.add_rms_norm(x.clone(), None, w, 1e-5), rms_norm(x.float(), w.float(), 1e-5)) < TOL[dtype]
    unweighted = rms_norm(x.float(), torch.ones(D, device=DEVICE), 1e-5)  # DeepSeek-V4's unweighted norms
    assert rel_err(fused.add_rms_norm(x.clone(), None, None, 1e-5), unweighted) < TOL[dtype]
    gu = torch.randn(T, 2 * I, generator=gen).to(DEVICE, dtype)
    gate, up = gu.float().chunk(2, dim=-1)
    assert rel_err(fused.silu_mul(gu), torch.nn.functional.silu(gate) * up) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 128, 40), (5, 40, 24)])  # K a multiple of the tile, and a ragged one
def test_gemv_fusions_match_reference(dtype: torch.dtype, M: int, K: int, N: int) -> None:
    gen = torch.Generator().manual_seed(M * 1000 + K)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(2 * N, K, generator=gen) / K**0.5).to(DEVICE, dtype)
    nw = (1 + 0.1 * torch.randn(K, generator=gen)).to(DEVICE, dtype)
    h = rms_norm(x.float(), nw.float(), 1e-5)
    assert rel_err(gemv(x, w[:N], norm=nw, eps=1e-5), h @ w[:N].float().T) < TOL[dtype]
    gate, up = (h @ w.float().T).chunk(2, dim=-1)
    assert rel_err(gemv(x, w, norm=nw, eps=1e-5, swiglu=True), torch.nn.functional.silu(gate) * up) < TOL[dtype]
    a = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    res = torch.randn(M, N, generator=gen).to(DEVICE, dtype)
    ref = res.float() + a.float() @ w[:N].float().T
    out = gemv(a, w[:N], residual=res)
    assert out is res and rel_err(res, ref) < TOL[dtype]
    assert rel_err(gemv(a, w[:N]), a.float() @ w[:N].float().T) < TOL[dtype]
    # each row's result is independent of the other rows (a batch-1 step gives what it gives in a batch)
    if M > 1:
        assert torch.equal(gemv(a[1:2].contiguous(), w[:N]), gemv(a, w[:N])[1:2])


def test_hc_weights_match_the_torch_sinkhorn() -> None:
    """DeepSeek-V4's hyper-connection gates and doubly stochastic mix: the one-launch kernel against the torch
    path (fp32 only: the weights are float32 in the model whatever the activation dtype)."""
    from shared.engine.kernels.mhc import hc_weights

    g = torch.Generator().manual_seed(5)
    n, T, iters, eps = 4, 7, 20, 1e-6
    mix = (2 * torch.randn(T, (2 + n) * n, generator=g)).to(DEVICE)
    base, scale = torch.randn((2 + n) * n, generator=g).to(DEVICE), torch.rand(3, generator=g).to(DEVICE) + 0.5
    pre, post, comb = hc_weights(mix, base, scale, n, iters, eps)
    want_pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    want_post = 2 * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    want = torch.softmax(mix[:, 2 * n :].view(T, n, n) * scale[2] + base[2 * n :].view(n, n), dim=-1) + eps
    want = want / (want.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        want = want / (want.sum(-1, keepdim=True) + eps)
        want = want / (want.sum(-2, keepdim=True) + eps)
    assert rel_err(pre, want_pre) < 1e-6 and rel_err(post, want_post) < 1e-6
    assert rel_err(comb, want) < 1e-5
    assert torch.allclose(comb.sum(-2), torch.ones(T, n, device=DEVICE), atol=1e-5)  # columns sum to one
