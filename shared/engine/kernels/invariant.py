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
    attention    paged, causal, for prefill chunks and decode steps alike: program (tile, s, kv_head) holds
                 ATT_ROWS rows, each a (query, head) pair of the G query heads sharing that KV head, so K/V are
                 read once per KV head (a decode step's tile is its one query's G heads). Every row reduces
                 over keys 0, ATT_KEYS, 2 ATT_KEYS, ... with no KV split, and keys it may not see (past its
                 position, past the context) add exact zeros: a position gets the same bits in a prefill chunk,
                 in a decode step and in a migrated continuation's prefill, whatever tile it lands in.

RMSNorm (fused.add_rms_norm), RoPE, SwiGLU and the embedding are per row already (one program per row, fixed
block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The one tile every GEMM runs with: 64 x 64 output tiles, K in steps of 64 (tl.dot needs >= 16 each way)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
# The attention tile for every step: 16 (query, head) rows, 64 keys a step
ATT_ROWS, ATT_KEYS = 16, 64
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


# decode is a runtime flag, not a constexpr (nor specialised on its value): decode steps and prefill chunks
# run the one compiled kernel, so nothing but the loads of q_start / q_len can differ between them
@triton.jit(do_not_specialize=["decode"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, qs_ptr, ql_ptr, ctx_ptr, scale, decode,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, QPT: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    kvh = tl.program_id(2)
    ctx = tl.load(ctx_ptr + s)
    # decode: row s is sequence s's one query (q_starts / q_lens may be placeholders: not read); context 0 is a
    # CUDA graph's padding row, nothing to do
    chunked = decode == 0
    q_start = tl.where(chunked, tl.load(qs_ptr + s, mask=chunked, other=0), s)
    q_len = tl.where(chunked, tl.load(ql_ptr + s, mask=chunked, other=0), tl.where(ctx > 0, 1, 0))
    if tile * QPT < q_len:
        r = tl.arange(0, ROWS)
        qi = tile * QPT + r // G  # (ROWS,) the row's query within the sequence's chunk
        head = kvh * G + r % G  # (ROWS,) its query head
        rmask = (r < QPT * G) & (qi < q_len)
        qpos = ctx - q_len + qi  # its position: it sees keys [0, qpos]
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (q_start + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None], other=0.0)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        end = tl.minimum(ctx, ctx - q_len + (tile + 1) * QPT)  # keys past the tile's last query: unseen
        for n0 in range(0, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            page = tl.load(bt_ptr + s * stride_bt + pos // BT, mask=pmask, other=0).to(tl.int64)
            off = page * stride_kb + (pos % BT) * stride_ks + kvh * stride_kh
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)  # (BLOCK_N, D)
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (ROWS, BLOCK_N)
            visible = (pos[None, :] <= qpos[:, None]) & pmask[None, :] & rmask[:, None]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            # exactly 1 while the max stands: a block the row cannot see leaves its sums unchanged to the bit
            alpha = tl.where(m_new == m, 1.0, tl.exp(m - m_safe))
            p = tl.exp(scores - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / tl.maximum(l, 1e-30)[:, None]
        tl.store(o_ptr + (q_start + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    q_starts: torch.Tensor, q_lens: torch.Tensor, context_lens: torch.Tensor, max_q_len: int, scale: float,
    decode: bool,
) -> torch.Tensor:
    """q (T, H, D); caches (num_blocks, B, KV, D); sequence s owns rows [q_starts[s], q_starts[s] + q_lens[s])
    at positions [context_lens[s] - q_lens[s], context_lens[s]). decode: row s is sequence s's one query and
    q_starts / q_lens are not read (context 0: a padding row). Returns (T, H, D); rows no sequence owns are 0.

    decode only changes where q_start and q_len come from, never the reduction (the tests hold decode steps to
    prefill chunks bitwise)."""
    T, H, D = q.shape
    _, BT, KV, _ = k_cache.shape
    G = H // KV
    assert G <= ATT_ROWS, f"{G} query heads per KV head: the tile holds {ATT_ROWS}"
    qpt = ATT_ROWS // G  # queries per tile
    S = context_lens.shape[0]
    out = torch.zeros((T, H, D), dtype=q.dtype, device=q.device)
    if T:
        _attention_kernel[(triton.cdiv(max_q_len, qpt), S, KV)](
            q, k_cache, v_cache, out, block_tables, q_starts, q_lens, context_lens, scale, int(decode),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            G=G, QPT=qpt, D=D, BT=BT, ROWS=ATT_ROWS, BLOCK_N=ATT_KEYS, PRECISION=_precision(q.dtype),
        )
    return out
