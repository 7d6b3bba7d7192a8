"""V4 decode attention kernel (kernels/v4_decode.py) on a GPU at V4-Flash shape (64 heads of 512, window 128,
index_topk 512), against a torch reference over the same gathered keys, in fp32 and bf16, with the cache's rows
in the compute dtype or FP8 (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.kv_quant import Fp8Rows, RowLayout, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, D, W, BT, TOPK = 64, 512, 128, 128, 512
ROPE = 64  # RoPE's channels of a row (bf16 in FP8 rows)
CAP = W - 1 + 4  # the cache's sliding ring: window - 1 + backtrack


def _case(kind: str, contexts: list[int], dtype: torch.dtype):
    """Random pools and a decode batch: rows at positions contexts[s] - 1, one of them just after a replay."""
    g = torch.Generator(device="cuda").manual_seed(0)
    S = len(contexts)
    ratio = {"sliding": 0, "hca": 128, "csa": 4}[kind]
    slots = torch.arange(S, device="cuda") * 2 + 1  # not 0..S-1: rows index the pool
    positions = torch.tensor(contexts, device="cuda") - 1
    begins = torch.zeros(S, dtype=torch.long, device="cuda")
    begins[-1] = positions[-1] - 50  # bounded replay: window slots before it are masked
    nb = -(-max(contexts) // BT)
    table = torch.randperm(S * nb, generator=g, device="cuda").view(S, nb)  # each row's own blocks
    q = torch.randn(S, H, D, generator=g, device="cuda").to(dtype)
    swa = torch.randn(2 * S + 1, CAP, D, generator=g, device="cuda").to(dtype)
    entries = ids = None
    if ratio:
        entries = torch.randn(S * nb, BT // ratio, D, generator=g, device="cuda").to(dtype)
    if kind == "csa":  # the indexer's choice: TOPK of each row's visible entries, -1 past a short row's count
        visible = (positions + 1) // ratio
        scores = torch.rand(S, int(visible.max()), generator=g, device="cuda")
        scores = scores.masked_fill(torch.arange(scores.shape[1], device="cuda") >= visible[:, None], -1)
        top = scores.topk(TOPK, dim=-1)
        ids = torch.where(top.values < 0, -1, top.indices)
    sinks = torch.randn(H, generator=g, device="cuda")
    return q, swa, entries, table, slots, positions, begins, ids, sinks, ratio


def _reference(q, swa, entries, table, slots, positions, begins, ids, sinks, ratio, scale):
    S = q.shape[0]
    wpos = positions[:, None] - W + 1 + torch.arange(W, device="cuda")
    valid = (wpos >= begins[:, None]) & (wpos >= 0)
    keys = swa[slots[:, None], wpos.clamp(min=0) % CAP]
    if entries is not None:
        if ids is None:
            e = torch.arange(int(positions.max() + 1) // ratio, device="cuda").expand(S, -1)
            ok = e < ((positions + 1) // ratio)[:, None]
        else:
            e, ok = ids.clamp(min=0), ids >= 0
        tok = e * ratio
        keys = torch.cat([keys, entries[table.gather(1, tok // BT), (tok % BT) // ratio]], dim=1)
        valid = torch.cat([valid, ok], dim=1)
    logits = torch.einsum("shd,skd->shk", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([logits, sinks.view(1, -1, 1).expand(S, -1, 1)], -1), -1)[..., :-1]
    return torch.einsum("shk,skd->shd", probs, keys.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_decode_kernel_at_flash_shape(kind: str, dtype: torch.dtype) -> None:
    from shared.engine.kernels.v4_decode import decode_attention

    contexts = [4096, 3000, 130, 4096 + 77, 2500, 8192, 1000, 2200]
    q, swa, entries, table, slots, positions, begins, ids, sinks, ratio = _case(kind, contexts, dtype)
    scale = D**-0.5
    max_entries = max(contexts) // ratio if ratio else 0
    got = decode_attention(q, swa, entries, table, slots, positions, begins, ids, sinks, scale, W, ratio, BT,
                           max_entries)
    want = _reference(q, swa, entries, table, slots, positions, begins, ids, sinks, ratio, scale)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def packed(pool: torch.Tensor, dtype: torch.dtype) -> Fp8Rows:
    """A pool as --kv-cache-dtype fp8 stores it (V4-Flash rows: 448 e4m3 channels in 7 scaled groups, 64 bf16)."""
    layout = RowLayout(D, ROPE)
    return Fp8Rows(quantize(pool, layout), layout, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_decode_kernel_reads_fp8_rows_at_flash_shape(kind: str, dtype: torch.dtype) -> None:
    """FP8 rings and entries read packed by the kernel against the torch reference over the same rows
    dequantized to the compute dtype (what the torch path's gathers give): the values are the same, so the
    tolerance is the compute dtype's, as above."""
    from shared.engine.kernels.v4_decode import decode_attention

    contexts = [4096, 3000, 130, 4096 + 77, 2500, 8192, 1000, 2200]
    q, swa, entries, table, slots, positions, begins, ids, sinks, ratio = _case(kind, contexts, dtype)
    swa8, entries8 = packed(swa, dtype), None if entries is None else packed(entries, dtype)
    scale = D**-0.5
    max_entries = max(contexts) // ratio if ratio else 0
    got = decode_attention(q, swa8, entries8, table, slots, positions, begins, ids, sinks, scale, W, ratio, BT,
                           max_entries)
    want = _reference(q, swa8[:], None if entries8 is None else entries8[:], table, slots, positions, begins, ids,
                      sinks, ratio, scale)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
