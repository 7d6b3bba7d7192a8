"""DeepSeek-V4 decode attention in Triton: every sequence of a decode step (one query row each) in one launch.

Keys of the query at position p of sequence s (K = V: one shared head of D channels, read once for a tile of
BLOCK_H query heads, which are the rows of the tl.dot tile):
    window      the sliding ring's slots of positions (p - WIN, p] that are >= begin[s] (this step's key is
                already in the ring), ring row slot[s] of `swa` (slots, cap, D)
    compressed  HCA: the (p + 1) // RATIO visible entries; CSA: the indexer's chosen entry ids ids[s, :]
                (-1 = none); entry e lives in entries[table[s, e RATIO // BT], (e RATIO % BT) // RATIO]
The learned sink of each head joins the softmax's denominator (a logit with no value). Output (S, H, D) is still
rotated: the caller undoes V's rotation at the query's position.

Flash-decoding: the key axis (window padded to WPAD, then the compressed entries) is cut into partitions of
PART keys; program (s, head tile, part) writes a partial (max, sum, acc) and a second kernel merges them with the
sink. A tile of BLOCK_N keys is all window or all compressed (WPAD and PART are multiples of BLOCK_N): two loops.
Softmax runs in float32 whatever the cache dtype.

FP8 storage (--kv-cache-dtype fp8: `swa` and `entries` are kv_quant.Fp8Rows, packed uint8 rows of RowLayout)
is read in the tile load, so only the packed bytes cross HBM. A row of row_bytes:

    [ NOPE e4m3 bytes | NOPE / GROUP float32 scales | ROPE bfloat16 ]      (V4-Flash: 448 | 7 x 4 | 64 x 2 = 604)
    ^ byte 0            ^ byte NOPE                   ^ byte ROPE_AT

A key tile is two: the e4m3 channels as (BLOCK_N, D) (bytes past NOPE masked to 0), times their scales
broadcast over (BLOCK_N, D / GROUP, GROUP), and the RoPE channels as (BLOCK_N, ROPE); scores and the acc take a
dot with each (q's RoPE columns loaded apart), and the partial's acc columns from NOPE on come from the second.
Strides are the packed tensor's, in bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.engine.kv_quant import Fp8Rows, RowLayout, storage

SLIDING, HCA, CSA = 0, 1, 2  # MODE: which compressed keys a layer adds to the window


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 on the GPU: plain fp32 products (Triton's default for fp32 dots is tf32, ~3e-4 relative error)
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _softmax_step(scores, valid, m, l):
    """A tile's scores (BLOCK_H, BLOCK_N) into the running max / sum -> (max, sum, rescale, probabilities)."""
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no key yet (begin > 0)
    alpha = tl.exp(m - m_safe)
    pr = tl.exp(scores - m_safe[:, None])
    return m_new, l * alpha + tl.sum(pr, 1), alpha, pr


@triton.jit
def _fold(q, k, valid, m, l, acc, scale, PRECISION: tl.constexpr):
    """One tile of keys (K = V) into the running softmax of the head rows."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_H, BLOCK_N)
    m, l, alpha, pr = _softmax_step(scores, valid, m, l)
    acc = acc * alpha[:, None] + tl.dot(pr.to(k.dtype), k, input_precision=PRECISION)
    return m, l, acc


@triton.jit
def _fold_split(q, qr, k, kr, valid, m, l, acc, accr, scale, PRECISION: tl.constexpr):
    """_fold of FP8 rows: k (BLOCK_N, D) the scaled e4m3 channels (zero from NOPE on), kr (BLOCK_N, ROPE) the
    bf16 RoPE channels, against q and its RoPE columns qr: two dots each way, accr the RoPE columns' acc."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) + tl.dot(qr, tl.trans(kr), input_precision=PRECISION)
    m, l, alpha, pr = _softmax_step(scores * scale, valid, m, l)
    pr = pr.to(k.dtype)
    acc = acc * alpha[:, None] + tl.dot(pr, k, input_precision=PRECISION)
    accr = accr * alpha[:, None] + tl.dot(pr, kr, input_precision=PRECISION)
    return m, l, acc, accr


