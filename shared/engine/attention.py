"""Attention over the paged KV cache, one backend per device kind (torch reference now, Triton later).

The batch is flattened: T query rows from several sequences, back to back. Sequence s owns query rows
[q_start, q_start + q_len), which are positions [context_len - q_len, context_len) of that sequence, and sees
keys at positions [0, context_len) through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SeqSpan:
    q_start: int
    q_len: int
    context_len: int  # computed tokens + this chunk
    block_table: torch.Tensor  # (ceil(context_len / block_tokens),) int64, on the cache's device
    request_id: str = ""  # whose per-request (short-term) state the chunk continues


@dataclass(frozen=True)
class BatchTensors:
    """The same spans as device tensors, for kernels that take the whole batch in one launch (GPU path)."""

    block_tables: torch.Tensor  # (S, W) int32: row s = sequence s's pages, W >= its page count
    context_lens: torch.Tensor  # (S,) int32; 0 = a padding row (CUDA graphs pad the batch)
    q_starts: torch.Tensor  # (S,) int32
    q_lens: torch.Tensor  # (S,) int32
    max_q_len: int
    max_context: int  # bounds every context_lens entry (sizes the decode kernel's grid)
    decode: bool  # every sequence has exactly one query row, row s
    fresh: bool  # every sequence computes its whole context (no cached prefix): flash SDPA applies


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64 (int32 on the GPU path): flat slot (block * block_tokens + offset)
    spans: list[SeqSpan]
    batch: BatchTensors | None = None


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q (T, H, D); k_cache, v_cache (num_blocks, block_tokens, KV, D) already holding this step's keys.

    Returns (T, H, D). Loops over sequences: on CPU the per-sequence SDPA is the cost anyway, and the loop
    keeps each sequence's causal offset explicit.
    """
    T, H, D = q.shape
    KV = k_cache.shape[2]
    G = H // KV  # query heads per KV head; head h reads KV head h // G
    out = torch.empty_like(q)
    for s in meta.spans:
        n, ctx = s.q_len, s.context_len
        # indexing, not index_select: an FP8 cache (kv_quant.Fp8Rows) dequantizes the blocks it gathers
        k = k_cache[s.block_table].flatten(0, 1)[:ctx].transpose(0, 1)  # (KV, ctx, D)
        v = v_cache[s.block_table].flatten(0, 1)[:ctx].transpose(0, 1)  # (KV, ctx, D)
        # Fold the G query heads of each KV head into the row dimension, so K/V are never repeated:
        # (n, H, D) -> (KV, G * n, D); row g * n + i is query head kv * G + g at position ctx - n + i.
        qs = q[s.q_start : s.q_start + n].view(n, KV, G, D).permute(1, 2, 0, 3).reshape(KV, G * n, D)
        mask = None
        if n > 1:
            # query i sits at position ctx - n + i and sees keys [0, ctx - n + i]
            rows = torch.arange(ctx - n, ctx, device=q.device)[:, None]  # (n, 1)
            mask = (torch.arange(ctx, device=q.device)[None, :] <= rows).repeat(G, 1)  # (G * n, ctx)
        o = F.scaled_dot_product_attention(qs, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
        out[s.q_start : s.q_start + n] = o.view(KV, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out
