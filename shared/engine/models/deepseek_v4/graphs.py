"""CUDA graphs for DeepSeek-V4 decode steps: the whole forward and the head replayed as one launch.

A decode step of S sequences (one query row each) runs the graph of the smallest batch bucket B >= S and
context bucket C >= the batch's longest context (powers of two from 512 tokens, up to the longest sequence).
Its inputs live in one static int64 device buffer, laid out per (B, C) as

    ids (B) | positions (B) | slots (B) | begins (B) | frozen (B) | block tables (B, C / block_tokens)

filled on the host (pinned) and copied in one transfer before the replay. C bounds every gather and grid of the
step (decode.DecodeBatch.max_context), so a short context does not pay for the longest one.

Rows S..B-1 are padding: position 0 in the cache's scratch slot, with a table of the scratch block (cache.py),
so every ring write, compressor write-back and entry they make lands where nobody reads; their logits are
computed and dropped. The warm-up and the capture run on padding rows only, for the same reason.

The graph's outputs are the step's residual streams and logits: a speculative engine's MTP layer advances on
the streams of every step (drafters/mtp.py), so its draft-free decode steps replay graphs too.

On a CPU (no graphs) `run` calls the same body eagerly: the tests check the packing and the padding there.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shared.engine.cuda_graphs import PinnedStaging, capture, capture_all
from shared.engine.models.deepseek_v4.cache import V4Cache
from shared.engine.models.deepseek_v4.decode import DecodeBatch

if TYPE_CHECKING:
    from shared.engine.models.deepseek_v4.model import DeepseekV4

FIELDS = 5  # ids, positions, slots, begins, frozen


def context_buckets(max_tokens: int, block_tokens: int) -> list[int]:
    """512, 1024, ... up to the longest sequence (rounded up to whole blocks)."""
    cap = -(-max_tokens // block_tokens) * block_tokens
    out, c = [], 512
    while c < cap:
        out.append(c)
        c *= 2
    return sorted({min(b, cap) for b in out} | {cap})


class V4DecodeGraphs:
    def __init__(self, model: DeepseekV4, kv: V4Cache, device: torch.device, max_tokens: int,
                 sizes: Sequence[int], fed: torch.Tensor) -> None:
        self.model = model
        self.kv = kv
        self.bt = kv.block_tokens
        self.fed = fed  # the last step's sampled tokens: placeholder ids -(r + 1) read row r
        self.sizes = sorted(sizes)
        self.contexts = context_buckets(max_tokens, self.bt)
        self.capture = device.type == "cuda"
        self.staging = PinnedStaging(device)
        widest = self.sizes[-1] * (FIELDS + self.contexts[-1] // self.bt)
        self.inputs = torch.zeros(widest, dtype=torch.int64, device=device)
        # (B, C) -> graph, (streams, logits)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool: Any = None
        self.hidden: torch.Tensor | None = None  # the last step's streams (S, hc, D)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, chunks: list) -> bool:
        return (0 < len(chunks) <= self.max_batch
                and all(c.num_tokens == 1 and c.sample and not c.drafts for c in chunks)
                and max(c.start for c in chunks) < self.contexts[-1])

    def run(self, chunks: list) -> torch.Tensor:
        """Decode chunks (one token each, all sampled) -> (S, V) float32 logits (a view of the graph's output)."""
        S = len(chunks)
        B = self.sizes[bisect.bisect_left(self.sizes, S)]
        C = self.contexts[bisect.bisect_left(self.contexts, max(c.start for c in chunks) + 1)]
        states = [self.kv.state(c.seq.request_id, c.start) for c in chunks]
        n = self._pack(chunks, states, B, C)
        self.staging.to_device(n, self.inputs.view(torch.int32))
        if not self.capture:
            streams, logits = self._forward(B, C)
        else:
            if (B, C) not in self.graphs:
                self.graphs[B, C] = self._capture(B, C, n)
            graph, (streams, logits) = self.graphs[B, C]
            graph.replay()
        for c, state in zip(chunks, states):
            state.length = c.start + 1
        self.hidden = streams[:S]
        return logits[:S]

    def warm_up(self) -> int:
        """Capture every (batch, context) bucket now (cuda_graphs.capture_all); 0 on a CPU."""
        if not self.capture:
            return 0
        return capture_all(self.graphs, self.sizes, self.contexts,
                           lambda B, C: self._capture(B, C, 2 * B * (FIELDS + C // self.bt)))

    def _pack(self, chunks: list, states: list, B: int, C: int) -> int:
        """The step's inputs into the next pinned host buffer; returns its length in int32 words."""
        S, bt, NB = len(chunks), self.bt, C // self.bt
        n = B * (FIELDS + NB)
        words = self.staging.host(2 * n)  # int32 words of int64 values: the buffer is sized in int32
        buf = words.view(np.int64)
        ids, pos, slots, begins, frozen = (buf[i * B : (i + 1) * B] for i in range(FIELDS))
        tables = buf[FIELDS * B : n].reshape(B, NB)
        # per-sequence Python kept to list building (numpy element writes cost ~0.1 us each)
        ids[:S] = [c.seq.token_ids[c.start] for c in chunks]
        pos[:S] = [c.start for c in chunks]
        slots[:S] = [st.slot for st in states]
        begins[:S] = [st.begin for st in states]
        frozen[:S] = [st.frozen for st in states]
        tables[:] = self.kv.scratch_block
        for i, c in enumerate(chunks):
            table = c.seq.block_table[: c.start // bt + 1]
            tables[i, : len(table)] = table
        self._pad(buf, S, B)
        return 2 * n

    def _pad(self, buf: Any, first: int, B: int) -> None:
        """Rows first..B-1 of the packed inputs as padding (tables already hold the scratch block)."""
        for field in range(FIELDS):
            buf[field * B + first : (field + 1) * B] = 0
        buf[2 * B + first : 3 * B] = self.kv.scratch_slot

    def _batch(self, B: int, C: int) -> tuple[torch.Tensor, DecodeBatch]:
        NB = C // self.bt
        ids, pos, slots, begins, frozen = self.inputs[: FIELDS * B].view(FIELDS, B)
        table = self.inputs[FIELDS * B : B * (FIELDS + NB)].view(B, NB)
        return ids, DecodeBatch(slots, pos, begins, frozen, table, C)

    def _forward(self, B: int, C: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, batch = self._batch(B, C)
        streams = self.model.layers_forward(ids, batch.positions, None, [], self.kv, batch, self.fed)
        return streams, self.model.logits(streams)  # (B, hc, D), (B, V)

    def _capture(self, B: int, C: int, n: int) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        # The inputs hold this step's real batch; the warm-up (which compiles and tunes the kernels) and the
        # capture both run the forward, so they run it on padding rows only: nothing real is written.
        saved = self.inputs[: n // 2].clone()
        self.inputs[: n // 2] = self.kv.scratch_block
        self._pad(self.inputs, 0, B)
        graph, logits = capture(lambda: self._forward(B, C), self.pool)
        self.pool = graph.pool()
        self.inputs[: n // 2].copy_(saved)
        return graph, logits