@triton.jit
def _fp8_keys(ptr, off, valid, dtype: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr,
              GROUP: tl.constexpr, ROPE: tl.constexpr, ROPE_AT: tl.constexpr):
    """Packed rows at byte offsets off (BLOCK_N,) -> (the e4m3 channels times their scales as (BLOCK_N, D), zero
    from NOPE on; the RoPE channels (BLOCK_N, ROPE)), in dtype; zeros where not valid."""
    row = ptr + tl.multiple_of(off, 4)[:, None]  # rows are 4-aligned (row_bytes % 4 == 0): word loads
    d = tl.arange(0, D)
    x = tl.load(row + d[None, :], mask=valid[:, None] & (d < NOPE)[None, :], other=0)
    x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    g = tl.arange(0, D // GROUP)  # groups across D: those past NOPE // GROUP are RoPE's, scale 0
    sc = tl.load((row + NOPE + 4 * g[None, :]).to(tl.pointer_type(tl.float32)),
                 mask=valid[:, None] & (g < NOPE // GROUP)[None, :], other=0.0)
    k = tl.reshape(tl.reshape(x, (BLOCK_N, D // GROUP, GROUP)) * sc[:, :, None], (BLOCK_N, D))
    r = tl.arange(0, ROPE)
    kr = tl.load((row + ROPE_AT + 2 * r[None, :]).to(tl.pointer_type(tl.bfloat16)), mask=valid[:, None], other=0.0)
    return k.to(dtype), kr.to(dtype)


@triton.jit
def _fold_tile(ptr, off, valid, q, qr, m, l, acc, accr, scale, PRECISION: tl.constexpr, FP8: tl.constexpr,
               BLOCK_N: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr, ROPE: tl.constexpr,
               ROPE_AT: tl.constexpr):
    """The tile of keys at byte / element offsets off (BLOCK_N,) of ptr, loaded as the store holds them (FP8
    packed rows or compute-dtype rows), into the running softmax -> (m, l, acc, accr); accr (the RoPE columns'
    acc) is only updated for FP8 rows."""
    if FP8:
        k, kr = _fp8_keys(ptr, off, valid, q.dtype, BLOCK_N, D, NOPE, GROUP, ROPE, ROPE_AT)
        m, l, acc, accr = _fold_split(q, qr, k, kr, valid, m, l, acc, accr, scale, PRECISION)
    else:
        d = tl.arange(0, D)
        k = tl.load(ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        m, l, acc = _fold(q, k, valid, m, l, acc, scale, PRECISION)
    return m, l, acc, accr


@triton.jit(do_not_specialize=["num_ids", "num_parts", "stride_ids"])
def _partial_kernel(
    q_ptr, swa_ptr, ent_ptr, bt_ptr, slot_ptr, pos_ptr, begin_ptr, ids_ptr, m_ptr, l_ptr, acc_ptr,
    scale, cap, num_ids, num_parts,
    stride_qs, stride_qh, stride_ws, stride_wc, stride_e0, stride_e1, stride_bt, stride_ids,
    H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, WIN: tl.constexpr, WPAD: tl.constexpr,
    RATIO: tl.constexpr, BT: tl.constexpr, MODE: tl.constexpr, PART: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr, ROPE: tl.constexpr,
    ROPE_AT: tl.constexpr,
):
    s = tl.program_id(0)
    hb = tl.program_id(1)
    part = tl.program_id(2)
    p = tl.load(pos_ptr + s)
    begin = tl.load(begin_ptr + s)
    slot = tl.load(slot_ptr + s).to(tl.int64)
    if MODE == 1:  # HCA (module globals are not visible in a jit function)
        total = WPAD + (p + 1) // RATIO
    elif MODE == 2:  # CSA
        total = WPAD + num_ids
    else:
        total = WPAD + p * 0
    start = part * PART
    if start < total:
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = h < H
        d = tl.arange(0, D)
        r = NOPE + tl.arange(0, ROPE)  # FP8: the RoPE columns (ROPE 16 when unused)
        q_rows = q_ptr + s * stride_qs + h[:, None] * stride_qh
        q = tl.load(q_rows + d[None, :], mask=hmask[:, None], other=0.0)
        qr = tl.load(q_rows + r[None, :], mask=hmask[:, None], other=0.0)  # DCE'd unless FP8
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        accr = tl.zeros([BLOCK_H, ROPE], tl.float32)
        end = tl.minimum(start + PART, total)
        # two loops, no branch inside (FP8 is a constexpr): each can be software-pipelined
        for n0 in range(start, tl.minimum(end, WPAD), BLOCK_N):  # window keys: positions p - WIN + 1 + t
            t = n0 + tl.arange(0, BLOCK_N)
            kp = p - WIN + 1 + t
            valid = (t < WIN) & (kp >= begin) & (kp >= 0)
            off = slot * stride_ws + (tl.where(kp >= 0, kp, 0) % cap).to(tl.int64) * stride_wc
            m, l, acc, accr = _fold_tile(swa_ptr, off, valid, q, qr, m, l, acc, accr, scale, PRECISION, FP8,
                                         BLOCK_N, D, NOPE, GROUP, ROPE, ROPE_AT)
        for n0 in range(tl.maximum(start, WPAD), end, BLOCK_N):  # compressed entries through the block table
            t = n0 + tl.arange(0, BLOCK_N)
            valid = t < end
            if MODE == 2:  # CSA: the indexer's ids
                e = tl.load(ids_ptr + s * stride_ids + (t - WPAD), mask=valid, other=-1)
                valid = valid & (e >= 0)
                e = tl.maximum(e, 0)
            else:
                e = t - WPAD
            tok = e * RATIO
            blk = tl.load(bt_ptr + s * stride_bt + tok // BT, mask=valid, other=0).to(tl.int64)
            off = blk * stride_e0 + ((tok % BT) // RATIO).to(tl.int64) * stride_e1
            m, l, acc, accr = _fold_tile(ent_ptr, off, valid, q, qr, m, l, acc, accr, scale, PRECISION, FP8,
                                         BLOCK_N, D, NOPE, GROUP, ROPE, ROPE_AT)
        row_id = (s * H + h) * num_parts + part  # scratch layout (S, H, P[, D])
        tl.store(m_ptr + row_id, m, mask=hmask)
        tl.store(l_ptr + row_id, l, mask=hmask)
        acc_rows = acc_ptr + row_id[:, None] * D
        if FP8:  # acc's columns from NOPE on are zero: accr holds them
            tl.store(acc_rows + d[None, :], acc, mask=hmask[:, None] & (d < NOPE)[None, :])
            tl.store(acc_rows + r[None, :], accr, mask=hmask[:, None])
        else:
            tl.store(acc_rows + d[None, :], acc, mask=hmask[:, None])
    else:  # past this row's keys: an empty partial, so the merge needs no per-row bound
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = h < H
        row_id = (s * H + h) * num_parts + part
        tl.store(m_ptr + row_id, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=hmask)
        tl.store(l_ptr + row_id, tl.zeros([BLOCK_H], tl.float32), mask=hmask)


@triton.jit(do_not_specialize=["num_parts"])
def _merge_kernel(o_ptr, sink_ptr, m_ptr, l_ptr, acc_ptr, stride_os, stride_oh, num_parts, D: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    H = tl.num_programs(1)
    d = tl.arange(0, D)
    base = (s * H + h) * num_parts
    # the sink starts the running softmax: max = sink, sum = exp(sink - sink) = 1, no value.
    # Running max and sum are (D,) vectors of one value: loop-carried values keep one type.
    m = tl.zeros([D], tl.float32) + tl.load(sink_ptr + h)
    l = tl.full([D], 1.0, tl.float32)
    acc = tl.zeros([D], tl.float32)
    for part in range(0, num_parts):
        m_p = tl.load(m_ptr + base + part)
        l_p = tl.load(l_ptr + base + part)
        if l_p > 0:  # an empty partial (m = -inf) adds nothing; its acc was never written
            acc_p = tl.load(acc_ptr + (base + part) * D + d)
            m_new = tl.maximum(m, m_p)
            a, b = tl.exp(m - m_new), tl.exp(m_p - m_new)
            l = l * a + l_p * b
            acc = acc * a + acc_p * b
            m = m_new
    tl.store(o_ptr + s * stride_os + h * stride_oh + d, (acc / l).to(o_ptr.dtype.element_ty))


def _packing(swa: torch.Tensor | Fp8Rows, entries: torch.Tensor | Fp8Rows | None, width: int) -> RowLayout | None:
    """The FP8 stores' row layout (one for the ring and the entries), or None: compute-dtype stores."""
    if not isinstance(swa, Fp8Rows):
        assert entries is None or not isinstance(entries, Fp8Rows)
        return None
    layout = swa.layout
    assert entries is None or (isinstance(entries, Fp8Rows) and entries.layout == layout)
    # aligned float32 scales and bfloat16 RoPE channels (rows start 4-aligned, scales at byte nope); the RoPE
    # channels are a tile of their own (a power of two, 16+ for tl.dot), groups tile D
    rope = layout.rope
    assert layout.width == width and layout.nope % 4 == 0 and width % layout.group == 0, layout
    assert rope >= 16 and rope & (rope - 1) == 0, layout
    return layout


def decode_attention(
    q: torch.Tensor, swa: torch.Tensor | Fp8Rows, entries: torch.Tensor | Fp8Rows | None, table: torch.Tensor,
    slots: torch.Tensor, positions: torch.Tensor, begins: torch.Tensor, ids: torch.Tensor | None, sinks: torch.Tensor,
    scale: float, window: int, ratio: int, block_tokens: int, max_entries: int, block_h: int | None = None,
    block_n: int = 32, part: int | None = None, num_warps: int = 8,
) -> torch.Tensor:
    """q (S, H, D) one row per sequence; swa (slots, cap, D) this layer's ring pool, this step's keys written;
    entries (num_blocks, BT / ratio, D) or None (sliding layer), both of q's dtype or both FP8 rows (Fp8Rows:
    read packed, dequantized in registers); table (S, NB) int; slots, positions, begins (S,) int; ids (S, K)
    int64 chosen entries (CSA, -1 = none) or None (HCA: all visible); sinks (H,) float32. max_entries bounds
    (p + 1) // ratio over the batch (HCA; host-known, sizes the grid). Returns (S, H, D).

    Tiles (H200, CSA at V4-Flash shape, CUDA-graph replays): BLOCK_N 32 and 8 warps; 16 heads a tile for small
    batches (17.7 us at batch 1 against 22.5 us with 64), all 64 heads in one tile (K read once) from batch 16
    on (66 us at batch 32 against 78-89 us with 16 or 32; BLOCK_N 64 with 64 heads runs out of resources)."""
    S, H, D = q.shape
    if block_h is None:
        block_h = 64 if S >= 16 else 16
    mode = SLIDING if entries is None else (CSA if ids is not None else HCA)
    block_h = max(16, min(block_h, triton.next_power_of_2(H)))  # tl.dot needs 16+ rows: pad the heads
    wpad = triton.cdiv(window, block_n) * block_n
    comp = {SLIDING: 0, HCA: max_entries, CSA: 0 if ids is None else ids.shape[1]}[mode]
    keys = wpad + comp
    head_tiles = triton.cdiv(H, block_h)
    if part is None:  # about two programs per SM of an H200 (132), never under one tile of keys
        want = max(1, min(triton.cdiv(keys, block_n), triton.cdiv(264, S * head_tiles)))
        part = triton.cdiv(triton.cdiv(keys, want), block_n) * block_n
    num_parts = triton.cdiv(keys, part)
    m = torch.empty((S, H, num_parts), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((S, H, num_parts, D), dtype=torch.float32, device=q.device)
    layout = _packing(swa, entries, D)
    swa = storage(swa)
    ent = swa if entries is None else storage(entries)  # a sliding layer never reads it
    idx = slots if ids is None else ids
    _partial_kernel[(S, head_tiles, num_parts)](
        q, swa, ent, table, slots, positions, begins, idx, m, l, acc,
        scale, swa.shape[1], comp if mode == CSA else 0, num_parts,
        q.stride(0), q.stride(1), swa.stride(0), swa.stride(1), ent.stride(0), ent.stride(1), table.stride(0),
        idx.stride(0) if ids is not None else 0,
        H=H, BLOCK_H=block_h, D=D, WIN=window, WPAD=wpad, RATIO=max(ratio, 1), BT=block_tokens, MODE=mode,
        PART=part, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype), FP8=layout is not None,
        NOPE=0 if layout is None else layout.nope, GROUP=1 if layout is None else layout.group,
        ROPE=16 if layout is None else layout.rope, ROPE_AT=0 if layout is None else layout.rope_at,
        num_warps=num_warps,
    )
    out = torch.empty((S, H, D), dtype=q.dtype, device=q.device)
    _merge_kernel[(S, H)](out, sinks, m, l, acc, out.stride(0), out.stride(1), num_parts, D=D)
    return out
