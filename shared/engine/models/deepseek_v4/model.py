"""DeepSeek-V4 forward: chunked prefill and batched decode over the two-tier cache (cache.py).

One layer, for the T rows of a step (several sequences' chunks back to back):

    streams (T, hc, D) --mHC pre--> x --norm--> attention --mHC post + Sinkhorn mix--> streams
                       --mHC pre--> x --norm--> MoE        --mHC post + Sinkhorn mix--> streams

Attention (one shared K = V head of head_dim, num_heads query heads, a learned sink per head):
    q  = rope(rms(wq_b(rms(wq_a x))))                  per head, unweighted norm, RoPE on the trailing channels
    kv = rope(rms(wkv x))                              this token's key = value, written to the sliding ring
    keys seen by the query at p: kv of (p - window, p]  +  compressed entries of closed windows (HCA: all;
    CSA: the indexer's top-k), output un-rotated at p, then the grouped low-rank projection wo_a (per group) -> wo_b.

Compressor (ratio m): window w = tokens [w m, (w + 1) m) closes at its last token and becomes one entry:
    HCA: sum over the window of softmax(gate + ape) * kv, per channel; CSA: the same over 2m slots, the previous
    window's first half-channels (Ca) and this window's second half (Cb); then RMSNorm and RoPE at position w m.

Linear layers run over all T rows at once; the sliding ring, compressors and attention run per sequence (a
correct torch path: the place for fused kernels later). Everything numerically sensitive (norms, softmax,
Sinkhorn, routing) runs in float32, whatever the weight dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.config import ModelConfig
from shared.engine.kernels import HAVE_TRITON
from shared.engine.kv_cache import CacheSpec
from shared.engine.models.deepseek_v4.cache import RequestState, V4Cache
from shared.engine.models.deepseek_v4.rope import Rotary, rotate
from shared.engine.models.deepseek_v4.spec import CSA, SLIDING, DeepseekV4Spec
from shared.engine.ops import Ops

if HAVE_TRITON:
    from shared.engine.kernels.mhc import hc_weights


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32 over the last dim, back to x's dtype; weight None = unweighted."""
    h = x.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (h if weight is None else h * weight).to(x.dtype)


GATHER_MAX_PAIRS = 32  # (row, expert) pairs up to which the experts' weights are gathered (decode, batch <= 5)


@dataclass(frozen=True)
class Compressor:
    wkv: torch.Tensor  # (C, D): C = 2 d for CSA (Ca | Cb), d for HCA
    wgate: torch.Tensor  # (C, D)
    ape: torch.Tensor  # (m, C) float32 position bias inside a window
    norm: torch.Tensor  # (d,) float32
    ratio: int
    overlap: bool  # CSA: entry w also mixes window w - 1


@dataclass(frozen=True)
class Indexer:
    compressor: Compressor
    wq_b: torch.Tensor  # (heads * index_head_dim, q_lora_rank)
    weights_proj: torch.Tensor  # (heads, D)


@dataclass(frozen=True)
class Experts:
    w13: torch.Tensor  # (E, 2 I, D): gate rows then up rows
    w2: torch.Tensor  # (E, D, I)


@dataclass(frozen=True)
class Layer:
    kind: str
    hc_attn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # fn ((2 + hc) hc, hc D), base, scale (3,)
    hc_ffn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # (G * o_lora_rank, H * d / G)
    wo_b: torch.Tensor  # (D, G * o_lora_rank)
    sinks: torch.Tensor  # (H,) float32
    compressor: Compressor | None
    indexer: Indexer | None
    gate: torch.Tensor  # (E, D) router
    gate_bias: torch.Tensor | None  # (E,) float32 selection bias (top-k routed layers)
    tid2eid: torch.Tensor | None  # (V, k) int64 (hash-routed layers)
    experts: Experts
    shared: Experts | None  # the shared expert(s) as one (1, 2 I', D) expert


