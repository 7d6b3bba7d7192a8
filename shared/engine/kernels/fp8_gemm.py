"""FP8 block-scaled GEMM: y = x @ W^T with W (N, K) float8_e4m3fn and one float32 scale per bn x bk block
(DeepSeek's 128 x 128), x (M, K) in the activation dtype. One kernel, two ways to use the scales:

  weight-only (act="none")   each (BLOCK_N, BLOCK_K) tile of W is converted to x's dtype in registers (e4m3 ->
                             bf16 is exact), multiplied by x's tile on the bf16 tensor cores, and the partial
                             product scaled by its block's factor before it joins the float32 accumulator:
                                 y[m, n] = sum_kb  s[n // bn, kb] * sum_{k in kb} x[m, k] q[n, k]
                             which is the dequantize-then-matmul sum, regrouped (BLOCK_K divides bk, so a tile
                             never straddles two scale columns). Decode's choice: bytes-bound, W read once.
  per-token FP8 (act="fp8")  x's tile is quantized too, one power-of-two-free float32 scale per (row, K tile)
                             (amax / 448, DeepSeek's act_quant with BLOCK_K = 128), and tl.dot runs on FP8 (Hopper
                             has FP8 tensor cores, twice bf16's FLOPs): for compute-bound prefill M. Not exact: x
                             is rounded to e4m3 (3 mantissa bits, ~6 % relative per element, ~1 % on a sum).

Small M (decode, M <= 64) has few output tiles (wq_a's N = 1024: 16 tiles of 64), so the K axis is split over
SPLIT programs whose float32 partials are summed by torch: enough programs to cover the SMs. Tiles by M:
`config`. Nothing is read back to the host (CUDA graphs capture it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from shared.engine.quant import Fp8Weight

FP8_MAX = 448.0  # e4m3's largest finite value
DECODE_ROWS = 64  # up to this many rows: weight-only, split-K (bytes-bound)


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs along K
    num_warps: int
    num_stages: int


def _programs_wanted(device: torch.device) -> int:
    # two waves of programs over the SMs keep every SM streaming weights at decode
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return 2 * sms


def config(M: int, N: int, K: int, block: tuple[int, int], device: torch.device, act: str = "none") -> Config:
    """act="fp8" always takes prefill's tiles: FP8 dots want 64-row tiles (Hopper's warp-group MMA)."""
    block_k = min(128, block[1])
    if M <= DECODE_ROWS and act == "none":
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64
        block_n = 64
        tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
        k_tiles = triton.cdiv(K, block_k)
        split = max(1, min(k_tiles, triton.cdiv(_programs_wanted(device), tiles), 16))
        return Config(block_m, block_n, block_k, split, 4, 4)
    if M <= 256:
        return Config(64, 128, block_k, 1, 4, 3)
    return Config(128, 128, block_k, 1, 8, 3)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 (the interpreter's tests): plain fp32 products, not tf32
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym, stride_s, k_per_split, group_n,
    SN: tl.constexpr, SK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACT_FP8: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = m < M, n < N
    kk = tl.arange(0, BLOCK_K)
    # grouped (wo_a): output columns [g group_n, (g + 1) group_n) read x's columns [g K, (g + 1) K)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm + (pid_n * BLOCK_N // group_n) * K
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    s_rows = s_ptr + (n // SN) * stride_s  # (BLOCK_N,) each row's scale row
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + kk
        kmask = k < k_end
        xt = tl.load(x_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        wt = tl.load(w_rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # (BLOCK_N, BLOCK_K) e4m3
        ws = tl.load(s_rows + k0 // SK, mask=nmask, other=0.0)  # (BLOCK_N,) float32
        if ACT_FP8:
            xf = xt.to(tl.float32)
            xs = tl.maximum(tl.max(tl.abs(xf), 1), 1e-12) / 448.0  # (BLOCK_M,) per-row scale of this K tile
            xq = (xf / xs[:, None]).to(tl.float8e4nv)
            part = tl.dot(xq, tl.trans(wt))
            acc += part * xs[:, None] * ws[None, :]
        else:
            part = tl.dot(xt, tl.trans(wt.to(xt.dtype)), input_precision=PRECISION)
            acc += part * ws[None, :]
    out = y_ptr + pid_k * M * N if SPLIT else y_ptr
    mask = mmask[:, None] & nmask[None, :]
    tl.store(out + m.to(tl.int64)[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_gemm(x: torch.Tensor, w: Fp8Weight, act: str = "none", cfg: Config | None = None, groups: int = 1
             ) -> torch.Tensor:
    """x (M, groups K) float, w (N, K) FP8 -> (M, N) in x's dtype. act: "none" (weight-only) or "fp8"
    (per-token). groups > 1 (V4's grouped output projection wo_a): output columns [g N / G, (g + 1) N / G) are
    group g's rows of w times x's columns [g K, (g + 1) K), in one launch."""
    M, KG = x.shape
    N, K = w.shape
    bn, bk = w.block
    assert w.data.dim() == 2 and KG == groups * K, f"x {tuple(x.shape)} does not fit weight {tuple(w.shape)}"
    assert act in ("none", "fp8") and N % groups == 0
    if M == 0:
        return x.new_empty(0, N)
    group_n = N // groups
    if cfg is None:
        cfg = config(M, N, K, w.block, x.device, act)
        if groups > 1:  # N tiles inside one group: at most the largest power of two dividing its rows
            cfg = cfg._replace(block_n=min(cfg.block_n, group_n & -group_n))
    assert bk % cfg.block_k == 0, "a K tile must sit inside one scale block"
    assert groups == 1 or group_n % cfg.block_n == 0, "an N tile must sit inside one group"
    x = x if x.stride(-1) == 1 else x.contiguous()
    k_tiles = triton.cdiv(K, cfg.block_k)
    k_per_split = triton.cdiv(k_tiles, cfg.split) * cfg.block_k
    split = triton.cdiv(K, k_per_split)
    if split > 1:
        y = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    scale = w.scale.contiguous()
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), split)
    _fp8_gemm_kernel[grid](
        x, w.data, scale, y, M, N, K, x.stride(0), N, scale.stride(0), k_per_split, group_n,
        SN=bn, SK=bk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ACT_FP8=act == "fp8", SPLIT=split > 1, PRECISION=_dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y.sum(0).to(x.dtype) if split > 1 else y


PREFILL_ACT = "none"  # prefill M: "none" or "fp8"; bench/v4_model.py --quantized times both on the H200


def fp8_linear(x: torch.Tensor, w: Fp8Weight, groups: int = 1) -> torch.Tensor:
    """x (..., groups K) -> (..., N): weight-only at decode M, PREFILL_ACT beyond (groups: fp8_gemm)."""
    rows = x.reshape(-1, x.shape[-1])
    act = "none" if rows.shape[0] <= DECODE_ROWS else PREFILL_ACT
    return fp8_gemm(rows, w, act, groups=groups).view(*x.shape[:-1], w.shape[0])
