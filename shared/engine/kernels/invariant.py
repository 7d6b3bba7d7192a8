"""Batch-invariant kernels for the deterministic mode (--deterministic): a row's bits depend on that row alone.

cuBLAS picks its algorithm, tile and split-K by the GEMM's M, so a request's logits change with the number of
rows it shares a step with (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025; vLLM's
batch-invariant mode and SGLang's --enable-deterministic-inference swap in Triton kernels for the same reason).
Here each kernel is compiled once per weight shape and run with the same tiles for every M:

    matmul       x (M, K) @ W^T (N, K) -> (M, N). Program (m, n) owns a BLOCK_M x BLOCK_N tile and reduces
                 K in BLOCK_K steps, 0, BLOCK_K, 2 BLOCK_K, ..., into one float32 accumulator: no split-K, no
                 autotuning, M not specialised (a 1-row and a 512-row GEMM run the same machine code), so row
                 i's dot products see the same operands in the same order whatever rows surround it.
    log_softmax  one program per row over the vocabulary in fixed chunks: max, then the sum of exp, then the
                 values (logprobs and the sampler's softmax read the same numbers for a row in any batch).

Attention needs no kernel of its own: attention.py's paged prefill kernel, run with DET_BLOCK_M x DET_BLOCK_N
tiles for decode steps too, reduces every query row over keys 0, BLOCK_N, 2 BLOCK_N, ... with no KV split,
and keys it may not see (past its position, past the context) add exact zeros. So a position gets the same bits
in a prefill chunk, in a decode step and in a migrated continuation's prefill. RMSNorm (fused.add_rms_norm),
RoPE, SwiGLU and the embedding are per row already (one program per row, fixed block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The one tile every GEMM runs with: 64 x 64 output tiles, K in steps of 64 (tl.dot needs >= 16 each way)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
# The attention tile for every step: 16 query rows (a decode step's one row is padded to 16), 64 keys a step
DET_BLOCK_M, DET_BLOCK_N = 16, 64
LSM_BLOCK = 1024  # log_softmax: vocabulary entries per chunk


def _precision(dtype: torch.dtype) -> str:
    # fp32 (CPU tests, fp32 GPU runs): plain fp32 products; tf32 would be the default for fp32 dots
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) rows of x
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) rows of W = output columns
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one fixed order over K, whatever M
        k = k0 + rk
        kmask = k < K
        a = tl.load(a_rows + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # (BM, BK)
        b = tl.load(b_rows + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)  # (BK, BN)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T -> (..., N) in out_dtype (default x's), accumulated in float32 and rounded
    once. Row i of the result is the same bits for any number of other rows."""
    K = x.shape[-1]
    N = weight.shape[0]
    assert weight.shape[1] == K, f"x has {K} columns, the weight {weight.shape[1]}"
    a = x.reshape(-1, K)
    if a.stride(-1) != 1:
        a = a.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    M = a.shape[0]
    out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M:
        _matmul_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))](
            a, weight, out, M, N, K, a.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=_precision(x.dtype),
            num_warps=4, num_stages=3,
        )
    return out.view(*x.shape[:-1], N)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * stride_x
    c = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane maxima: the chunks in order, then one tree
    for v0 in range(0, V, BLOCK):
        x = tl.load(row + v0 + c, mask=v0 + c < V, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, x)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # a row masked everywhere stays -inf, not NaN
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(row + v0 + c, mask=v0 + c < V, other=float("-inf")).to(tl.float32)
        s += tl.exp(x - mx)
    lse = mx + tl.log(tl.sum(s, 0))
    for v0 in range(0, V, BLOCK):
        mask = v0 + c < V
        x = tl.load(row + v0 + c, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + r * stride_o + v0 + c, x - lse, mask=mask)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x (N, V) -> (N, V) float32 log-softmax over the last dim, one program per row in a fixed order."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    N, V = x.shape
    out = torch.empty((N, V), dtype=torch.float32, device=x.device)
    if N:
        _log_softmax_kernel[(N,)](x, out, V, x.stride(0), out.stride(0), BLOCK=min(LSM_BLOCK, triton.next_power_of_2(V)))
    return out


def softmax(x: torch.Tensor) -> torch.Tensor:
    """exp of log_softmax: the probabilities, per row in a fixed order (float32)."""
    return log_softmax(x).exp()
