"""DeepSeek-V4 attention for a decode step: every sequence has one query row, all of them at once.

The per-sequence path (attention.py's attend_one) stays the reference and serves prefill and verify chunks;
this one indexes the cache's pools (cache.py) with the step's slot ids, so a layer costs a fixed number of
launches whatever the batch size, and reads nothing back to the host (masks and `where`, no data-dependent
shapes: a CUDA graph can capture it):

    1. rings: kv into swa[slot, p % cap]; the compressor's (and CSA's indexer's) projections into their rings
    2. rows whose window closes ((p + 1) % m == 0) build its entry (softmax(gate + ape) over m, CSA over 2m with
       the Ca / Cb overlap) -> RMSNorm -> RoPE at w m -> the paged store. Steps 1-2 of a compressor are one
       Triton launch on the Triton path (kernels/v4_compress.py: open rows write nothing); the torch path
       (the reference) writes back what is there for the open rows
    3. CSA: the indexer's scores over each row's visible index keys (padded to the batch's most, -inf past a
       row's own; on the Triton path one launch reading the keys through the block table, kernels/v4_index.py),
       top-k -> (S, k) entry ids, -1 = none
    4. attention over the window ring + the compressed entries (HCA: all visible; CSA: the chosen ids), sinks
       in the softmax: one Triton launch (kernels/v4_decode.py) or the batched torch equivalent below; FP8
       stores (--kv-cache-dtype fp8) are read packed by the kernel, dequantized by the torch path's gathers
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from shared.engine.attention import AttentionMetadata
from shared.engine.fusion import fused
from shared.engine.kv_quant import Fp8Rows
from shared.engine.models.deepseek_v4.cache import RequestState, V4Cache
from shared.engine.models.deepseek_v4.mhc import rms
from shared.engine.models.deepseek_v4.rope import rotate
from shared.engine.models.deepseek_v4.weights import Compressor, Layer

if TYPE_CHECKING:
    from shared.engine.models.deepseek_v4.attention import Attention


@dataclass(frozen=True)
class DecodeBatch:
    """The step's sequences as device tensors (built once per forward, shared by every layer)."""

    slots: torch.Tensor  # (S,) int64 row of the pools
    positions: torch.Tensor  # (S,) int64 the query's position p
    begins: torch.Tensor  # (S,) int64 rings valid from here (bounded replay)
    frozen: torch.Tensor  # (S,) int64 entries of windows ending at or before this are restored: never rebuilt
    table: torch.Tensor  # (S, NB) int64 block tables, padded with 0 past a row's own
    max_context: int  # host-known bound of p + 1 over the batch (sizes gathers and grids)


def is_decode(meta: AttentionMetadata, rows: int) -> bool:
    return bool(meta.spans) and len(meta.spans) == rows and all(span.q_len == 1 for span in meta.spans)


def batch_of(meta: AttentionMetadata, states: list[RequestState], positions: torch.Tensor) -> DecodeBatch:
    device = positions.device
    table = pad_sequence([span.block_table.long() for span in meta.spans], batch_first=True)
    pinned = device.type == "cuda"  # an asynchronous copy: no wait on the stream
    host = torch.tensor([[st.slot, st.begin, st.frozen] for st in states], dtype=torch.long, pin_memory=pinned)
    host = host.to(device, non_blocking=pinned)
    slots, begins, frozen = (col.contiguous() for col in host.unbind(1))  # kernels index them flat
    max_context = max(span.context_len for span in meta.spans)
    return DecodeBatch(slots, positions.long(), begins, frozen, table.to(device), max_context)


def write_ring(pool: torch.Tensor, b: DecodeBatch, new: torch.Tensor) -> None:
    pool[b.slots, b.positions % pool.shape[1]] = new.to(pool.dtype)


