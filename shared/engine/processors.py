"""Logits processors run before the sampler, on the logits' device: vLLM's repetition penalty and min_tokens.

    logits (N, V) -> repetition penalty -> min_tokens -> sampler (temperature -> min_p / top-k / top-p -> draw)

They rewrite whole rows before either sampler path (per-row CPU, batched device) sees them, so greedy rows,
speculative verification and CUDA-graph steps honour them alike. A row whose request uses neither costs one
attribute check; a step where no row uses them returns its logits untouched.

    repetition penalty   for every token id in the prompt or the output so far: l / p if l > 0 else l * p
    min_tokens           while the output position is below min_tokens, the sequence's stop ids get -inf

The penalty needs the set of token ids each sequence holds. It lives on the logits' device, one row of a
(slots, V) bool table per penalised sequence: filled from its tokens the first time it samples here (all known
then: only later steps' tokens can still be in flight), then extended with every token it samples, on the
device, so the overlapped path never waits for a token to reach the host. A speculative row sees the drafts
before it as well: the very set plain decoding has at that position when those drafts are accepted (and when
they are not, the row is thrown away); such steps are synchronous, so accepted tokens are added from the host.
"""

from __future__ import annotations

import torch

from shared.engine.scheduler import Chunk
from shared.engine.sequence import Sequence

Row = tuple[Chunk, int]  # a sampled row: its chunk and r, the row within it (r > 0 only after drafts[:r])


class LogitsProcessors:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)  # (slots, V) token ids held
        self.slots: dict[str, int] = {}  # request id -> its row of `seen`
        self._free: list[int] = []
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, slots) whose tokens record() adds

    def apply(self, logits: torch.Tensor, rows: list[Row], positions: list[int]) -> torch.Tensor:
        """logits (N, V) float32, one row per entry of `rows` at output position positions[i] -> (N, V).

        Call before the step is committed (every sequence's token_ids are then its known tokens)."""
        self._pending = None
        hot = [i for i, (c, _) in enumerate(rows) if c.seq.sampling.processed]
        if not hot:
            return logits
        penalised = [i for i in hot if rows[i][0].seq.sampling.repetition_penalty != 1.0]
        if penalised:
            logits = self._penalise(logits, rows, penalised)
        banned = [(i, t) for i in hot if positions[i] < rows[i][0].seq.sampling.min_tokens
                  for t in rows[i][0].seq.stop_ids]
        if banned:
            at, ids = zip(*banned)
            flat = self._tensor(at) * self.vocab + self._tensor(ids)
            logits = logits.flatten().index_fill(0, flat, float("-inf")).view_as(logits)
        return logits

    def record(self, tokens: torch.Tensor | list[int]) -> None:
        """A plain (draft-free) step's sampled tokens, (N,) in row order, join their sequences' seen sets."""
        if self._pending is None:
            return
        rows, slots = self._pending
        self._pending = None
        if isinstance(tokens, list):
            tokens = self._tensor(tokens)
        _mark(self.seen, slots, tokens.index_select(0, rows))

    def accept(self, seq: Sequence, tokens: list[int]) -> None:
        """A speculative step's verified tokens of `seq` (accepted drafts and the bonus token)."""
        slot = self.slots.get(seq.request_id)
        if slot is not None:
            _mark(self.seen, self._tensor([slot] * len(tokens)), self._tensor(tokens))

    def drop(self, request_id: str) -> None:
        """The request samples no more here (finished, aborted, released): its slot is free."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _penalise(self, logits: torch.Tensor, rows: list[Row], penalised: list[int]) -> torch.Tensor:
        slots = [self._slot(rows[i][0].seq) for i in penalised]
        at, slot_t = self._tensor(penalised), self._tensor(slots)
        seen = self.seen.index_select(0, slot_t)  # (n, V), a copy: drafts below touch only this step's rows
        drafted = [(j, d) for j, i in enumerate(penalised) for d in rows[i][0].drafts[: rows[i][1]]]
        if drafted:
            j, d = zip(*drafted)
            _mark(seen, self._tensor(j), self._tensor(d))
        p = torch.tensor([rows[i][0].seq.sampling.repetition_penalty for i in penalised], dtype=torch.float32)
        p = p.to(logits.device, non_blocking=True)[:, None]  # (n, 1)
        x = logits.index_select(0, at)  # (n, V)
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
        self._pending = (at, slot_t)
        return logits.index_copy(0, at, x)

    def _slot(self, seq: Sequence) -> int:
        slot = self.slots.get(seq.request_id)
        if slot is not None:
            return slot
        if not self._free:
            grown = max(8, 2 * self.seen.shape[0])
            self._free = list(range(grown - 1, self.seen.shape[0] - 1, -1))
            self.seen = torch.cat([self.seen, self.seen.new_zeros(grown - self.seen.shape[0], self.vocab)])
        slot = self._free.pop()
        assert min(seq.token_ids) >= 0, "a sequence's first sampled step has no token in flight"
        self.slots[seq.request_id] = slot
        self.seen[slot] = False  # (a slot's previous owner may have left stale bits)
        _mark(self.seen, self._tensor([slot] * seq.num_tokens), self._tensor(seq.token_ids))
        return slot

    def _tensor(self, values: list[int] | tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)


def _mark(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """table[rows[i], cols[i]] = True for every i, in place. A fill at flat indices: advanced-index assignment
    (table[rows, cols] = True) waits for the device on CUDA, which would stall the overlapped steps."""
    table.view(-1).index_fill_(0, rows * table.shape[1] + cols, True)
