"""Runs one step plan on the model: import blobs, flatten the chunks into one batch, forward, logits.

    plan chunks:   seq A positions 0..4 (prefill)   seq B position 37 (decode)   seq C 0..2 (sample)
    flat batch:    [a0 a1 a2 a3 a4 | b37 | c0 c1 c2]             T = 9 rows through every linear layer
    slot_mapping:  where each row's K/V goes in the paged cache (block_table[pos // B] * B + pos % B)
    sampled rows:  last row of every chunk that reaches its sequence's end: only those get logits
"""

from __future__ import annotations

import torch

from shared.engine.attention import AttentionMetadata, SeqSpan
from shared.engine.kv_cache import KVCache
from shared.engine.models import CausalLM
from shared.engine.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device, block_tokens: int) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.bt = block_tokens

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Returns (num_sampled, V) float32 logits, in chunk order."""
        if plan.imports:
            blocks, blobs = zip(*plan.imports)
            self.kv.write_blocks(list(blocks), list(blobs))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            table = seq.block_table
            spans.append(SeqSpan(len(ids), n, start + n, self._tensor(table[: -(-(start + n) // self.bt)])))
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += (table[p // self.bt] * self.bt + p % self.bt for p in range(start, start + n))
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata(self._tensor(slots), spans)
        hidden = self.model.forward(self._tensor(ids), self._tensor(positions), meta, self.kv)  # (T, D)
        return self.model.logits(hidden[self._tensor(sample_rows)])  # (N, V)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
