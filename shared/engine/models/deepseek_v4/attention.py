"""DeepSeek-V4 attention over the two-tier cache (cache.py), for the T rows of a step.

One shared K = V head of head_dim, num_heads query heads, a learned sink per head:
    q  = rope(rms(wq_b(rms(wq_a x))))                  per head, unweighted norm, RoPE on the trailing channels
    kv = rope(rms(wkv x))                              this token's key = value, written to the sliding ring
    keys seen by the query at p: kv of (p - window, p]  +  compressed entries of closed windows (HCA: all;
    CSA: the indexer's top-k), output un-rotated at p, then the grouped low-rank projection wo_a (per group) -> wo_b.

Compressor (ratio m): window w = tokens [w m, (w + 1) m) closes at its last token and becomes one entry:
    HCA: sum over the window of softmax(gate + ape) * kv, per channel; CSA: the same over 2m slots, the previous
    window's first half-channels (Ca) and this window's second half (Cb); then RMSNorm and RoPE at position w m.

The projections run over all T rows at once, those that read one input as one GEMM (weights.py: Layer.wx reads
x, Layer.wq reads q_res; each part's output is a column view of the product); the sliding ring, compressors and
attention run per sequence here (the torch path, the reference for fused kernels).
"""

from __future__ import annotations

import torch

from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.kernels import HAVE_TRITON
from shared.engine.models.deepseek_v4 import decode
from shared.engine.models.deepseek_v4.cache import RequestState, V4Cache
from shared.engine.models.deepseek_v4.mhc import rms
from shared.engine.models.deepseek_v4.rope import Rotary, rotate_
from shared.engine.models.deepseek_v4.spec import SLIDING, DeepseekV4Spec
from shared.engine.models.deepseek_v4.weights import Compressor, Layer
from shared.engine.quant import Weight, linear

if HAVE_TRITON:
    from shared.engine.models.deepseek_v4 import prefill

Angles = dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" -> (cos, sin) of the step's rows


