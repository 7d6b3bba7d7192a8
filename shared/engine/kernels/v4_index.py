"""DeepSeek-V4's lightning indexer scores for a decode step in one Triton launch, keys read through the block table.

For row s (one query at position p) and entry e < E (E: the batch's max_context // m, the same padded width for
every row):

    score[s, e] = sum_h  weights[s, h] * head_scale * relu(key_scale * iq[s, h] . key(e))     e < (p + 1) // m
                  -inf                                                                         otherwise

where key(e) is the indexer key of window e in the paged store, keys[table[s, e m // BT], (e m % BT) // m]
(K = index_head_dim channels). Program (s, tile) scores BLOCK_E entries: one tl.dot of the row's heads (padded
to 16+, the dot's rows) against the tile's keys, ReLU, then the weighted sum over the heads. A tile wholly past
the row's visible entries only writes -inf (it reads nothing). No (S, E, K) gather of the keys is ever made;
top-k stays in torch (decode.py's select).

FP8 keys (kv_quant.Fp8Rows of RowLayout(K, 0): [K e4m3 bytes | K / GROUP float32 scales], strides in bytes) are
dequantized in registers from the packed row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.engine.kv_quant import Fp8Rows, storage


@triton.jit(do_not_specialize=["E"])
def _index_kernel(
    iq_ptr, w_ptr, keys_ptr, table_ptr, pos_ptr, out_ptr, key_scale, head_scale, E,
    stride_qs, stride_qh, stride_ws, stride_k0, stride_k1, stride_bt, stride_os,
    H: tl.constexpr, H_PAD: tl.constexpr, K: tl.constexpr, M: tl.constexpr, BT: tl.constexpr,
    BLOCK_E: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
):
    s = tl.program_id(0)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    visible = (tl.load(pos_ptr + s) + 1) // M
    scores = tl.full([BLOCK_E], float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_E < visible:
        valid = e < visible
        h = tl.arange(0, H_PAD)
        c = tl.arange(0, K)
        q = tl.load(iq_ptr + s * stride_qs + h[:, None] * stride_qh + c[None, :], mask=(h < H)[:, None], other=0.0)
        tok = e * M
        blk = tl.load(table_ptr + s * stride_bt + tok // BT, mask=valid, other=0).to(tl.int64)
        row = blk * stride_k0 + ((tok % BT) // M).to(tl.int64) * stride_k1  # (BLOCK_E,) element / byte offsets
        if FP8:
            x = tl.load(keys_ptr + row[:, None] + c[None, :], mask=valid[:, None], other=0)
            x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            g = tl.arange(0, K // GROUP)
            sc = tl.load((keys_ptr + row[:, None] + K + 4 * g[None, :]).to(tl.pointer_type(tl.float32)),
                         mask=valid[:, None], other=0.0)
            key = tl.reshape(tl.reshape(x, (BLOCK_E, K // GROUP, GROUP)) * sc[:, :, None], (BLOCK_E, K))
            key = key.to(q.dtype)
        else:
            key = tl.load(keys_ptr + row[:, None] + c[None, :], mask=valid[:, None], other=0.0)
        dots = tl.dot(q, tl.trans(key), input_precision=PRECISION)  # (H_PAD, BLOCK_E)
        w = tl.load(w_ptr + s * stride_ws + h, mask=h < H, other=0.0).to(tl.float32) * head_scale
        summed = tl.sum(tl.maximum(dots * key_scale, 0.0) * w[:, None], 0)
        scores = tl.where(valid, summed, float("-inf"))
    tl.store(out_ptr + s * stride_os + e, scores, mask=e < E)


def index_scores(keys: torch.Tensor | Fp8Rows, table: torch.Tensor, iq: torch.Tensor, weights: torch.Tensor,
                 positions: torch.Tensor, ratio: int, block_tokens: int, entries: int, key_scale: float,
                 head_scale: float, block_e: int = 64, num_warps: int = 4) -> torch.Tensor:
    """keys (num_blocks, BT / m, K) the layer's indexer keys (compute dtype, or packed FP8 rows); table (S, NB)
    int64; iq (S, H, K) the rotated index queries; weights (S, H); positions (S,) int64; entries: E, the
    host-known width (the batch's max_context // m). Returns (S, E) float32 scores, -inf past each row's visible
    entries. No host reads: a CUDA graph can capture it."""
    S, H, K = iq.shape
    assert K & (K - 1) == 0 and K >= 16 and iq.stride(-1) == 1 and weights.stride(-1) == 1, iq.shape
    fp8 = isinstance(keys, Fp8Rows)
    if fp8:
        layout = keys.layout
        assert layout.width == K and layout.rope == 0 and layout.group >= 16, layout
    raw = storage(keys)
    assert raw.stride(-1) == 1
    out = torch.empty((S, entries), dtype=torch.float32, device=iq.device)
    if S == 0 or entries == 0:
        return out
    block_e = max(16, min(block_e, triton.next_power_of_2(entries)))
    _index_kernel[(S, triton.cdiv(entries, block_e))](
        iq, weights, raw, table, positions, out, key_scale, head_scale, entries,
        iq.stride(0), iq.stride(1), weights.stride(0), raw.stride(0), raw.stride(1), table.stride(0), out.stride(0),
        H=H, H_PAD=max(16, triton.next_power_of_2(H)), K=K, M=ratio, BT=block_tokens, BLOCK_E=block_e,
        PRECISION="ieee" if iq.dtype == torch.float32 else "tf32", FP8=fp8,
        GROUP=keys.layout.group if fp8 else 1,
        num_warps=num_warps,
    )
    return out