@dataclass(frozen=True)
class Mtp:
    """Multi-token prediction: the layer pairs the main model's streams at position j with the embedding of
    token j + 1 and predicts token j + 2, through one more (window-only) block and its own head collapse."""

    layer: Layer
    e_proj: torch.Tensor  # (D, D)
    h_proj: torch.Tensor  # (D, D)
    enorm: torch.Tensor
    hnorm: torch.Tensor
    norm: torch.Tensor
    hc_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DeepseekV4:
    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
        ops: Ops | None = None,
    ) -> None:
        spec: DeepseekV4Spec = config.spec
        self.config, self.spec, self.dtype, self.device = config, spec, dtype, device
        self.block_tokens = spec.block_tokens
        self.cache: V4Cache | None = None
        # Triton kernels where they replace long chains of tiny torch ops (the rest is the torch path)
        self.triton = ops is not None and ops.name == "triton" and spec.hc_mult & (spec.hc_mult - 1) == 0

        def w(name: str, keep_fp32: bool = False) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint has no tensor {name}")
            t = weights[name]
            return t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)

        def f32(name: str) -> torch.Tensor:
            return w(name, keep_fp32=True)

        def compressor(p: str, ratio: int, overlap: bool) -> Compressor:
            return Compressor(w(p + "wkv.weight"), w(p + "wgate.weight"), f32(p + "ape"), f32(p + "norm.weight"),
                              ratio, overlap)

        def experts(p: str, names: list[str]) -> Experts:
            w13 = torch.stack([torch.cat([w(f"{p}{e}.w1.weight"), w(f"{p}{e}.w3.weight")]) for e in names])
            return Experts(w13, torch.stack([w(f"{p}{e}.w2.weight") for e in names]))

        def layer(p: str, kind: str, ratio: int, hashed: bool) -> Layer:
            a = p + "attn."
            return Layer(
                kind=kind,
                hc_attn=(f32(p + "hc_attn_fn"), f32(p + "hc_attn_base"), f32(p + "hc_attn_scale")),
                hc_ffn=(f32(p + "hc_ffn_fn"), f32(p + "hc_ffn_base"), f32(p + "hc_ffn_scale")),
                attn_norm=f32(p + "attn_norm.weight"),
                ffn_norm=f32(p + "ffn_norm.weight"),
                wq_a=w(a + "wq_a.weight"), q_norm=f32(a + "q_norm.weight"), wq_b=w(a + "wq_b.weight"),
                wkv=w(a + "wkv.weight"), kv_norm=f32(a + "kv_norm.weight"),
                wo_a=w(a + "wo_a.weight"), wo_b=w(a + "wo_b.weight"), sinks=f32(a + "attn_sink"),
                compressor=compressor(a + "compressor.", ratio, kind == CSA) if kind != SLIDING else None,
                indexer=Indexer(compressor(a + "indexer.compressor.", ratio, True), w(a + "indexer.wq_b.weight"),
                                w(a + "indexer.weights_proj.weight")) if kind == CSA else None,
                gate=w(p + "ffn.gate.weight"),
                gate_bias=None if hashed else f32(p + "ffn.gate.bias"),
                tid2eid=weights[p + "ffn.gate.tid2eid"].to(device=device, dtype=torch.long) if hashed else None,
                experts=experts(p + "ffn.experts.", [str(e) for e in range(spec.num_experts)]),
                shared=experts(p + "ffn.", ["shared_experts"]) if spec.num_shared_experts else None,
            )

        self.embed = w("embed.weight")
        self.head = w("head.weight")
        self.norm = f32("norm.weight")
        self.hc_head = (f32("hc_head_fn"), f32("hc_head_base"), f32("hc_head_scale"))
        self.layers = [layer(f"layers.{i}.", kind, ratio, i < spec.hash_layers)
                       for i, (kind, ratio) in enumerate(zip(spec.kinds, spec.ratios))]
        # The MTP layer drafts tokens for speculative decoding. DeepSeek's releases make it window-only (their
        # compress_ratios end in 0): its sliding ring is all the state it needs, kept beside the main layers'.
        self.mtp: Mtp | None = None
        if spec.num_mtp_layers and spec.mtp_kinds[0] == SLIDING:
            p = "mtp.0."
            self.mtp = Mtp(layer(p, SLIDING, 0, False), w(p + "e_proj.weight"), w(p + "h_proj.weight"),
                           f32(p + "enorm.weight"), f32(p + "hnorm.weight"), f32(p + "norm.weight"),
                           (f32(p + "hc_head_fn"), f32(p + "hc_head_base"), f32(p + "hc_head_scale")))
        rd = spec.rope_head_dim
        self.rope_main = Rotary(rd, spec.rope_theta, None, device)
        self.rope_compress = Rotary(rd, spec.compress_rope_theta, spec.compress_rope_scaling, device)
        self.scale = spec.head_dim**-0.5

    # --- the cache ----------------------------------------------------------------------------------------------

    def cache_spec(self, block_tokens: int, dtype: torch.dtype) -> CacheSpec:
        probe = V4Cache(self.spec, 1, torch.device("cpu"), dtype, mtp=self.mtp is not None)
        return CacheSpec(None, probe.state_bytes, block_bytes=probe.block_bytes, block_tokens=self.block_tokens)

    def make_cache(self, num_blocks: int) -> V4Cache:
        self.cache = V4Cache(self.spec, num_blocks, self.device, self.dtype, mtp=self.mtp is not None)
        return self.cache

    # --- forward ------------------------------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: V4Cache,
        fed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> residual streams (T, hc, D) before the head's collapse. An id -(r + 1) is
        a placeholder for fed[r], a token sampled by the step still in flight."""
        s = self.spec
        if fed is not None and bool((input_ids < 0).any()):
            input_ids = torch.where(input_ids < 0, fed[(-input_ids - 1).clamp(min=0)], input_ids)
        x = self.embed[input_ids]
        streams = x.unsqueeze(1).expand(-1, s.hc_mult, -1).contiguous()  # (T, hc, D)
        # a span's first position is its context less its query rows (no read-back from the device)
        states = [kv.state(span.request_id, span.context_len - span.q_len) for span in meta.spans]
        angles = {"main": self.rope_main.angles(positions), "compress": self.rope_compress.angles(positions)}
        for i, layer in enumerate(self.layers):
            post, comb, h = self._hc_pre(streams, layer.hc_attn)
            out = self._attention(i, layer, rms(h, layer.attn_norm, s.rms_eps), positions, angles, meta, states, kv)
            streams = self._hc_post(out, post, comb, streams)
            post, comb, h = self._hc_pre(streams, layer.hc_ffn)
            out = self._moe(layer, rms(h, layer.ffn_norm, s.rms_eps), input_ids)
            streams = self._hc_post(out, post, comb, streams)
        for span, state in zip(meta.spans, states):
            state.length = span.context_len
        return streams

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """streams (N, hc, D) of the rows we sample from -> (N, V) float32."""
        return self._head(streams, self.hc_head, self.norm)

    def _head(self, streams: torch.Tensor, hc_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              norm: torch.Tensor) -> torch.Tensor:
        s = self.spec
        fn, base, scale = hc_head
        flat = rms(streams.flatten(1).float(), None, s.rms_eps)
        pre = torch.sigmoid(flat @ fn.T * scale + base) + s.hc_eps  # (N, hc)
        x = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return F.linear(rms(x, norm, s.rms_eps), self.head).float()

    # --- multi-token prediction ---------------------------------------------------------------------------------

    def mtp_advance(self, kv: V4Cache, request_id: str, start: int, streams: torch.Tensor, next_tokens: list[int]
                    ) -> torch.Tensor | None:
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
            out = self._mtp_block(kv, request_id, rows[:n], torch.tensor(next_tokens, device=rows.device), first)
        state.mtp_length = first + n
        if n < rows.shape[0] and state.pending is not None:
            state.pending.copy_(rows[n])  # h at mtp_length, waiting for its next token
        return None if out is None or n == rows.shape[0] - 1 else out[-1]

    def mtp_draft(self, kv: V4Cache, request_id: str, out: torch.Tensor, position: int, k: int) -> list[int]:
        """k greedy draft tokens from the MTP output streams `out` (hc, D) of the pair at `position - 1`; pairs
        built from drafts are provisional: the next mtp_advance overwrites them."""
        assert self.mtp is not None
        m = self.mtp
        drafts: list[int] = []
        for step in range(k):
            token = int(self._head(out[None], m.hc_head, m.norm).argmax(-1))
            drafts.append(token)
            if step + 1 < k:
                out = self._mtp_block(kv, request_id, out[None], torch.tensor([token], device=out.device),
                                      position + step)[-1]
        return drafts

    def _mtp_block(self, kv: V4Cache, request_id: str, h: torch.Tensor, tokens: torch.Tensor, first: int
                   ) -> torch.Tensor:
        """The MTP layer over pairs (h_j, token j + 1) at positions first..first + n - 1 -> streams (n, hc, D)."""
        assert self.mtp is not None
        s, m = self.spec, self.mtp
        state = kv.states[request_id]
        n = h.shape[0]
        positions = torch.arange(first, first + n, device=h.device)
        e = rms(self.embed[tokens], m.enorm, s.rms_eps)
        streams = F.linear(e, m.e_proj).unsqueeze(1) + F.linear(rms(h, m.hnorm, s.rms_eps), m.h_proj)
        angles = {"main": self.rope_main.angles(positions)}
        span = SeqSpan(0, n, first + n, torch.zeros(0, dtype=torch.long), request_id)
        meta = AttentionMetadata(positions, [span])
        i, layer = s.num_layers, m.layer  # its ring sits after the main layers'
        post, comb, x = self._hc_pre(streams, layer.hc_attn)
        out = self._attention(i, layer, rms(x, layer.attn_norm, s.rms_eps), positions, angles, meta, [state], kv)
        streams = self._hc_post(out, post, comb, streams)
        post, comb, x = self._hc_pre(streams, layer.hc_ffn)
        streams = self._hc_post(self._moe(layer, rms(x, layer.ffn_norm, s.rms_eps), tokens), post, comb, streams)
        return streams

    # --- manifold-constrained hyper-connections -----------------------------------------------------------------

    def _hc_pre(self, streams: torch.Tensor, hc: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> post (T, hc), comb (T, hc, hc) doubly stochastic, the collapsed block input (T, D)."""
        s = self.spec
        n = s.hc_mult
        fn, base, scale = hc
        mix = rms(streams.flatten(1).float(), None, s.rms_eps) @ fn.T  # (T, (2 + n) n)
        if self.triton:  # one launch for the gates and the Sinkhorn loop below
            pre, post, comb = hc_weights(mix, base, scale, n, s.hc_iters, s.hc_eps)
            return post, comb, (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + s.hc_eps
        post = 2 * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = torch.softmax(mix[:, 2 * n :].view(-1, n, n) * scale[2] + base[2 * n :].view(n, n), dim=-1) + s.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + s.hc_eps)
        for _ in range(s.hc_iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to one
            comb = comb / (comb.sum(-1, keepdim=True) + s.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + s.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def _hc_post(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """Expand the block output into the streams and mix the residual: out_k post_k + sum_j comb[j, k] s_j."""
        dt = streams.dtype
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dt).transpose(-1, -2) @ streams

    # --- attention ----------------------------------------------------------------------------------------------

    def _attention(self, i: int, layer: Layer, x: torch.Tensor, positions: torch.Tensor,
                   angles: dict[str, tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                   states: list[RequestState], kv: V4Cache) -> torch.Tensor:
        s = self.spec
        T = x.shape[0]
        H, d = s.num_heads, s.head_dim
        cos, sin = angles["main" if layer.kind == SLIDING else "compress"]
        q_res = rms(F.linear(x, layer.wq_a), layer.q_norm, s.rms_eps)  # (T, q_lora_rank)
        q = rotate(rms(F.linear(q_res, layer.wq_b).view(T, H, d), None, s.rms_eps), cos, sin)
        k = rotate(rms(F.linear(x, layer.wkv), layer.kv_norm, s.rms_eps), cos, sin)  # (T, d) = V
        comp = idx = None
        if layer.compressor is not None:
            c = layer.compressor
            comp = (F.linear(x, c.wkv), F.linear(x, c.wgate))
        if layer.indexer is not None:
            ix = layer.indexer
            ic = ix.compressor
            cq, sq = angles["compress"]
            iq = rotate(F.linear(q_res, ix.wq_b).view(T, s.index_heads, s.index_head_dim), cq, sq)
            idx = (F.linear(x, ic.wkv), F.linear(x, ic.wgate), iq, F.linear(x, ix.weights_proj))
        out = torch.empty_like(q)
        for span, state in zip(meta.spans, states):
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._attend_one(i, layer, span, state, kv, positions[rows], q[rows], k[rows],
                                         None if comp is None else (comp[0][rows], comp[1][rows]),
                                         None if idx is None else tuple(t[rows] for t in idx))
        out = rotate(out, cos, -sin)  # undo the rotation V carried, at the query's position
        G = s.o_groups
        grouped = torch.bmm(out.reshape(T, G, -1).transpose(0, 1), layer.wo_a.view(G, -1, out.shape[-1] * H // G)
                            .transpose(1, 2))  # (G, T, o_lora_rank)
        return F.linear(grouped.transpose(0, 1).reshape(T, -1), layer.wo_b)

    def _attend_one(self, i: int, layer: Layer, span: SeqSpan, state: RequestState, kv: V4Cache,
                    pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    comp: tuple[torch.Tensor, torch.Tensor] | None, idx: tuple[torch.Tensor, ...] | None
                    ) -> torch.Tensor:
        """One sequence's chunk of n queries at positions start..start+n-1: (n, H, d)."""
        s = self.spec
        n, start, W = q.shape[0], span.context_len - span.q_len, s.window
        # sliding window: ring positions [max(begin, start - W + 1), start) then this chunk's keys
        first = max(state.begin, start - W + 1)
        ring = state.swa[i]
        old = torch.arange(first, start, device=q.device)
        keys = torch.cat([ring[old % ring.shape[0]], k])  # (m_k, d)
        kpos = torch.cat([old, pos])
        mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - W)  # (n, m_k)
        new_pos = pos[-ring.shape[0] :]
        ring[new_pos % ring.shape[0]] = k[-ring.shape[0] :].to(ring.dtype)
        if comp is not None:
            c = layer.compressor
            assert c is not None
            entries = self._compress(c, state.comp[i], comp, start, state, kv.entries[i], span, kv, s.head_dim)
            visible = (pos + 1) // c.ratio  # (n,) entries each query may see
            allowed = torch.arange(entries.shape[0], device=q.device)[None, :] < visible[:, None]
            if idx is not None:
                allowed &= self._select(layer, i, state, idx, start, span, kv, visible)
            keys = torch.cat([keys, entries.to(keys.dtype)])
            mask = torch.cat([mask, allowed], dim=1)
        logits = torch.einsum("nhd,kd->hnk", q.float(), keys.float()) * self.scale
        logits = logits.masked_fill(~mask, float("-inf"))
        sink = layer.sinks.view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hnk,kd->nhd", probs, keys.float()).to(q.dtype)

    def _select(self, layer: Layer, i: int, state: RequestState, idx: tuple[torch.Tensor, ...], start: int,
                span: SeqSpan, kv: V4Cache, visible: torch.Tensor) -> torch.Tensor:
        """CSA's lightning indexer: which visible entries each query attends to (its top index_topk)."""
        s = self.spec
        ix = layer.indexer
        assert ix is not None
        kv_i, gate_i, iq, weights = idx
        keys = self._compress(ix.compressor, state.index[i], (kv_i, gate_i), start, state, kv.index_keys[i], span,
                              kv, s.index_head_dim)  # (E, index_head_dim)
        E = keys.shape[0]
        scores = torch.relu(torch.einsum("nhc,ec->nhe", iq.float(), keys.float())) * s.index_head_dim**-0.5
        scores = (scores * (weights.float() * s.index_heads**-0.5).unsqueeze(-1)).sum(1)  # (n, E)
        entry = torch.arange(E, device=scores.device)[None, :]
        scores = scores.masked_fill(entry >= visible[:, None], float("-inf"))
        top = scores.topk(min(s.index_topk, E), dim=-1).indices if E else scores.new_zeros(len(visible), 0).long()
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
        return chosen & (entry < visible[:, None])

    def _compress(self, c: Compressor, ring: tuple[torch.Tensor, torch.Tensor] | None,
                  new: tuple[torch.Tensor, torch.Tensor], start: int, state: RequestState,
                  store: torch.Tensor | None, span: SeqSpan, kv: V4Cache, d: int) -> torch.Tensor:
        """Feed a chunk's compressor projections through: store them in the ring, build and write the entries of
        the windows the chunk closes (not those restored from the long-term tier), and return every entry
        the chunk's last query may see, (E, d) read back from the paged blocks."""
        assert ring is not None and store is not None
        m, n = c.ratio, new[0].shape[0]
        end = start + n
        kv_ring, gate_ring = ring
        cap = kv_ring.shape[0]
        lo_win = max(start // m, state.frozen // m)  # first window to build
        hi_win = end // m  # windows [lo_win, hi_win) close in this chunk
        device = kv_ring.device
        if hi_win > lo_win:
            back = 1 if c.overlap else 0
            p = torch.arange((lo_win - back) * m, hi_win * m, device=device)  # raw tokens those windows read
            in_chunk = p >= start
            valid = (p >= state.begin) & (p >= 0)
            from_ring = (p % cap).clamp(min=0)
            from_new = (p - start).clamp(min=0, max=n - 1)
            raw_kv = torch.where(in_chunk[:, None], new[0][from_new], kv_ring[from_ring].to(new[0].dtype))
            raw_gate = torch.where(in_chunk[:, None], new[1][from_new], gate_ring[from_ring].to(new[1].dtype))
            gate = raw_gate.float() + c.ape.repeat(p.shape[0] // m, 1)
            gate = gate.masked_fill(~valid[:, None], float("-inf"))
            raw_kv = raw_kv.masked_fill(~valid[:, None], 0)
            wins = hi_win - lo_win + back
            kvw, gw = raw_kv.view(wins, m, -1), gate.view(wins, m, -1)
            if c.overlap:  # entry w: Ca of window w - 1 (first d channels), Cb of window w (last d)
                kvw = torch.cat([kvw[:-1, :, :d], kvw[1:, :, d:]], dim=1)
                gw = torch.cat([gw[:-1, :, :d], gw[1:, :, d:]], dim=1)
            weights = torch.softmax(gw, dim=1).to(kvw.dtype)
            entry = rms((kvw * weights).sum(1), c.norm, self.spec.rms_eps)  # (windows, d)
            wpos = torch.arange(lo_win, hi_win, device=device) * m
            entry = rotate(entry, *self.rope_compress.angles(wpos))
            table = span.block_table
            bt = kv.block_tokens
            blocks = table[(wpos // bt).long()]
            store[blocks, (wpos % bt) // m] = entry.to(store.dtype)
        keep = torch.arange(max(start, end - cap), end, device=device)
        kv_ring[keep % cap] = new[0][keep - start].to(kv_ring.dtype)
        gate_ring[keep % cap] = new[1][keep - start].to(gate_ring.dtype)
        E = end // m
        e = torch.arange(E, device=device) * m
        return store[span.block_table[(e // kv.block_tokens).long()], (e % kv.block_tokens) // m]

    # --- mixture of experts -------------------------------------------------------------------------------------

    def _moe(self, layer: Layer, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        s = self.spec
        logits = F.linear(x, layer.gate).float()  # (T, E)
        if s.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif s.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if layer.tid2eid is not None:
            chosen = layer.tid2eid[input_ids]  # (T, k): hash routing by token id
        else:
            assert layer.gate_bias is not None
            chosen = torch.topk(scores + layer.gate_bias, s.experts_per_token, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * s.routed_scale
        out = self._experts(layer.experts, x, chosen, weights)
        if layer.shared is not None:
            ones = torch.ones(x.shape[0], 1, device=x.device)
            out = out + self._experts(layer.shared, x, torch.zeros_like(ones, dtype=torch.long), ones)
        return out

    def _experts(self, ex: Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each row through its chosen experts (clamped SwiGLU), weighted and summed: grouped by expert, or for
        a few (row, expert) pairs (decode at small batch) as two batched products over the gathered weights,
        with no host round trip to learn which experts were hit."""
        limit = self.spec.swiglu_limit
        T, k = chosen.shape
        if ex.w13.shape[0] == 1:  # the shared expert: every row, one dense SwiGLU
            gate, up = F.linear(x, ex.w13[0]).chunk(2, dim=-1)
            h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
            return F.linear(h, ex.w2[0]) * weights.to(x.dtype)
        if T * k <= GATHER_MAX_PAIRS:
            flat = chosen.flatten()
            xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # (T k, D, 1)
            gate, up = torch.bmm(ex.w13[flat], xs).squeeze(-1).chunk(2, dim=-1)  # (T k, I) each
            h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
            y = torch.bmm(ex.w2[flat], h.unsqueeze(-1)).squeeze(-1) * weights.flatten()[:, None].to(x.dtype)
            return y.view(T, k, -1).sum(1).to(x.dtype)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=ex.w13.shape[0]).tolist()
        out = torch.zeros_like(x)
        at = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[at : at + count]
            at += count
            rows = picks // k
            gate, up = F.linear(x[rows], ex.w13[e]).chunk(2, dim=-1)
            h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
            y = F.linear(h, ex.w2[e]) * weights.flatten()[picks, None].to(x.dtype)
            out.index_add_(0, rows, y.to(out.dtype))
        return out
