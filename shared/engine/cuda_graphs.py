"""CUDA graphs for decode steps, one per bucketed batch size, and the pinned host buffer inputs travel in.

A decode step of S sequences runs the graph of the smallest bucket B >= S. Its inputs live in one static
int32 device buffer, laid out per bucket as

    ids (B) | positions (B) | slots (B) | context_lens (B) | block_tables (B, W)       W = max pages of a sequence

filled on the host (pinned) and copied in one transfer before the replay. Rows S..B-1 are padding: slot -1 (no
KV write) and context 0 (attention writes zeros); their logits are computed and dropped. A graph is keyed by
(batch bucket, context bucket): the decode kernel's grid covers the context bucket (a power of 4 times 512
tokens, up to W pages), so short contexts do not launch the programs of the longest possible one.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shared.engine.attention import AttentionMetadata, BatchTensors
from shared.engine.kv_cache import KVCache


class PinnedStaging:
    """Growing pinned int32 host buffers and their device twin: one host->device copy per step.

    Two host buffers, used in turn: with overlapped steps, step N+1 is packed while step N's copy may still
    wait in the stream behind step N-1; by then step N-1's tokens were read back (an event after its copy),
    so the buffer N-1 used is free again."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs = [torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32)]
        self._turn = 0

    def host(self, n: int) -> np.ndarray:
        """The next host buffer, n entries (the following to_device() sends it)."""
        self._turn ^= 1
        if n > self._bufs[self._turn].numel():
            pin = self.device.type == "cuda"  # (the CPU runs this path in tests, under Triton's interpreter)
            size = max(n, 2 * self._bufs[self._turn].numel())
            self._bufs[self._turn] = torch.empty(size, dtype=torch.int32, pin_memory=pin)
        return self._bufs[self._turn].numpy()[:n]

    def to_device(self, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(n, dtype=torch.int32, device=self.device)
        out[:n].copy_(self._bufs[self._turn][:n], non_blocking=True)
        return out


class DecodeGraphs:
    def __init__(
        self, model, kv: KVCache, device: torch.device, block_tokens: int, max_tokens: int, sizes: tuple[int, ...],
        fed: torch.Tensor,
    ) -> None:
        self.model = model
        self.fed = fed  # the last step's sampled tokens: placeholder ids -(r + 1) read row r
        self.kv = kv
        self.bt = block_tokens
        self.width = -(-max_tokens // block_tokens)  # W: pages of the longest possible sequence
        self.sizes = sorted(sizes)
        self.staging = PinnedStaging(device)
        self.inputs = torch.zeros(self.sizes[-1] * (4 + self.width), dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (B, C) -> graph, logits
        cap = self.width * block_tokens
        self.context_buckets = sorted({min(512 * 4**i, cap) for i in range(8)})
        self.pool = None
        self.hidden: torch.Tensor | None = None  # (Llama's drafter, prompt lookup, reads no hidden rows)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, chunks: list) -> bool:
        return len(chunks) <= self.max_batch and all(c.num_tokens == 1 and c.sample for c in chunks)

    def run(self, chunks: list) -> torch.Tensor:
        """Decode chunks (one token each, all sampled) -> (S, V) float32 logits (a view of the graph's output)."""
        S, bt, W = len(chunks), self.bt, self.width
        B = self.bucket(S)
        n = B * (4 + W)
        buf = self.staging.host(n)
        ids, pos, slots, ctx = (buf[i * B : (i + 1) * B] for i in range(4))
        tables = buf[4 * B :].reshape(B, W)
        # per-sequence Python kept to list building (numpy element writes cost ~0.1 us each; 256 rows a step)
        pos[:S] = [c.start for c in chunks]
        ids[:S] = [c.seq.token_ids[c.start] for c in chunks]
        for i, c in enumerate(chunks):
            table = c.seq.block_table
            tables[i, : len(table)] = table
        p = pos[:S]
        slots[:S] = tables[np.arange(S), p // bt] * bt + p % bt
        ids[S:], pos[S:], slots[S:], ctx[S:] = 0, 0, -1, 0
        ctx[:S] = p + 1
        C = self.context_buckets[bisect.bisect_left(self.context_buckets, int(ctx[:S].max()))]
        self.staging.to_device(n, self.inputs)
        if (B, C) not in self.graphs:
            self.graphs[B, C] = self._capture(B, C)
        graph, logits = self.graphs[B, C]
        graph.replay()
        return logits[:S]

    def warm_up(self) -> int:
        """Capture every (batch, context) bucket now (capture_all's reasons)."""
        return capture_all(self.graphs, self.sizes, self.context_buckets, self._capture)

    def bucket(self, S: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, S)]

    def _forward(self, B: int, C: int) -> torch.Tensor:
        W = self.width
        ids, pos, slots, ctx = self.inputs[: 4 * B].view(4, B)
        tables = self.inputs[4 * B : B * (4 + W)].view(B, W)
        q = ctx.new_zeros(1)  # unused by the decode kernel
        batch = BatchTensors(tables, ctx, q, q, 1, C, True, False)
        hidden = self.model.forward(ids, pos, AttentionMetadata(slots, [], batch), self.kv, self.fed)  # (B, D)
        return self.model.logits(hidden)  # (B, V)

    def _capture(self, B: int, C: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The inputs hold this step's real batch: the warm-up (which compiles the kernels) and the capture run
        # on it, so they must not write KV: slots -1 turns every write off during both.
        saved = self.inputs.clone()
        self.inputs[2 * B : 3 * B] = -1
        graph, logits = capture(lambda: self._forward(B, C), self.pool)
        self.pool = graph.pool()
        self.inputs.copy_(saved)
        return graph, logits


def capture_all(graphs: dict[tuple[int, int], Any], sizes: list[int], contexts: list[int],
                capture_one: Callable[[int, int], Any]) -> int:
    """Capture every (batch, context) bucket missing from `graphs` now, largest first (one pool sized once): a
    decode worker does this at start-up, since a capture met while serving stalls every running stream for its
    duration (about 2 s a bucket at 43 layers on the H200). Returns how many were captured."""
    todo = [(B, C) for B in reversed(sizes) for C in reversed(contexts) if (B, C) not in graphs]
    for B, C in todo:
        graphs[B, C] = capture_one(B, C)
    return len(todo)


def capture(forward: Callable[[], Any], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """forward() run once on a side stream (the warm-up: kernels compile and tune outside the capture), then
    captured into a graph sharing `pool` (one memory pool for every graph of a runner: they never run at once).
    Returns the graph and its output tensor(s) (rewritten at each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out
