"""DeepSeek-V4's compressor update of a decode step in one Triton launch: ring writes and closing windows' entries.

One program per row s of the step (one new token at position p), over the cache's pools (deepseek_v4/cache.py):

    kv_ring, gate_ring   (slots, cap, C) raw projections, token t of row slot[s] at [slot[s], t % cap];
                         C = 2d for CSA (Ca | Cb), d for HCA
    store                (num_blocks, BT / m, d) the paged entries: entry w of row s at
                         [table[s, w m // BT], (w m % BT) // m]

Each program writes the row's new kv and gate (C channels) at p % cap. If its window closes now ((p + 1) % m == 0,
and w = p // m is not a restored window: w >= frozen // m) it also builds entry w, as decode.py's `window_entry`
does: over the window's L slots (HCA: the m tokens [w m, w m + m); CSA: 2m, window w - 1's first d channels and
window w's last d), softmax(gate + ape) per channel with slots before begin[s] (bounded replay) or before 0
masked, the weighted sum of kv, RMSNorm with the compressor's weight, RoPE at position w m on the trailing
channels (interleaved pairs, angles w m * inv_freq in float32 as rope.py's Rotary computes them), and writes
it to the store. A row whose window stays open writes nothing there.

The window's slot of p itself is read from the new projections, not the ring: the ring write and the reads are
the same program's, and cap > L, so no other slot of the window shares p's ring slot.

Channels are held as two halves, even and odd (pair i of RoPE is channels 2i, 2i + 1): a (d / 2,) vector each,
so the rotation needs no shuffle. The softmax runs online over tiles of BLOCK_L slots (float32 running max, sum
and weighted sum per channel), so HCA's 128-slot windows at d = 512 need no (128, 512) tile in registers.

FP8 stores (--kv-cache-dtype fp8: kv_quant.Fp8Rows, packed uint8 rows, strides in bytes) get the entry packed
as kv_quant.quantize packs it, from the entry rounded to the compute dtype first (what the torch path quantizes):

    [ NOPE e4m3 bytes | NOPE / GROUP float32 scales (group amax / 448) | ROPE bfloat16 ]
    ^ byte 0            ^ byte NOPE                                      ^ byte ROPE_AT

A group of GROUP channels is GROUP / 2 pairs: the halves' (HALF_PAD,) vectors reshape to (groups, GROUP / 2)
for its amax. Divisions round to nearest (div_rn), as torch's do, so equal entries give equal bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shared.engine.kv_quant import Fp8Rows, storage


@triton.jit
def _pooled(kv_new, gate_new, kv_ring, gate_ring, ape_ptr, row, p, begin, first, cap, stride_rc,
            PARITY: tl.constexpr, D: tl.constexpr, HALF_PAD: tl.constexpr, M: tl.constexpr, BACK: tl.constexpr,
            BLOCK_L: tl.constexpr):
    """Channels 2k + PARITY of the entry: sum over the window's slots of softmax(gate + ape) * kv, (HALF_PAD,)
    float32. row: the ring row's base pointer offset; first: the window's first raw token ((w - BACK) m)."""
    k = tl.arange(0, HALF_PAD)
    kmask = k < D // 2
    m_run = tl.full([HALF_PAD], float("-inf"), tl.float32)
    l_run = tl.zeros([HALF_PAD], tl.float32)
    acc = tl.zeros([HALF_PAD], tl.float32)
    for j0 in range(0, (1 + BACK) * M, BLOCK_L):
        j = j0 + tl.arange(0, BLOCK_L)  # the window's slots
        tok = first + j
        ok = (j < (1 + BACK) * M) & (tok >= begin) & (tok >= 0)
        # CSA: slots of window w - 1 read channels [0, d) (Ca), those of window w channels [d, 2d) (Cb)
        ch = (j >= M).to(tl.int32)[:, None] * (BACK * D) + 2 * k[None, :] + PARITY  # (BLOCK_L, HALF_PAD)
        from_ring = (ok & (tok != p))[:, None] & kmask[None, :]
        from_new = (tok == p)[:, None] & kmask[None, :]
        at = row + (tl.where(tok >= 0, tok, 0) % cap).to(tl.int64)[:, None] * stride_rc + ch
        kv = tl.load(kv_ring + at, mask=from_ring, other=0.0).to(tl.float32)
        kv += tl.load(kv_new + ch, mask=from_new, other=0.0).to(tl.float32)
        gate = tl.load(gate_ring + at, mask=from_ring, other=0.0).to(tl.float32)
        gate += tl.load(gate_new + ch, mask=from_new, other=0.0).to(tl.float32)
        gate += tl.load(ape_ptr + (j % M)[:, None] * ((1 + BACK) * D) + ch, mask=ok[:, None] & kmask[None, :],
                        other=0.0)
        gate = tl.where(ok[:, None] & kmask[None, :], gate, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(gate, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of masked slots only (begin > 0)
        alpha = tl.exp(m_run - m_safe)
        pr = tl.exp(gate - m_safe[None, :])
        l_run = l_run * alpha + tl.sum(pr, 0)
        acc = acc * alpha + tl.sum(pr * kv, 0)
        m_run = m_new
    return acc / tl.where(l_run > 0, l_run, 1.0)


@triton.jit
def _store_fp8(row, even, odd, D: tl.constexpr, HALF_PAD: tl.constexpr, NOPE: tl.constexpr, GROUP: tl.constexpr,
               ROPE_AT: tl.constexpr):
    """The entry's halves (HALF_PAD,) float32 as one packed FP8 row at byte pointer row (module docstring)."""
    k = tl.arange(0, HALF_PAD)
    nope = k < NOPE // 2  # pair k is channels 2k, 2k + 1: NOPE is even, so a pair is all e4m3 or all RoPE
    rope = (k >= NOPE // 2) & (k < D // 2)
    amax = tl.where(nope, tl.maximum(tl.abs(even), tl.abs(odd)), 0.0)
    amax = tl.max(tl.reshape(amax, (HALF_PAD // (GROUP // 2), GROUP // 2)), 1)  # (groups padded,)
    scale = tl.math.div_rn(amax, 448.0)  # e4m3's largest finite value, as kv_quant.FP8_MAX
    safe = tl.maximum(scale, 1.1754943508222875e-38)  # float32's tiny: an all-zero group is stored as 0
    per = tl.reshape(tl.broadcast_to(safe[:, None], (HALF_PAD // (GROUP // 2), GROUP // 2)), (HALF_PAD,))
    tl.store(row + 2 * k, _e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(even, per), -448.0), 448.0)), mask=nope)
    tl.store(row + 2 * k + 1, _e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(odd, per), -448.0), 448.0)),
             mask=nope)
    g = tl.arange(0, HALF_PAD // (GROUP // 2))
    tl.store((row + NOPE + 4 * g).to(tl.pointer_type(tl.float32)), scale, mask=g < NOPE // GROUP)
    at = (row + ROPE_AT + 2 * (2 * tl.where(rope, k, NOPE // 2) - NOPE)).to(tl.pointer_type(tl.uint16))
    tl.store(at, _bf16_bits(even), mask=rope)
    tl.store(at + 1, _bf16_bits(odd), mask=rope)


@triton.jit
def _e4m3_bits(x):
    """float32 in [-448, 448] -> the bits of the nearest e4m3fn (ties to even), as torch rounds; spelled out
    because the interpreter's float32 -> float8e4nv cast gets a rounding carry into the exponent wrong."""
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)  # round the mantissa to 3 bits; a carry moves the exponent on
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)  # exponent bias 127 -> 7
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)  # below 2^-6: multiples of 2^-9, rounded
    return (tl.where(a >= 0.015625, normal, subnormal) | sign).to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """float32 -> the bits of the nearest bfloat16 (ties to even), as torch rounds; spelled out because the
    interpreter's float32 -> bfloat16 cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)


@triton.jit
def _compress_kernel(
    kv_new, gate_new, kv_ring, gate_ring, ape_ptr, norm_ptr, freq_ptr, slot_ptr, pos_ptr, begin_ptr, frozen_ptr,
    table_ptr, store_ptr, eps, cap,
    stride_ns, stride_gs, stride_rs, stride_rc, stride_bt, stride_e0, stride_e1,
    D: tl.constexpr, HALF_PAD: tl.constexpr, C_PAD: tl.constexpr, ROPE_HALF: tl.constexpr, M: tl.constexpr,
    BACK: tl.constexpr, BT: tl.constexpr, BLOCK_L: tl.constexpr, FP8: tl.constexpr, NOPE: tl.constexpr,
    GROUP: tl.constexpr, ROPE_AT: tl.constexpr,
):
    s = tl.program_id(0)
    p = tl.load(pos_ptr + s)
    slot = tl.load(slot_ptr + s).to(tl.int64)
    row = slot * stride_rs
    kv_new += s * stride_ns
    gate_new += s * stride_gs
    # 1. the ring write: this token's raw projections at p % cap
    c = tl.arange(0, C_PAD)
    cmask = c < (1 + BACK) * D
    at = row + (p % cap).to(tl.int64) * stride_rc + c
    tl.store(kv_ring + at, tl.load(kv_new + c, mask=cmask).to(kv_ring.dtype.element_ty), mask=cmask)
    tl.store(gate_ring + at, tl.load(gate_new + c, mask=cmask).to(gate_ring.dtype.element_ty), mask=cmask)
    # 2. a closing window's entry
    w = p // M
    if ((p + 1) % M == 0) & (w >= tl.load(frozen_ptr + s) // M):
        begin = tl.load(begin_ptr + s)
        first = (w - BACK) * M
        even = _pooled(kv_new, gate_new, kv_ring, gate_ring, ape_ptr, row, p, begin, first, cap, stride_rc,
                       0, D, HALF_PAD, M, BACK, BLOCK_L)
        odd = _pooled(kv_new, gate_new, kv_ring, gate_ring, ape_ptr, row, p, begin, first, cap, stride_rc,
                      1, D, HALF_PAD, M, BACK, BLOCK_L)
        k = tl.arange(0, HALF_PAD)
        kmask = k < D // 2
        inv_rms = 1.0 / tl.sqrt((tl.sum(even * even, 0) + tl.sum(odd * odd, 0)) / D + eps)
        even = even * inv_rms * tl.load(norm_ptr + 2 * k, mask=kmask, other=0.0)
        odd = odd * inv_rms * tl.load(norm_ptr + 2 * k + 1, mask=kmask, other=0.0)
        # RoPE on the trailing 2 ROPE_HALF channels: pair k of the entry is rotary pair k - (D / 2 - ROPE_HALF)
        fi = k - (D // 2 - ROPE_HALF)
        rot = (fi >= 0) & kmask
        freqs = (w * M).to(tl.float32) * tl.load(freq_ptr + tl.where(rot, fi, 0), mask=rot, other=0.0)
        cos = tl.where(rot, tl.cos(freqs), 1.0)
        sin = tl.where(rot, tl.sin(freqs), 0.0)
        even, odd = even * cos - odd * sin, odd * cos + even * sin
        tok = w * M
        blk = tl.load(table_ptr + s * stride_bt + tok // BT).to(tl.int64)
        out = store_ptr + blk * stride_e0 + ((tok % BT) // M).to(tl.int64) * stride_e1  # the entry's store row
        if FP8:
            dtype = kv_new.dtype.element_ty  # the compute dtype: the torch path quantizes entry.to(it)
            _store_fp8(out, even.to(dtype).to(tl.float32), odd.to(dtype).to(tl.float32), D, HALF_PAD, NOPE, GROUP,
                       ROPE_AT)
        else:
            tl.store(out + 2 * k, even.to(store_ptr.dtype.element_ty), mask=kmask)
            tl.store(out + 2 * k + 1, odd.to(store_ptr.dtype.element_ty), mask=kmask)


def compress_update(kv_new: torch.Tensor, gate_new: torch.Tensor, kv_ring: torch.Tensor, gate_ring: torch.Tensor,
                    ape: torch.Tensor, norm: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, begins: torch.Tensor, frozen: torch.Tensor, table: torch.Tensor,
                    store: torch.Tensor | Fp8Rows, ratio: int, overlap: bool, eps: float, block_tokens: int,
                    block_l: int = 16, num_warps: int | None = None) -> None:
    """One compressor's update for the step's S rows, in place (see the module docstring).

    kv_new, gate_new (S, C) this step's projections; kv_ring, gate_ring (slots, cap, C) the layer's ring pools;
    ape (m, C) float32; norm (d,) float32; inv_freq (rope / 2,) float32, the compressor's RoPE table
    (rope.py's Rotary.inv_freq); slots, positions, begins, frozen (S,) int64; table (S, NB) int64; store
    (num_blocks, BT / m, d) in the compute dtype, or its packed FP8 rows. No host reads: a CUDA graph can
    capture it. num_warps: 8 for entries of 512 channels (a (BLOCK_L, 256) tile per half and tensor), else 4
    (a guess: not swept yet)."""
    S, C = kv_new.shape
    d = store.shape[-1]
    layout = store.layout if isinstance(store, Fp8Rows) else None
    # FP8: float32 scales at byte NOPE of 4-aligned rows
    assert layout is None or (layout.nope % 4 == 0 and layout.row_bytes % 4 == 0), layout
    store = storage(store)
    back = 1 if overlap else 0
    assert C == (1 + back) * d and kv_ring.shape == gate_ring.shape and kv_ring.shape[-1] == C, (C, d)
    assert kv_ring.stride() == gate_ring.stride() and kv_ring.stride(-1) == 1 and store.stride(-1) == 1
    assert kv_new.stride(-1) == 1 and gate_new.stride(-1) == 1 and ape.is_contiguous() and d % 2 == 0
    if S == 0:
        return
    half_pad = triton.next_power_of_2(d // 2)
    _compress_kernel[(S,)](
        kv_new, gate_new, kv_ring, gate_ring, ape, norm, inv_freq, slots, positions, begins, frozen, table, store,
        eps, kv_ring.shape[1],
        kv_new.stride(0), gate_new.stride(0), kv_ring.stride(0), kv_ring.stride(1), table.stride(0),
        store.stride(0), store.stride(1),
        D=d, HALF_PAD=half_pad, C_PAD=triton.next_power_of_2(C), ROPE_HALF=inv_freq.numel(),
        M=ratio, BACK=back, BT=block_tokens, BLOCK_L=min(block_l, triton.next_power_of_2((1 + back) * ratio)),
        FP8=layout is not None, NOPE=0 if layout is None else layout.nope,
        GROUP=2 if layout is None else layout.group, ROPE_AT=0 if layout is None else layout.rope_at,
        num_warps=num_warps or (8 if half_pad >= 256 else 4),
    )