def entry_slots(b: DecodeBatch, e: torch.Tensor, ratio: int, block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry ids e (S, n) -> (block, slot in block) of each row's paged store."""
    tok = e * ratio
    return b.table.gather(1, tok // block_tokens), (tok % block_tokens) // ratio


def compress(att: Attention, c: Compressor, rings: tuple[torch.Tensor, torch.Tensor],
             new: tuple[torch.Tensor, torch.Tensor], b: DecodeBatch, store: torch.Tensor | Fp8Rows, kv: V4Cache,
             d: int, kernels: bool = False) -> None:
    """Write the rows' projections into the ring pools; rows closing a window write its entry to the store.
    kernels: one Triton launch (kernels/v4_compress.py; FP8 stores packed in it); the torch path below is its
    reference."""
    m = c.ratio
    kv_ring, gate_ring = rings
    if kernels:
        from shared.engine.kernels.v4_compress import compress_update

        compress_update(new[0], new[1], kv_ring, gate_ring, c.ape, c.norm, att.rope_compress.inv_freq, b.slots,
                        b.positions, b.begins, b.frozen, b.table, store, m, c.overlap, att.spec.rms_eps,
                        kv.block_tokens)
        return
    S = b.slots.shape[0]
    write_ring(kv_ring, b, new[0])
    write_ring(gate_ring, b, new[1])
    entry = window_entry(kv_ring, gate_ring, c.ape, c.norm, att.rope_compress.inv_freq, b.slots, b.positions,
                         b.begins, m, c.overlap, d, att.spec.rms_eps)
    w = b.positions // m
    close = ((b.positions + 1) % m == 0) & (w >= b.frozen // m)
    blk, j = entry_slots(b, w[:, None], m, kv.block_tokens)
    blk, j = blk[:, 0], j[:, 0]
    # a row whose window stays open writes back what its (private, current) block holds: nothing changes
    store[blk, j] = torch.where(close.view(S, 1), entry.to(store.dtype), store[blk, j])


@fused
def window_entry(kv_ring: torch.Tensor, gate_ring: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor,
                 inv_freq: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, begins: torch.Tensor, m: int,
                 overlap: bool, d: int, eps: float) -> torch.Tensor:
    """Each row's current window as one entry (S, d), whether it closes now or not (the caller keeps the ones
    that close): softmax(gate + ape) over the window's slots (CSA: 2m, the previous window's first d channels
    and this one's last d), weighted sum of kv, RMSNorm, RoPE at the window's first position. Pure tensors:
    one fused kernel on CUDA (fusion.py)."""
    back = 1 if overlap else 0
    w = positions // m
    tok = (w - back)[:, None] * m + torch.arange((1 + back) * m, device=w.device)  # (S, L) raw tokens read
    valid = (tok >= begins[:, None]) & (tok >= 0)
    at = (slots[:, None], tok % kv_ring.shape[1])
    raw_kv = kv_ring[at].masked_fill(~valid[..., None], 0)  # (S, L, C)
    gate = (gate_ring[at].float() + ape.repeat(1 + back, 1)).masked_fill(~valid[..., None], float("-inf"))
    if overlap:  # Ca of window w - 1 (first d channels), Cb of window w (last d)
        raw_kv = torch.cat([raw_kv[:, :m, :d], raw_kv[:, m:, d:]], dim=1)
        gate = torch.cat([gate[:, :m, :d], gate[:, m:, d:]], dim=1)
    # over the window's slots, as the last dim: a softmax over dim 1 of (S, L, C) runs CUDA's spatial kernel,
    # ~28 us a layer at batch 1 (6 % of the step) when this runs eagerly
    weights = torch.softmax(gate.transpose(1, 2), dim=-1).transpose(1, 2).to(raw_kv.dtype)
    entry = rms((raw_kv * weights).sum(1), norm, eps)  # (S, d)
    freqs = (w * m).to(torch.float32)[:, None] * inv_freq
    return rotate(entry, freqs.cos(), freqs.sin())


def select(att: Attention, i: int, layer: Layer, b: DecodeBatch, kv: V4Cache, iq: torch.Tensor,
           weights: torch.Tensor, kernels: bool = False) -> torch.Tensor:
    """CSA's lightning indexer over each row's visible index keys -> (S, k) chosen entry ids, -1 = none.
    kernels: the scores in one Triton launch reading the keys through the block table (kernels/v4_index.py),
    no (S, E, index_head_dim) gather; the torch path below is its reference. Top-k in torch either way."""
    s = att.spec
    m = layer.compressor.ratio if layer.compressor is not None else 0
    S, E = b.slots.shape[0], b.max_context // m
    keys_store = kv.index_keys[i]
    assert keys_store is not None
    if E == 0:
        return torch.full((S, 0), -1, dtype=torch.long, device=iq.device)
    key_scale, head_scale = s.index_head_dim**-0.5, s.index_heads**-0.5
    if kernels:
        from shared.engine.kernels.v4_index import index_scores as index_scores_kernel

        scores = index_scores_kernel(keys_store, b.table, iq, weights, b.positions, m, kv.block_tokens, E,
                                     key_scale, head_scale)
    else:
        e = torch.arange(E, device=iq.device).expand(S, E)
        blk, j = entry_slots(b, e, m, kv.block_tokens)
        scores = index_scores(keys_store, blk, j, iq, weights, e, b.positions, m, key_scale, head_scale)
    top = scores.topk(min(s.index_topk, E), dim=-1, sorted=False)  # any order: the attention masks -1 anywhere
    return torch.where(top.values == float("-inf"), -1, top.indices)


@fused
def index_scores(keys_store: torch.Tensor, blk: torch.Tensor, j: torch.Tensor, iq: torch.Tensor,
                 weights: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, m: int, key_scale: float,
                 head_scale: float) -> torch.Tensor:
    """The indexer's score of every entry e (S, E) for each row: sum over heads of weight * ReLU(q . key),
    -inf past the row's visible entries. Pure tensors: fused on CUDA (fusion.py)."""
    keys = keys_store[blk, j]  # (S, E, index_head_dim)
    scores = torch.relu(torch.einsum("shc,sec->she", iq.float(), keys.float())) * key_scale
    scores = (scores * (weights.float() * head_scale).unsqueeze(-1)).sum(1)  # (S, E)
    return scores.masked_fill(e >= ((positions + 1) // m)[:, None], float("-inf"))


def attend_torch(att: Attention, i: int, layer: Layer, q: torch.Tensor, b: DecodeBatch, kv: V4Cache,
                 ids: torch.Tensor | None) -> torch.Tensor:
    """Step 4 in torch (the kernel's reference): (S, H, d), still rotated."""
    W = att.spec.window
    ring = kv.swa_pool[i]
    wpos = b.positions[:, None] - W + 1 + torch.arange(W, device=q.device)  # (S, W)
    valid = (wpos >= b.begins[:, None]) & (wpos >= 0)
    keys = ring[b.slots[:, None], wpos.clamp(min=0) % ring.shape[1]]  # (S, W, d)
    if layer.compressor is not None:
        m = layer.compressor.ratio
        store = kv.entries[i]
        assert store is not None
        if ids is None:  # HCA: every visible entry
            e = torch.arange(b.max_context // m, device=q.device).expand(b.slots.shape[0], -1)
            ok = e < ((b.positions + 1) // m)[:, None]
        else:
            e, ok = ids.clamp(min=0), ids >= 0
        blk, j = entry_slots(b, e, m, kv.block_tokens)
        keys = torch.cat([keys, store[blk, j].to(keys.dtype)], dim=1)
        valid = torch.cat([valid, ok], dim=1)
    logits = torch.einsum("shd,skd->shk", q.float(), keys.float()) * att.scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = layer.sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("shk,skd->shd", probs, keys.float()).to(q.dtype)


def attend(att: Attention, i: int, layer: Layer, b: DecodeBatch, kv: V4Cache, q: torch.Tensor, k: torch.Tensor,
           comp: tuple[torch.Tensor, torch.Tensor] | None, idx: tuple[torch.Tensor, ...] | None, triton: bool
           ) -> torch.Tensor:
    """Steps 1-4 for one layer: q (S, H, d), k (S, d), the compressor / indexer projections of the rows."""
    s = att.spec
    write_ring(kv.swa_pool[i], b, k)
    ids = None
    if comp is not None:
        c, rings, store = layer.compressor, kv.comp_pool[i], kv.entries[i]
        assert c is not None and rings is not None and store is not None
        compress(att, c, rings, comp, b, store, kv, s.head_dim, triton)
    if idx is not None:
        ix, rings, store = layer.indexer, kv.index_pool[i], kv.index_keys[i]
        assert ix is not None and rings is not None and store is not None
        kv_i, gate_i, iq, weights = idx
        compress(att, ix.compressor, rings, (kv_i, gate_i), b, store, kv, s.index_head_dim, triton)
        ids = select(att, i, layer, b, kv, iq, weights, triton)
    if not triton:
        return attend_torch(att, i, layer, q, b, kv, ids)
    from shared.engine.kernels.v4_decode import decode_attention

    ratio = layer.compressor.ratio if layer.compressor is not None else 0
    return decode_attention(q, kv.swa_pool[i], kv.entries[i] if ratio else None, b.table, b.slots, b.positions,
                            b.begins, ids, layer.sinks, att.scale, s.window, ratio, kv.block_tokens,
                            b.max_context // ratio if ratio else 0)

