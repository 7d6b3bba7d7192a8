"""DeepSeek-V4 prefill (a sequence's chunk of q_len > 1 rows) through the Triton kernels of kernels/v4_prefill.py.

The same contract as Attention.attend_one (its torch reference), without its O(chunk^2) tensors: attend_one
builds (heads x queries x keys) float32 logits and CSA's (queries x entries) scores and bool mask; at an 8K chunk
of V4-Flash that is 16 GiB. Here memory stays linear in the chunk:

    window keys   the ring's last W - 1 positions before the chunk, then the chunk's own keys: (n + W - 1, d)
    entries       the compressor's (E, d) read-back (E = (start + n) // m), as attend_one has it
    CSA ids       (n, index_topk) int32 from the indexer, scored and top-k'd per block of INDEX_ROWS queries
                  (a block's scores are INDEX_ROWS x E float32, never n x heads x E)

The compressor and ring updates are attend_one's own (torch, O(n)); what changes is only how the queries attend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.engine.attention import SeqSpan
from shared.engine.kernels.v4_prefill import index_scores, prefill_attention
from shared.engine.models.deepseek_v4.cache import RequestState, V4Cache
from shared.engine.models.deepseek_v4.weights import Layer

if TYPE_CHECKING:
    from shared.engine.models.deepseek_v4.attention import Attention

INDEX_SCORE_BYTES = 64 << 20  # one block of the indexer's float32 scores (rows x entries)


def supported(att: Attention) -> bool:
    """The kernels tile head_dim and index_head_dim as whole powers of two."""
    s = att.spec
    return s.head_dim & (s.head_dim - 1) == 0 and s.index_head_dim & (s.index_head_dim - 1) == 0


def attend(att: Attention, i: int, layer: Layer, span: SeqSpan, state: RequestState, kv: V4Cache,
           pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           comp: tuple[torch.Tensor, torch.Tensor] | None, idx: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """One sequence's chunk of n queries at positions start..start+n-1 -> (n, H, d), as attend_one."""
    s = att.spec
    n, start, W = q.shape[0], span.context_len - span.q_len, s.window
    first = max(state.begin, start - W + 1)
    ring = state.swa[i]
    cap = ring.shape[0]
    old = torch.arange(first, start, device=q.device)
    win = torch.cat([ring[old % cap].to(k.dtype), k]).contiguous()  # positions first..start+n-1
    ring[pos[-cap:] % cap] = k[-cap:].to(ring.dtype)
    entries = ids = None
    ratio = 0
    if comp is not None:
        c = layer.compressor
        assert c is not None
        ratio = c.ratio
        entries = att.compress(c, state.comp[i], comp, start, state, kv.entries[i], span, kv, s.head_dim).to(q.dtype)
        if idx is not None:
            ids = select(att, layer, i, state, idx, start, span, kv)
    return prefill_attention(q, win, layer.sinks, start, first, W, att.scale, entries, ratio, ids)


def select(att: Attention, layer: Layer, i: int, state: RequestState, idx: tuple[torch.Tensor, ...], start: int,
           span: SeqSpan, kv: V4Cache) -> torch.Tensor:
    """CSA's lightning indexer for a chunk: (n, min(index_topk, E)) int32 entry ids per query, -1 = none (fewer
    than index_topk entries visible yet)."""
    s = att.spec
    ix = layer.indexer
    assert ix is not None
    keys = att.index_keys(layer, i, state, idx, start, span, kv)  # (E, index_head_dim)
    return top_entries(idx[2], idx[3], keys, start, ix.compressor.ratio, s.index_topk, s.index_head_dim**-0.5
                       * s.index_heads**-0.5)


def top_entries(iq: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: int, ratio: int, topk: int,
                scale: float, block_bytes: int = INDEX_SCORE_BYTES) -> torch.Tensor:
    """iq (n, heads, dim), weights (n, heads), keys (E, dim) -> (n, min(topk, E)) int32 ids of each query's
    top-scoring visible entries (-1 where fewer are visible), scored and selected per block of queries."""
    n, E = iq.shape[0], keys.shape[0]
    K = min(topk, E)
    ids = torch.full((n, K), -1, dtype=torch.int32, device=iq.device)
    if K == 0:
        return ids
    rows = max(32, block_bytes // (4 * E))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        scores = index_scores(iq[a:b], weights[a:b], keys, start + a, ratio, scale)  # (b - a, E)
        val, top = scores.topk(K, dim=-1, sorted=False)
        ids[a:b] = torch.where(val > float("-inf"), top, -1).to(torch.int32)
    return ids