class Attention:
    def __init__(self, spec: DeepseekV4Spec, device: torch.device, triton: bool = False) -> None:
        """triton: decode steps take the batched path (decode.py) with its Triton attention kernel."""
        self.spec = spec
        self.batched = triton  # decode steps through decode.py (its torch attention when not self.triton)
        self.triton = triton
        rd = spec.rope_head_dim
        self.rope_main = Rotary(rd, spec.rope_theta, None, device)
        self.rope_compress = Rotary(rd, spec.compress_rope_theta, spec.compress_rope_scaling, device)
        self.scale = spec.head_dim**-0.5
        self.prefill_kernels = triton and prefill.supported(self)

    def angles(self, positions: torch.Tensor) -> Angles:
        return {"main": self.rope_main.angles(positions), "compress": self.rope_compress.angles(positions)}

    def decode_batch(self, meta: AttentionMetadata, states: list[RequestState], positions: torch.Tensor,
                     kv: V4Cache) -> decode.DecodeBatch | None:
        """The step as one batched decode (every layer's attention takes decode.py's path), or None: per sequence."""
        if self.batched and kv.cap_swa >= self.spec.window and decode.is_decode(meta, positions.shape[0]):
            return decode.batch_of(meta, states, positions)
        return None

    def __call__(self, i: int, layer: Layer, x: torch.Tensor, positions: torch.Tensor, angles: Angles,
                 meta: AttentionMetadata | None, states: list[RequestState], kv: V4Cache,
                 batch: decode.DecodeBatch | None) -> torch.Tensor:
        """batch: the step's decode batch (decode_batch); None: meta's spans one by one."""
        s = self.spec
        T = x.shape[0]
        H, d = s.num_heads, s.head_dim
        cos, sin = angles["main" if layer.kind == SLIDING else "compress"]
        px = layer.wx(x)  # every projection of x, column views of one GEMM (or a few: weights.py)
        q_res = rms(px["wq_a"], layer.q_norm, s.rms_eps)
        pq = layer.wq(q_res)
        q = rotate_(rms(pq["wq_b"].view(T, H, d), None, s.rms_eps), cos, sin)  # (T, H, d)
        k = rotate_(rms(px["wkv"], layer.kv_norm, s.rms_eps), cos, sin)  # (T, d) key = value
        comp = idx = None
        if layer.compressor is not None:
            comp = (px["compressor.wkv"], px["compressor.wgate"])  # (T, C) each
        if layer.indexer is not None:
            cq, sq = angles["compress"]
            # in place on pq's own buffer (fresh from the GEMM); a view of one row stride (weights.py: wq's max_rows)
            iq = rotate_(pq["indexer.wq_b"].view(T, s.index_heads, s.index_head_dim), cq, sq)
            idx = (px["indexer.compressor.wkv"], px["indexer.compressor.wgate"], iq, px["indexer.weights_proj"])
        if batch is not None:
            out = decode.attend(self, i, layer, batch, kv, q, k, comp, idx, self.triton)
            return output(out, cos, sin, layer.wo_a, layer.wo_b, s.o_groups)
        assert meta is not None
        parts = []
        for span, state in zip(meta.spans, states):
            rows = slice(span.q_start, span.q_start + span.q_len)
            # a prefill chunk through the kernels of prefill.py (no logits in memory); attend_one is the reference
            attend = prefill.attend if self.prefill_kernels and span.q_len > 1 else Attention.attend_one
            parts.append(attend(self, i, layer, span, state, kv, positions[rows], q[rows], k[rows],
                                None if comp is None else (comp[0][rows], comp[1][rows]),
                                None if idx is None else tuple(t[rows] for t in idx)))
        # one sequence (a long prompt's chunk) is the output as it is: at an 8K chunk the copy was 0.5 GB a layer
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return output(out, cos, sin, layer.wo_a, layer.wo_b, s.o_groups)

    def attend_one(self, i: int, layer: Layer, span: SeqSpan, state: RequestState, kv: V4Cache,
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
            entries = self.compress(c, state.comp[i], comp, start, state, kv.entries[i], span, kv, s.head_dim)
            visible = (pos + 1) // c.ratio  # (n,) entries each query may see
            allowed = torch.arange(entries.shape[0], device=q.device)[None, :] < visible[:, None]
            if idx is not None:
                allowed &= self.select(layer, i, state, idx, start, span, kv, visible)
            keys = torch.cat([keys, entries.to(keys.dtype)])
            mask = torch.cat([mask, allowed], dim=1)
        logits = torch.einsum("nhd,kd->hnk", q.float(), keys.float()) * self.scale
        logits = logits.masked_fill(~mask, float("-inf"))
        sink = layer.sinks.view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hnk,kd->nhd", probs, keys.float()).to(q.dtype)

    def select(self, layer: Layer, i: int, state: RequestState, idx: tuple[torch.Tensor, ...], start: int,
               span: SeqSpan, kv: V4Cache, visible: torch.Tensor) -> torch.Tensor:
        """CSA's lightning indexer: which visible entries each query attends to (its top index_topk)."""
        s = self.spec
        iq, weights = idx[2], idx[3]
        keys = self.index_keys(layer, i, state, idx, start, span, kv)
        E = keys.shape[0]
        scores = torch.relu(torch.einsum("nhc,ec->nhe", iq.float(), keys.float())) * s.index_head_dim**-0.5
        scores = (scores * (weights.float() * s.index_heads**-0.5).unsqueeze(-1)).sum(1)  # (n, E)
        entry = torch.arange(E, device=scores.device)[None, :]
        scores = scores.masked_fill(entry >= visible[:, None], float("-inf"))
        top = scores.topk(min(s.index_topk, E), dim=-1).indices if E else scores.new_zeros(len(visible), 0).long()
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
        return chosen & (entry < visible[:, None])

    def index_keys(self, layer: Layer, i: int, state: RequestState, idx: tuple[torch.Tensor, ...], start: int,
                   span: SeqSpan, kv: V4Cache) -> torch.Tensor:
        """The chunk's indexer projections through the indexer's compressor: every index key the chunk's last
        query may see, (E, index_head_dim)."""
        ix = layer.indexer
        assert ix is not None
        return self.compress(ix.compressor, state.index[i], (idx[0], idx[1]), start, state, kv.index_keys[i], span,
                             kv, self.spec.index_head_dim)

    def compress(self, c: Compressor, ring: tuple[torch.Tensor, torch.Tensor] | None,
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
            entry = rotate_(entry, *self.rope_compress.angles(wpos))
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


def output(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: Weight, wo_b: Weight,
           groups: int) -> torch.Tensor:
    """(T, H, d) attention output, still rotated -> (T, D): undo the rotation V carried (at the query's
    position), then per group of heads wo_a, then wo_b over the groups."""
    out = rotate_(out, cos, -sin)
    T, H, d = out.shape
    if isinstance(wo_a, torch.Tensor):
        grouped = torch.bmm(out.reshape(T, groups, -1).transpose(0, 1), wo_a.view(groups, -1, d * H // groups)
                            .transpose(1, 2)).transpose(0, 1).reshape(T, -1)  # (G, T, o_lora_rank) -> (T, G rank)
    else:  # FP8: one grouped GEMM launch (each group's rows whole scale blocks: weights.py keeps it FP8 only then)
        grouped = linear(out.reshape(T, -1), wo_a, groups)  # (T, G o_lora_rank)
    return linear(grouped, wo_b)
