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

FP8 stores (kv_quant.Fp8Rows) are not written here: decode.py takes its torch path for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _compress_kernel(
    kv_new, gate_new, kv_ring, gate_ring, ape_ptr, norm_ptr, freq_ptr, slot_ptr, pos_ptr, begin_ptr, frozen_ptr,
    table_ptr, store_ptr, eps, cap,
    stride_ns, stride_gs, stride_rs, stride_rc, stride_bt, stride_e0, stride_e1,
    D: tl.constexpr, HALF_PAD: tl.constexpr, C_PAD: tl.constexpr, ROPE_HALF: tl.constexpr, M: tl.constexpr,
    BACK: tl.constexpr, BT: tl.constexpr, BLOCK_L: tl.constexpr,
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
        out = store_ptr + blk * stride_e0 + ((tok % BT) // M).to(tl.int64) * stride_e1 + 2 * k
        tl.store(out, even.to(store_ptr.dtype.element_ty), mask=kmask)
        tl.store(out + 1, odd.to(store_ptr.dtype.element_ty), mask=kmask)


def compress_update(kv_new: torch.Tensor, gate_new: torch.Tensor, kv_ring: torch.Tensor, gate_ring: torch.Tensor,
                    ape: torch.Tensor, norm: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor, begins: torch.Tensor, frozen: torch.Tensor, table: torch.Tensor,
                    store: torch.Tensor, ratio: int, overlap: bool, eps: float, block_tokens: int,
                    block_l: int = 16, num_warps: int | None = None) -> None:
    """One compressor's update for the step's S rows, in place (see the module docstring).

    kv_new, gate_new (S, C) this step's projections; kv_ring, gate_ring (slots, cap, C) the layer's ring pools;
    ape (m, C) float32; norm (d,) float32; inv_freq (rope / 2,) float32, the compressor's RoPE table
    (rope.py's Rotary.inv_freq); slots, positions, begins, frozen (S,) int64; table (S, NB) int64; store
    (num_blocks, BT / m, d) in the compute dtype. No host reads: a CUDA graph can capture it. num_warps: 8 for
    entries of 512 channels (a (BLOCK_L, 256) tile per half and tensor), else 4 (a guess: not swept yet)."""
    S, C = kv_new.shape
    d = store.shape[-1]
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
        num_warps=num_warps or (8 if half_pad >= 256 else 4),
    )
