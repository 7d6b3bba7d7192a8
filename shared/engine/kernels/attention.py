"""Paged attention in Triton: decode (one query row per sequence) and prefill (many rows, causal).

Both read K/V through the block table from the paged cache of one layer, (num_blocks, B, KV, D), where this
step's keys and values were already written; a key at position p of sequence s lives in page
block_tables[s, p // B], slot p % B. Softmax runs in float32 (online, flash style), whatever the cache dtype.

Decode splits each sequence into partitions of PART keys (flash-decoding): program (s, kv_head, part) folds
the G query heads that share one KV head into the rows of one tile, so K/V are read once per KV head, and
writes a partial (max, sum, acc); a second kernel merges the partitions. The grid covers the longest context
a sequence may have, so a CUDA graph captured once serves every length (programs past the end exit at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 on the GPU: plain fp32 products (Triton's default for fp32 dots is tf32, ~3e-4 relative error)
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr,
    scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, num_parts,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, PART: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    H = tl.num_programs(1) * G
    ctx = tl.load(ctx_ptr + s)
    start = part * PART
    if start < ctx:
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = kvh * G + g  # (G_PAD,)
        gmask = g < G
        q = tl.load(q_ptr + s * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        end = tl.minimum(start + PART, ctx)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
            pmask = pos < end
            page = tl.load(bt_ptr + s * stride_bt + pos // BT, mask=pmask, other=0).to(tl.int64)
            off = page * stride_kb + (pos % BT) * stride_ks + kvh * stride_kh  # (BLOCK_N,)
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)  # (BLOCK_N, D)
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (G_PAD, BLOCK_N)
            scores = tl.where(pmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        row = (s * H + heads) * num_parts + part  # scratch layout (S, H, P[, D])
        tl.store(m_ptr + row, m, mask=gmask)
        tl.store(l_ptr + row, l, mask=gmask)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _decode_merge_kernel(
    o_ptr, ctx_ptr, m_ptr, l_ptr, acc_ptr, stride_ot, stride_oh, num_parts,
    D: tl.constexpr, PART: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    ctx = tl.load(ctx_ptr + s)
    d = tl.arange(0, D)
    base = (s * H + h) * num_parts
    # running max and sum kept as (D,) vectors of one value: loop-carried values keep one type
    m = tl.full([D], float("-inf"), tl.float32)
    l = tl.zeros([D], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for part in range(0, tl.cdiv(ctx, PART)):
        m_p = tl.load(m_ptr + base + part)
        l_p = tl.load(l_ptr + base + part)
        acc_p = tl.load(acc_ptr + (base + part) * D + d)
        m_new = tl.maximum(m, m_p)
        a, b = tl.exp(m - m_new), tl.exp(m_p - m_new)
        l = l * a + l_p * b
        acc = acc * a + acc_p * b
        m = m_new
    out = tl.where(l > 0, acc / tl.maximum(l, 1e-30), 0.0)  # a padded row (ctx 0) gets zeros, not NaN
    tl.store(o_ptr + s * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, max_context: int, part: int | None = None, block_n: int = 64,
) -> torch.Tensor:
    """q (S, H, D) one row per sequence; caches (num_blocks, B, KV, D); block_tables (S, max_blocks) int32;
    context_lens (S,) int32 (0 = padding row: output zeros). max_context bounds every context (grid size).

    part: keys per partition; by default about an eighth of max_context (64..512 keys): short contexts are
    latency-bound, so more, shorter partitions run in parallel (seen on the H200: a 172-token context took
    5.6 us per layer in one partition)."""
    if part is None:
        part = min(512, max(64, triton.next_power_of_2(triton.cdiv(max_context, 8))))
    block_n = max(16, min(block_n, part))  # tl.dot needs K >= 16 (the PV product runs over BLOCK_N keys)
    part = max(part, block_n)
    S, H, D = q.shape
    _, BT, KV, _ = k_cache.shape
    G = H // KV
    num_parts = max(1, triton.cdiv(max_context, part))
    m = torch.empty((S, H, num_parts), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((S, H, num_parts, D), dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(S, KV, num_parts)](
        q, k_cache, v_cache, block_tables, context_lens, m, l, acc,
        scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), num_parts,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BT=BT, PART=part, BLOCK_N=block_n,
        PRECISION=_dot_precision(q.dtype),
    )
    out = torch.empty((S, H, D), dtype=q.dtype, device=q.device)
    _decode_merge_kernel[(S, H)](out, context_lens, m, l, acc, out.stride(0), out.stride(1), num_parts, D=D, PART=part)
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, qs_ptr, ql_ptr, ctx_ptr,
    scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    mblk = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    q_start = tl.load(qs_ptr + s)
    q_len = tl.load(ql_ptr + s)
    ctx = tl.load(ctx_ptr + s)
    if mblk * BLOCK_M < q_len:
        rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this tile, within the sequence's chunk
        rmask = rows < q_len
        qpos = ctx - q_len + rows  # their positions: row i sees keys [0, qpos[i]]
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=rmask[:, None], other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        end = tl.minimum(ctx, ctx - q_len + (mblk + 1) * BLOCK_M)  # keys past the tile's last row are masked
        for n0 in range(0, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            page = tl.load(bt_ptr + s * stride_bt + pos // BT, mask=pmask, other=0).to(tl.int64)
            off = page * stride_kb + (pos % BT) * stride_ks + kvh * stride_kh
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
            visible = (pos[None, :] <= qpos[:, None]) & pmask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see nothing
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(o_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    q_starts: torch.Tensor, q_lens: torch.Tensor, context_lens: torch.Tensor, max_q_len: int, scale: float,
    block_m: int = 64, block_n: int = 64,
) -> torch.Tensor:
    """q (T, H, D): sequence s owns rows [q_starts[s], q_starts[s] + q_lens[s]) at positions
    [context_lens[s] - q_lens[s], context_lens[s]). Returns (T, H, D)."""
    T, H, D = q.shape
    _, BT, KV, _ = k_cache.shape
    S = q_lens.shape[0]
    out = torch.empty_like(q)
    _prefill_kernel[(triton.cdiv(max_q_len, block_m), S, H)](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, context_lens,
        scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=H // KV, D=D, BT=BT, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype),
    )
    return out
