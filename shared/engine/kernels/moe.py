"""Fused mixture of experts: every (row, expert) pair of a step in two grouped GEMM launches, any batch size,
with no host read-back (so CUDA graphs can capture it) and the expert weights read in their stacked layout.

The steps (vLLM's and SGLang's fused_moe have the same shape; this is our own, for DeepSeek-V4's experts):

  align (on the device)         the T k pairs p = t k + j (row t's j-th choice) sorted by expert; each
                                expert's group padded to BLOCK_M with the sentinel T k, so one block of
                                BLOCK_M slots belongs to one expert:

      sorted_pairs  [ e0 e0 e0 -  | e3 -  -  -  | e5 e5 e5 e5 | e5 -  -  -  | (unused to the bound) ]
      block_group   [ 0           | 3           | 5           | 5           | ...                   ]
      padded        16 (a tensor: the kernels skip blocks at or past it)

                                The grid is sized by the bound T k + min(E, T k)(BLOCK_M - 1), known from
                                the shapes alone: no sync, the same launch for every routing of T rows.
                                Up to SMALL_PAIRS pairs (decode) one program does it; beyond, ~12 torch ops.
  up    (one launch)            h[p] = silu(min(g, limit)) * clamp(u, -limit, limit) with g | u = x[p // k]
                                times the gate | up rows of w13[e] (E, 2 I, D): program (block, n) computes
                                the gate and the up tile of the same columns n, so the SwiGLU is its epilogue.
  down  (one launch)            y[p] = weight[p] * (h[p] @ w2[e]^T), w2 (E, D, I), y (T k, D) in x's dtype
  combine                       out[t] = sum_j y[t k + j], summed in float32 (deterministic, unlike atomic
                                adds; y in bf16 is the torch path's rounding and half the bytes: 0.9 GB at
                                a 16K-token chunk)

The shared expert rides along as group E: one more choice per row (weight 1, implied by the kernels: nothing
is concatenated), so it is read in the same launches and summed by the same combine. Why fused rather than
overlapped on a second stream: at decode it is 1/7 of the MoE's bytes (50 MB of 352 MB at batch 1), and
alone it would be 3 more launches (up GEMM, SwiGLU, down GEMM) plus an add, ~4 x 3-5 us of launch/tail gaps
against its 12 us of bytes; fused, it is one more 16-slot block in each launch, read at the same bandwidth.
A second stream buys nothing when both halves are bandwidth-bound on the same HBM, and complicates capture.

FP4 experts (DeepSeek's release: packed e2m1 pairs, an e8m0 scale per 32 columns; quant.Fp4Weight) go through the
same two kernels with W_FP4 set: each weight tile is loaded as bytes, its two nibbles decoded to the even and odd
columns and scaled in registers (Hopper has no FP4 tensor cores), and multiplied on the activation dtype's tensor
cores against x's even and odd columns. The decoded weights are exact in bfloat16, so the result is the
dequantize-then-multiply one up to summation order; the bytes read are a quarter of bfloat16's (plus 1/64 scales).

At decode (a few rows) each touched expert's matrices are read once by one block of 16 slots (tl.dot needs 16
rows; the padding costs FLOPs, which are free there, not bytes), spread over many programs along N. Rounding
follows the torch path: the GEMM results are rounded to the activation dtype before the SwiGLU / the weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shared.engine.quant import Fp4Weight


class Config(NamedTuple):
    block_m: int
    block_n_up: int  # columns of h per program (it reads 2 x this many rows of w13)
    block_n_down: int
    block_k: int
    num_warps: int
    num_stages: int


def config(pairs: int, groups: int) -> Config:
    """Tiles by the mean rows per expert (a host-known number: the shapes, not the routing)."""
    mean = pairs / groups
    if mean <= 16:  # decode: bytes-bound, one 16-slot block per touched expert, many programs over N
        return Config(16, 32, 64, 128, 4, 4)
    if mean <= 64:
        return Config(32, 64, 64, 64, 4, 3)
    # long prefill, compute-bound. Swept on the H200 at V4-Flash's width (33 groups, bf16): 128-row blocks are
    # 1.16-1.22x the 64-row ones (2K-token chunk 1.76 ms, 8K 6.46 ms: 447 TFLOP/s); wider down tiles pay only
    # once every expert holds a thousand rows or more
    if mean <= 1024:
        return Config(128, 64, 128, 64, 8, 3)
    return Config(128, 64, 256, 64, 8, 3)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32: plain fp32 products (Triton's default for fp32 dots is tf32, ~3e-4 relative error)
    return "ieee" if dtype == torch.float32 else "tf32"


def _bound(pairs: int, groups: int, block_m: int) -> int:
    """Slots of the padded sort, at most: each touched group (at most min(groups, pairs)) pads < block_m."""
    return -(-(pairs + min(groups, pairs) * (block_m - 1)) // block_m) * block_m


def align(chosen: torch.Tensor, groups: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chosen (T, k) int64 group ids -> sorted_pairs (P,) int32, block_group (P / block_m,) int32, padded (1,)
    int32, with P = the bound on the padded pair count. All on chosen's device, no host sync."""
    pairs = chosen.numel()
    dev = chosen.device
    flat = chosen.flatten()
    counts = torch.zeros(groups, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    ends = padded_counts.cumsum(0)  # (groups,) end slot of each group's padded run
    order = torch.argsort(flat, stable=True)  # pairs in group order
    g = flat[order]
    # slot of the i-th pair in group order: its group's first slot + its rank inside the group
    slot = (ends - padded_counts)[g] + torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[g]
    bound = _bound(pairs, groups, block_m)
    sorted_pairs = torch.full((bound,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    starts = torch.arange(0, bound, block_m, device=dev)
    block_group = torch.searchsorted(ends, starts, right=True).clamp_(max=groups - 1).to(torch.int32)
    return sorted_pairs, block_group, ends[-1:].to(torch.int32)


SMALL_PAIRS = 256  # up to this many pairs (decode: batch <= 36 at top 6 + shared) align runs as one program


@triton.jit(do_not_specialize=["pairs", "bound"])
def _align_small_kernel(
    chosen_ptr, sorted_ptr, group_ptr, padded_ptr, pairs, bound,
    K: tl.constexpr, SHARED: tl.constexpr, N_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr,
):
    """align() in one program, for a few pairs: everything from (P, P) comparisons of the pairs' groups, so the
    slots are the stable order align() gives (no atomics) and the decode step is one launch, not ~12."""
    K1: tl.constexpr = K + SHARED  # choices per row, the shared expert last
    i = tl.arange(0, P_PAD)
    valid = i < pairs
    t, j = i // K1, i % K1
    e = tl.load(chosen_ptr + t * K + j, mask=valid & (j < K), other=0).to(tl.int32)
    if SHARED:
        e = tl.where(j == K, N_EXPERTS, e)
    e = tl.where(valid, e, N_EXPERTS + 1)  # padding lanes: a group of their own, never written
    ei, ej = e[:, None], e[None, :]  # (P_PAD, 1), (1, P_PAD)
    same = ei == ej
    before = i[None, :] < i[:, None]
    rank = tl.sum((same & before).to(tl.int32), 1)  # (P_PAD,) rank of pair i inside its group
    count = tl.sum(same.to(tl.int32), 1)  # size of pair i's group
    runs = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # its padded run
    first = (rank == 0) & valid  # one representative pair per touched group
    run_j = tl.where(first, runs, 0)[None, :]
    start = tl.sum(tl.where(ej < ei, run_j, 0), 1)  # runs of the groups before pair i's
    total = tl.sum(tl.where(first, runs, 0), 0)
    for b0 in range(0, bound, P_PAD):  # every slot the sentinel first, then the pairs over it
        tl.store(sorted_ptr + b0 + i, pairs, mask=b0 + i < bound)
    tl.debug_barrier()
    slot = start + rank
    tl.store(sorted_ptr + slot, i, mask=valid)
    tl.store(group_ptr + slot // BLOCK_M, e, mask=valid)  # the pairs of one block all write its group
    tl.store(padded_ptr, total)


def align_pairs(chosen: torch.Tensor, experts: int, with_shared: bool, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align() of the routed choices (T, k) plus, with_shared, group `experts` as every row's last choice: one
    program for a few pairs (decode), the torch ops beyond. Block groups past `padded` are left undefined."""
    T, k = chosen.shape
    pairs, groups = T * (k + with_shared), experts + with_shared
    if pairs > SMALL_PAIRS:
        every = torch.cat([chosen, chosen.new_full((T, 1), experts)], dim=1) if with_shared else chosen
        return align(every, groups, block_m)
    bound = _bound(pairs, groups, block_m)
    sorted_pairs = torch.empty(bound, dtype=torch.int32, device=chosen.device)
    block_group = torch.empty(bound // block_m, dtype=torch.int32, device=chosen.device)
    padded = torch.empty(1, dtype=torch.int32, device=chosen.device)
    p_pad = max(16, triton.next_power_of_2(pairs))  # (p_pad, p_pad) comparisons: 64K at batch 32
    _align_small_kernel[(1,)](
        chosen.contiguous(), sorted_pairs, block_group, padded, pairs, bound, K=k, SHARED=with_shared,
        N_EXPERTS=experts, BLOCK_M=block_m, P_PAD=p_pad, num_warps=4 if p_pad <= 64 else 16,
    )
    return sorted_pairs, block_group, padded


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32: sign | 2-bit exponent | 1-bit mantissa, subnormal at exponent 0."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)  # 0 .5 | 1 1.5 | 2 3 | 4 6
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _fp4_tile(rows, scale_rows, j, mask, SB: tl.constexpr):
    """Byte columns j of packed FP4 rows -> the (even, odd) weight columns 2 j, 2 j + 1 in float32, scaled by
    their e8m0 factors (2 ** (byte - 127), built from its bits: exact, unlike an exp2). Both are exact in
    bfloat16 (a 2-bit mantissa times a power of two), so the products are the dequantized weight's."""
    packed = tl.load(rows + j[None, :], mask=mask, other=0).to(tl.int32)  # (BLOCK_N, BLOCK_K / 2)
    e8 = tl.load(scale_rows + (2 * j[None, :]) // SB, mask=mask, other=127).to(tl.int32)
    factor = (e8 << 23).to(tl.float32, bitcast=True)
    return _e2m1(packed & 15) * factor, _e2m1(packed >> 4) * factor


@triton.jit(do_not_specialize=["pairs"])
def _up_kernel(
    x_ptr, w_ptr, ws_ptr, sc_ptr, scs_ptr, h_ptr, sorted_ptr, group_ptr, padded_ptr, pairs, I, D, limit,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, N_EXPERTS: tl.constexpr, W_FP4: tl.constexpr, SB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """W_FP4: w13 is packed e2m1 (E, 2 I, D / 2) with e8m0 scales sc (E, 2 I, D / SB), dequantized per tile in
    registers; the x tile is split into its even and odd columns to meet the two nibbles of each byte."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
    pmask = pair < pairs
    row = pair // TOP_K
    e = tl.load(group_ptr + pid_m).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if W_FP4:
        DH = D // 2
        w = w_ptr + e * 2 * I * DH
        sc = sc_ptr + e * 2 * I * (D // SB)
        if SHARED:
            if e == N_EXPERTS:
                w = ws_ptr
                sc = scs_ptr
        gate_rows = w + n.to(tl.int64)[:, None] * DH
        up_rows = gate_rows + I * DH
        gate_sc = sc + n.to(tl.int64)[:, None] * (D // SB)
        up_sc = gate_sc + I * (D // SB)
        jj = tl.arange(0, BLOCK_K // 2)
        for k0 in range(0, D, BLOCK_K):
            j = k0 // 2 + jj
            jmask = j < DH
            xmask = pmask[:, None] & jmask[None, :]
            x_even = tl.load(x_ptr + row[:, None] * D + 2 * j[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(x_ptr + row[:, None] * D + 2 * j[None, :] + 1, mask=xmask, other=0.0)
            wmask = nmask[:, None] & jmask[None, :]
            g_even, g_odd = _fp4_tile(gate_rows, gate_sc, j, wmask, SB)
            u_even, u_odd = _fp4_tile(up_rows, up_sc, j, wmask, SB)
            acc_g += tl.dot(x_even, tl.trans(g_even.to(x_ptr.dtype.element_ty)), input_precision=PRECISION)
            acc_g += tl.dot(x_odd, tl.trans(g_odd.to(x_ptr.dtype.element_ty)), input_precision=PRECISION)
            acc_u += tl.dot(x_even, tl.trans(u_even.to(x_ptr.dtype.element_ty)), input_precision=PRECISION)
            acc_u += tl.dot(x_odd, tl.trans(u_odd.to(x_ptr.dtype.element_ty)), input_precision=PRECISION)
    else:
        w = w_ptr + e * 2 * I * D  # w13[e]: (2 I, D), gate rows then up rows
        if SHARED:
            if e == N_EXPERTS:
                w = ws_ptr
        kk = tl.arange(0, BLOCK_K)
        gate_rows = w + n.to(tl.int64)[:, None] * D
        up_rows = gate_rows + I * D
        for k0 in range(0, D, BLOCK_K):
            k = k0 + kk
            kmask = k < D
            xt = tl.load(x_ptr + row[:, None] * D + k[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
            wmask = nmask[:, None] & kmask[None, :]
            wg = tl.load(gate_rows + k[None, :], mask=wmask, other=0.0)  # (BLOCK_N, BLOCK_K)
            wu = tl.load(up_rows + k[None, :], mask=wmask, other=0.0)
            acc_g += tl.dot(xt, tl.trans(wg), input_precision=PRECISION)
            acc_u += tl.dot(xt, tl.trans(wu), input_precision=PRECISION)
    dt = h_ptr.dtype.element_ty
    g = tl.minimum(acc_g.to(dt).to(tl.float32), limit)
    u = tl.minimum(tl.maximum(acc_u.to(dt).to(tl.float32), -limit), limit)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + pair[:, None] * I + n[None, :], h.to(dt), mask=pmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["pairs"])
def _down_kernel(
    h_ptr, w_ptr, ws_ptr, sc_ptr, scs_ptr, y_ptr, weight_ptr, sorted_ptr, group_ptr, padded_ptr, pairs, D, I,
    K: tl.constexpr, SHARED: tl.constexpr, N_EXPERTS: tl.constexpr, W_FP4: tl.constexpr, SB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """W_FP4: w2 is packed e2m1 (E, D, I / 2) with e8m0 scales sc (E, D, I / SB), as _up_kernel."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pmask = pair < pairs
    e = tl.load(group_ptr + pid_m).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < D
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if W_FP4:
        IH = I // 2
        w = w_ptr + e * D * IH
        sc = sc_ptr + e * D * (I // SB)
        if SHARED:
            if e == N_EXPERTS:
                w = ws_ptr
                sc = scs_ptr
        w_rows = w + n.to(tl.int64)[:, None] * IH
        sc_rows = sc + n.to(tl.int64)[:, None] * (I // SB)
        jj = tl.arange(0, BLOCK_K // 2)
        for k0 in range(0, I, BLOCK_K):
            j = k0 // 2 + jj
            jmask = j < IH
            hmask = pmask[:, None] & jmask[None, :]
            h_even = tl.load(h_ptr + pair[:, None] * I + 2 * j[None, :], mask=hmask, other=0.0)
            h_odd = tl.load(h_ptr + pair[:, None] * I + 2 * j[None, :] + 1, mask=hmask, other=0.0)
            w_even, w_odd = _fp4_tile(w_rows, sc_rows, j, nmask[:, None] & jmask[None, :], SB)
            acc += tl.dot(h_even, tl.trans(w_even.to(h_ptr.dtype.element_ty)), input_precision=PRECISION)
            acc += tl.dot(h_odd, tl.trans(w_odd.to(h_ptr.dtype.element_ty)), input_precision=PRECISION)
    else:
        w = w_ptr + e * D * I  # w2[e]: (D, I)
        if SHARED:
            if e == N_EXPERTS:
                w = ws_ptr
        kk = tl.arange(0, BLOCK_K)
        w_rows = w + n.to(tl.int64)[:, None] * I
        for k0 in range(0, I, BLOCK_K):
            k = k0 + kk
            kmask = k < I
            ht = tl.load(h_ptr + pair[:, None] * I + k[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
            wt = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
            acc += tl.dot(ht, tl.trans(wt), input_precision=PRECISION)
    K1: tl.constexpr = K + SHARED
    t, j = pair // K1, pair % K1
    weight = tl.load(weight_ptr + t * K + j, mask=pmask & (j < K), other=1.0)  # float32; 1 for the shared expert
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(y_ptr + pair[:, None] * D + n[None, :], y.to(y_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


def fused_moe(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w13: Expert, w2: Expert,
    limit: float, shared: tuple[Expert, Expert] | None = None, cfg: Config | None = None,
) -> torch.Tensor:
    """x (T, D), chosen (T, k) int64 expert ids, weights (T, k) float32, w13 (E, 2 I, D), w2 (E, D, I) in x's dtype
    or FP4 (quant.Fp4Weight: packed e2m1 + e8m0 scales, dequantized in the kernels' registers), shared: the
    shared expert's (2 I, D) and (D, I) in the same format, or None -> sum_j weights[t, j]
    expert_{chosen[t, j]}(x[t]) (+ shared(x[t])), (T, D) in x's dtype."""
    T, D = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    fp4 = isinstance(w13, Fp4Weight)
    assert w13.shape[2] == D and w2.shape == (E, D, I) and isinstance(w2, Fp4Weight) == fp4
    assert fp4 or x.dtype == w13.dtype == w2.dtype
    with_shared = shared is not None
    if with_shared:
        assert shared[0].shape == (I2, D) and shared[1].shape == (D, I) and isinstance(shared[0], Fp4Weight) == fp4
    k = chosen.shape[1]
    k1 = k + with_shared  # the shared expert is group E, one more choice per row (weight 1)
    pairs, groups = T * k1, E + with_shared
    if T == 0:
        return torch.zeros_like(x)
    cfg = cfg or config(pairs, groups)
    sorted_pairs, block_group, padded = align_pairs(chosen, E, with_shared, cfg.block_m)
    blocks = block_group.numel()
    x = x.contiguous()
    s13, s2 = shared if shared is not None else (w13, w2)  # unread stand-ins when there is no shared expert
    sb = _scale_block(w13, w2, s13, s2) if fp4 else 1  # columns per FP4 scale
    (w13, c13), (w2, c2), (s13, cs13), (s2, cs2) = (_operands(t) for t in (w13, w2, s13, s2))
    if fp4:
        assert cfg.block_k >= 32 and cfg.block_k % sb == 0 and D % sb == 0 and I % sb == 0
    precision = _dot_precision(x.dtype)
    h = torch.empty(pairs, I, dtype=x.dtype, device=x.device)
    _up_kernel[(blocks, triton.cdiv(I, cfg.block_n_up))](
        x, w13, s13, c13, cs13, h, sorted_pairs, block_group, padded, pairs, I, D, float(limit),
        TOP_K=k1, SHARED=with_shared, N_EXPERTS=E, W_FP4=fp4, SB=sb,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    y = torch.empty(pairs, D, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, triton.cdiv(D, cfg.block_n_down))](
        h, w2, s2, c2, cs2, y, weights.contiguous().float(), sorted_pairs, block_group, padded, pairs, D, I,
        K=k, SHARED=with_shared, N_EXPERTS=E, W_FP4=fp4, SB=sb,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.view(T, k1, D).sum(1, dtype=torch.float32).to(x.dtype)


Expert = torch.Tensor | Fp4Weight  # stacked expert weights as the kernels read them


def _operands(w: Expert) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scales) pointers for a kernel: a dense weight's scales are an unread stand-in (itself)."""
    return (w.data.contiguous(), w.scale.contiguous()) if isinstance(w, Fp4Weight) else (w.contiguous(), w)


def _scale_block(*ws: Fp4Weight) -> int:
    blocks = {w.block for w in ws}
    assert len(blocks) == 1, f"FP4 experts of mixed scale blocks {blocks}"
    return blocks.pop()
