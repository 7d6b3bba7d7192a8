"""DeepSeek-V4 prefill attention in Triton: one sequence chunk's queries, flash style (no logits in memory).

A query at position p attends to one shared K = V head (head_dim wide) for all its heads:

    window    keys of positions (p - W, p] from `win` (the ring's older keys, then the chunk's own; row
              j of `win` is position first + j)
    entries   HCA: every visible compressed entry, [0, (p + 1) // m); CSA: the entries the indexer chose for
              this query, ids[p - start, :] (-1 = none)
    sink      a learned logit per head, in the softmax's denominator only (it carries no value)

Program (query block, head block) holds BQ queries x BH heads as the rows of one tile, so a key tile is read once
for all of them (CSA's keys differ per query: BQ = 1 there, the heads alone fill the rows). Online softmax in
float32, bf16 / fp32 in and out; the output is still rotated (the caller un-rotates it at p).

The indexer's scores for a block of queries: ReLU(q_h . k_e) weighted by the query's per-head weights, summed
over the index heads in registers (never an (n, heads, E) tensor); the caller takes top-k per block of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SLIDING_ONLY, ALL_ENTRIES, SELECTED_ENTRIES = 0, 1, 2  # what a query sees besides its window


def _precision(dtype: torch.dtype) -> str:
    # fp32: plain fp32 products (Triton's default for fp32 dots is tf32, ~3e-4 relative error)
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _online(q, keys, ok, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """Fold one key tile (BLOCK_N, D) into the running max / sum / accumulator of the rows; ok: (R, BLOCK_N)."""
    s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["n", "start", "first", "num_ids", "stride_ids"])
def _prefill_kernel(
    q_ptr, win_ptr, ent_ptr, ids_ptr, sink_ptr, o_ptr,
    n, H, start, first, window, ratio, num_ids, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ids,
    D: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    qb = tl.program_id(0)
    hb = tl.program_id(1)
    r = tl.arange(0, BQ * BH)
    qi = qb * BQ + r // BH  # (R,) query row in the chunk
    head = hb * BH + r % BH
    valid = (qi < n) & (head < H)
    p = start + qi  # positions
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qi[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    # the sink starts the running max and sum: exp(sink - m) is the denominator's extra term
    m_i = tl.load(sink_ptr + head, mask=head < H, other=0.0).to(tl.float32)
    l_i = tl.full([BQ * BH], 1.0, tl.float32)
    acc = tl.zeros([BQ * BH, D], tl.float32)
    p_lo = start + qb * BQ
    p_hi = tl.minimum(start + n, p_lo + BQ) - 1  # the block's last position
    # sliding window: positions max(first, p_lo - W + 1) .. p_hi, each row keeps (p - W, p]
    for k0 in range(tl.maximum(first, p_lo - window + 1), p_hi + 1, BLOCK_N):
        kp = k0 + tl.arange(0, BLOCK_N)
        kmask = kp <= p_hi
        keys = tl.load(win_ptr + (kp - first)[:, None].to(tl.int64) * D + d[None, :], mask=kmask[:, None],
                       other=0.0)
        ok = (kp[None, :] <= p[:, None]) & (kp[None, :] > p[:, None] - window) & kmask[None, :]
        m_i, l_i, acc = _online(q, keys, ok, m_i, l_i, acc, scale, PRECISION)
    if MODE == 1:  # every closed window's entry: (p + 1) // m of them
        visible = (p + 1) // ratio
        for e0 in range(0, (p_hi + 1) // ratio, BLOCK_N):
            e = e0 + tl.arange(0, BLOCK_N)
            emask = e < (p_hi + 1) // ratio
            keys = tl.load(ent_ptr + e[:, None].to(tl.int64) * D + d[None, :], mask=emask[:, None], other=0.0)
            ok = (e[None, :] < visible[:, None]) & emask[None, :]
            m_i, l_i, acc = _online(q, keys, ok, m_i, l_i, acc, scale, PRECISION)
    if MODE == 2:  # the entries this query's indexer chose (BQ == 1: every row is this query)
        for j0 in range(0, num_ids, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            e = tl.load(ids_ptr + qb.to(tl.int64) * stride_ids + j, mask=j < num_ids, other=-1)
            emask = e >= 0
            keys = tl.load(ent_ptr + tl.maximum(e, 0)[:, None].to(tl.int64) * D + d[None, :],
                           mask=emask[:, None], other=0.0)
            ok = (emask[None, :]) & (r[:, None] >= 0)
            m_i, l_i, acc = _online(q, keys, ok, m_i, l_i, acc, scale, PRECISION)
    out = acc / l_i[:, None]
    tl.store(o_ptr + qi[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


def prefill_attention(q: torch.Tensor, win: torch.Tensor, sinks: torch.Tensor, start: int, first: int,
                      window: int, scale: float, entries: torch.Tensor | None = None, ratio: int = 0,
                      ids: torch.Tensor | None = None, rows: int = 0, block_n: int = 0, num_warps: int = 0
                      ) -> torch.Tensor:
    """q (n, H, D) queries at positions start..start+n-1; win (start + n - first, D) keys of positions
    first..start+n-1; entries (E, D) with ratio (HCA: all visible) and, for CSA, ids (n, K) int32 entry ids
    per query (-1 = none); sinks (H,) float32. Returns (n, H, D) in q's dtype, still rotated.
    rows, block_n, num_warps: the tile (rows = queries x heads per program; 0 = the default for D: at V4-Flash's
    D = 512 on an H200, 64 rows (all heads of a query) x 32 keys, 8 warps was the fastest of 16-64 x 16-64 x 4-8
    for every kind, 1.4-2.1x the 16-row tile; fp32 keeps 16 rows)."""
    n, H, D = q.shape
    assert D & (D - 1) == 0 and win.shape == (start + n - first, D) and win.is_contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    mode = SLIDING_ONLY if entries is None else ALL_ENTRIES if ids is None else SELECTED_ENTRIES
    wide = D >= 256 and q.element_size() <= 2  # fp32 tiles of 64 x 32 x 512 overflow shared memory
    rows = rows or (64 if wide else 16)
    bh = min(triton.next_power_of_2(H), rows)
    # rows of a tile: CSA's heads alone (padded to the 16 rows a dot needs), else queries x heads
    bq = 1 if mode == SELECTED_ENTRIES else max(1, rows // bh)
    bh = max(bh, 16 // bq)
    ent = win if entries is None else entries.contiguous()
    sel = torch.empty(1, 1, dtype=torch.int32, device=q.device) if ids is None else ids.contiguous()
    q = q.contiguous()
    grid = (triton.cdiv(n, bq), triton.cdiv(H, bh))
    _prefill_kernel[grid](
        q, win, ent, sel, sinks, out,
        n, H, start, first, window, max(ratio, 1), sel.shape[1] if ids is not None else 0, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), sel.stride(0),
        D=D, BQ=bq, BH=bh, BLOCK_N=block_n or (32 if D >= 256 else 16), MODE=mode, PRECISION=_precision(q.dtype),
        num_warps=num_warps or (8 if D >= 256 else 4),
    )
    return out


@triton.jit(do_not_specialize=["n", "E", "start", "stride_ot"])
def _index_scores_kernel(
    q_ptr, w_ptr, k_ptr, out_ptr, n, E, start, ratio, scale,
    stride_qt, stride_qh, stride_wt, stride_ot,
    HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    rmask = rows < n
    emask = e < E
    c = tl.arange(0, DI)
    acc = tl.zeros([BM, BE], tl.float32)
    # causal: a tile past the entries the block's last row sees is all -inf (half the (n, E) square)
    if tl.program_id(1) * BE < (start + tl.minimum(n, tl.program_id(0) * BM + BM)) // ratio:
        keys = tl.load(k_ptr + e[:, None].to(tl.int64) * DI + c[None, :], mask=emask[:, None], other=0.0)
        for h in range(HI):  # the key tile stays in registers for every index head
            q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qt + h * stride_qh + c[None, :],
                        mask=rmask[:, None], other=0.0)
            w = tl.load(w_ptr + rows.to(tl.int64) * stride_wt + h, mask=rmask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
            acc += tl.maximum(s, 0.0) * w[:, None]
    acc = acc * scale
    visible = (start + rows + 1) // ratio
    acc = tl.where(e[None, :] < visible[:, None], acc, float("-inf"))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + e[None, :], acc,
             mask=rmask[:, None] & emask[None, :])


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: int, ratio: int,
                 scale: float, bm: int = 0, be: int = 0, num_warps: int = 4) -> torch.Tensor:
    """q (n, HI, DI) index queries at positions start..; weights (n, HI); keys (E, DI) -> (n, E) float32
    scores sum_h weights[:, h] relu(q_h . k_e) * scale, -inf where entry e is not yet visible."""
    n, HI, DI = q.shape
    E = keys.shape[0]
    assert DI & (DI - 1) == 0
    out = torch.empty(n, E, dtype=torch.float32, device=q.device)
    if n == 0 or E == 0:
        return out
    q, weights, keys = q.contiguous(), weights.contiguous(), keys.contiguous().to(q.dtype)
    half = q.element_size() <= 2  # 64 x 128 was the fastest bf16 tile on an H200; fp32 needs half the memory
    bm, be = bm or (64 if half else 32), be or (128 if half else 64)
    grid = (triton.cdiv(n, bm), triton.cdiv(E, be))
    _index_scores_kernel[grid](
        q, weights, keys, out, n, E, start, ratio, scale,
        q.stride(0), q.stride(1), weights.stride(0), out.stride(0),
        HI=HI, DI=DI, BM=bm, BE=be, PRECISION=_precision(q.dtype), num_warps=num_warps,
    )
    return out
