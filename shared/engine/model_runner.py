"""Runs one step plan on the model: import blobs, flatten the chunks into one batch, forward, logits.

    plan chunks:   seq A positions 0..4 (prefill)   seq B position 37 (decode)   seq C 0..2 (sample)
    flat batch:    [a0 a1 a2 a3 a4 | b37 | c0 c1 c2]             T = 9 rows through every linear layer
    slot_mapping:  where each row's K/V goes in the paged cache (block_table[pos // B] * B + pos % B)
    sampled rows:  last row of every chunk that reaches its sequence's end: only those get logits

On a GPU the step's integer inputs (ids, positions, slots, block tables, lengths, sampled rows) are packed on
the host into one pinned int32 buffer and cross to the device in one copy; decode-only steps replay a CUDA
graph captured for the next bucketed batch size (cuda_graphs.py).

Input ids may be placeholders -(r + 1) for tokens sampled by the step still in flight (overlapped scheduling):
the model's embedding reads row r of `fed`, the device copy of that step's sampled tokens.
"""

from __future__ import annotations

import torch

import numpy as np

from shared.engine.attention import AttentionMetadata, BatchTensors, SeqSpan
from shared.engine.cuda_graphs import DecodeGraphs, PinnedStaging
from shared.engine.kv_cache import KVCache
from shared.engine.models import CausalLM
from shared.engine.protocols import DecodeGraphRunner, GraphsDecode
from shared.engine.scheduler import StepPlan


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv: KVCache, device: torch.device, block_tokens: int, *, batched: bool = False,
        max_tokens: int = 0, graph_sizes: tuple[int, ...] = (), max_rows: int = 1, keep_hidden: bool = False,
    ) -> None:
        """batched: build the packed device metadata (the Triton ops need it); graph_sizes: decode batch
        sizes to capture CUDA graphs for (on first use, or all at once: Engine.warm_up), each sequence up to max_tokens long;
        max_rows: most sampled rows in one step (the size of `fed`); keep_hidden: every step leaves its hidden
        rows in `hidden` as a tensor of its own (a drafter reads them after the next step may have run)."""
        self.model = model
        self.kv = kv
        self.device = device
        self.bt = block_tokens
        self.batched = batched
        self.fed = torch.zeros(max_rows, dtype=torch.long, device=device)  # the last step's sampled tokens
        self.hidden: torch.Tensor | None = None  # the last step's hidden rows (non-batched path, or V4's graphs)
        self.keep_hidden = keep_hidden
        self.staging = PinnedStaging(device) if batched else None
        self.graphs: DecodeGraphRunner | None = None
        if graph_sizes and isinstance(model, GraphsDecode):  # the model's own (V4: per-request state inside)
            self.graphs = model.decode_graphs(kv, device, max_tokens, graph_sizes, self.fed)
        elif graph_sizes and batched:
            self.graphs = DecodeGraphs(model, kv, device, block_tokens, max_tokens, graph_sizes, self.fed)

    def feed(self, tokens: torch.Tensor) -> None:
        """tokens (N,) int64 sampled by the step just launched: the next step's placeholders read them."""
        self.fed[: tokens.shape[0]].copy_(tokens, non_blocking=True)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Returns (num_sampled, V) float32 logits, in chunk order."""
        if plan.imports:
            blocks, blobs = zip(*plan.imports)
            self.kv.write_blocks(list(blocks), list(blobs))
        if self.batched:
            return self._run_batched(plan)
        if self.graphs is not None and self.graphs.fits(plan.chunks):
            logits = self.graphs.run(plan.chunks)
            # the graph's output buffer is rewritten by the next replay, which an overlapped step runs first
            hidden = self.graphs.hidden
            self.hidden = hidden.clone() if self.keep_hidden and hidden is not None else None
            return logits
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            table = seq.block_table
            spans.append(SeqSpan(len(ids), n, start + n, self._tensor(table[: -(-(start + n) // self.bt)]),
                                 seq.request_id))
            first = len(ids)
            ids += seq.token_ids[start : start + n - len(chunk.drafts)] + list(chunk.drafts)
            positions += range(start, start + n)
            slots += (table[p // self.bt] * self.bt + p % self.bt for p in range(start, start + n))
            if chunk.drafts:
                sample_rows += range(first, len(ids))  # verify every draft: logits at each of its rows
            elif chunk.sample:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata(self._tensor(slots), spans)
        hidden = self.model.forward(self._tensor(ids), self._tensor(positions), meta, self.kv, self.fed)  # (T, D)
        self.hidden = hidden  # the speculative drafter reads the rows it keeps
        return self.model.logits(hidden[self._tensor(sample_rows)])  # (N, V)

    def _run_batched(self, plan: StepPlan) -> torch.Tensor:
        chunks = plan.chunks
        if self.graphs is not None and self.graphs.fits(chunks):
            return self.graphs.run(chunks)
        S, bt = len(chunks), self.bt
        q_lens = np.fromiter((c.num_tokens for c in chunks), np.int64, S)
        starts = np.fromiter((c.start for c in chunks), np.int64, S)
        ctx = starts + q_lens
        q_starts = np.cumsum(q_lens) - q_lens
        T, W = int(q_lens.sum()), int((-(-ctx // bt)).max())
        # a chunk's last row; a chunk with speculative drafts verifies every row
        sampled = np.concatenate([np.arange(q_starts[i], q_starts[i] + q_lens[i]) if c.drafts else
                                  q_starts[i : i + 1] + q_lens[i] - 1 for i, c in enumerate(chunks) if c.sample]
                                 or [np.zeros(0, np.int64)])
        # one int32 buffer: ids (T) | positions (T) | slots (T) | tables (S, W) | ctx | q_starts | q_lens | rows
        sizes = [T, T, T, S * W, S, S, S, len(sampled)]
        buf = self.staging.host(sum(sizes))
        ids, pos, slots, tables, ctx_v, qs_v, ql_v, rows_v = np.split(buf, np.cumsum(sizes)[:-1])
        tables = tables.reshape(S, W)
        tables[:] = 0
        for i, c in enumerate(chunks):
            seq, a, n = c.seq, q_starts[i], c.num_tokens
            ids[a : a + n] = seq.token_ids[c.start : c.start + n - len(c.drafts)] + list(c.drafts)
            table = seq.block_table[: -(-(c.start + n) // bt)]
            tables[i, : len(table)] = table
        row_seq = np.repeat(np.arange(S), q_lens)  # (T,) which sequence each row belongs to
        pos[:] = np.arange(T) - np.repeat(q_starts - starts, q_lens)
        slots[:] = tables[row_seq, pos // bt] * bt + pos % bt
        ctx_v[:], qs_v[:], ql_v[:], rows_v[:] = ctx, q_starts, q_lens, sampled
        dev = self.staging.to_device(sum(sizes))
        d_ids, d_pos, d_slots, d_tables, d_ctx, d_qs, d_ql, d_rows = dev.split(sizes)
        d_tables = d_tables.view(S, W)
        fresh = bool((starts == 0).all())
        spans = [SeqSpan(int(q_starts[i]), int(q_lens[i]), int(ctx[i]), d_tables[i]) for i in range(S)] if fresh else []
        batch = BatchTensors(d_tables, d_ctx, d_qs, d_ql, int(q_lens.max()), int(ctx.max()), T == S, fresh)
        meta = AttentionMetadata(d_slots, spans, batch)
        hidden = self.model.forward(d_ids, d_pos, meta, self.kv, self.fed)  # (T, D)
        return self.model.logits(hidden[d_rows.long()])  # (N, V)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
