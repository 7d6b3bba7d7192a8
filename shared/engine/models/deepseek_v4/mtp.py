"""Multi-token prediction: V4's MTP layer as the draft model of speculative decoding.

The layer pairs the main model's streams at position j with the embedding of token j + 1 and predicts token
j + 2. Its (window-only) ring sits after the main layers' in each request's state, so a draft costs one block
and a head, and the pairs it built from drafts are provisional: the next `advance` overwrites them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.models.deepseek_v4.cache import V4Cache
from shared.engine.models.deepseek_v4.mhc import hc_post, hc_pre, rms
from shared.engine.models.deepseek_v4.moe import moe
from shared.engine.quant import linear

if TYPE_CHECKING:
    from shared.engine.models.deepseek_v4.model import DeepseekV4


def advance(model: DeepseekV4, kv: V4Cache, request_id: str, start: int, streams: torch.Tensor,
            next_tokens: list[int]) -> torch.Tensor | None:
    """Feed the MTP layer the pairs a main step made known: `streams` (n, hc, D) are the main model's at
    positions [start, start + n) (only those whose tokens were kept), `next_tokens` the tokens that followed
    them (n - 1, or n when the step's sampled token is included). Returns the MTP output streams (hc, D) of
    the last pair when that pair's token is the newest one (the first draft's input), else None."""
    state = kv.states[request_id]
    rows = streams
    first = start
    if state.mtp_length == start - 1 and state.pending is not None:  # h at start - 1 waited for token start
        rows = torch.cat([state.pending[None].to(streams.dtype), streams])
        first = start - 1
    elif state.mtp_length > start:  # already paired (the first draft pairs the newest token itself)
        skip = state.mtp_length - start
        rows, next_tokens, first = rows[skip:], next_tokens[skip:], state.mtp_length
    n = len(next_tokens)
    out = None
    if n:
        out = block(model, kv, request_id, rows[:n], torch.tensor(next_tokens, device=rows.device), first)
    state.mtp_length = first + n
    if n < rows.shape[0] and state.pending is not None:
        state.pending.copy_(rows[n])  # h at mtp_length, waiting for its next token
    return None if out is None or n == rows.shape[0] - 1 else out[-1]


def draft(model: DeepseekV4, kv: V4Cache, request_id: str, out: torch.Tensor, position: int, k: int,
          floor: float = 0.0) -> tuple[list[int], list[float]]:
    """Up to k greedy draft tokens from the MTP output streams `out` (hc, D) of the pair at `position - 1`, and
    each one's probability under the draft layer (its confidence); drafting stops before a draft below `floor`
    (verify_policy.confidence_cut), so a doubtful tail costs no further MTP block."""
    m = model.weights.mtp
    assert m is not None
    drafts: list[int] = []
    probs: list[float] = []
    for step in range(k):
        p, token = torch.softmax(model.head_logits(out[None], m.hc_head, m.norm)[0], -1).max(-1)
        p, token = float(p), int(token)  # one host read per draft (drafting is host-driven anyway)
        if p < floor:  # verify_policy.confidence_cut: the first doubtful draft ends drafting, kept only if first
            if not drafts:
                drafts.append(token)
                probs.append(p)
            break
        drafts.append(token)
        probs.append(p)
        if step + 1 < k:
            out = block(model, kv, request_id, out[None], torch.tensor([token], device=out.device),
                        position + step)[-1]
    return drafts, probs


def block(model: DeepseekV4, kv: V4Cache, request_id: str, h: torch.Tensor, tokens: torch.Tensor, first: int
          ) -> torch.Tensor:
    """The MTP layer over pairs (h_j, token j + 1) at positions first..first + n - 1 -> streams (n, hc, D)."""
    s, m = model.spec, model.weights.mtp
    assert m is not None
    state = kv.states[request_id]
    n = h.shape[0]
    positions = torch.arange(first, first + n, device=h.device)
    e = rms(model.weights.embed[tokens], m.enorm, s.rms_eps)
    streams = linear(e, m.e_proj).unsqueeze(1) + linear(rms(h, m.hnorm, s.rms_eps), m.h_proj)
    angles = {"main": model.attention.rope_main.angles(positions)}
    span = SeqSpan(0, n, first + n, torch.zeros(0, dtype=torch.long), request_id)
    meta = AttentionMetadata(positions, [span])
    i, layer = s.num_layers, m.layer  # its ring sits after the main layers'
    post, comb, x = hc_pre(s, streams, layer.hc_attn, model.triton)
    out = model.attention(i, layer, rms(x, layer.attn_norm, s.rms_eps), positions, angles, meta, [state], kv, None)
    streams = hc_post(out, post, comb, streams)
    post, comb, x = hc_pre(s, streams, layer.hc_ffn, model.triton)
    return hc_post(moe(s, layer, rms(x, layer.ffn_norm, s.rms_eps), tokens, model.triton), post, comb, streams)
