"""Logits processors run before the sampler, on the logits' device: logit_bias, vLLM's repetition penalty,
OpenAI's presence and frequency penalties and min_tokens, in vLLM's order (bias, then penalties, then min_tokens).

    logits (N, V) -> logit_bias -> repetition penalty -> presence / frequency -> min_tokens -> sampler

They rewrite whole rows before either sampler path (per-row CPU, batched device) sees them, so greedy rows,
speculative verification and CUDA-graph steps honour them alike. A row whose request uses none costs one
attribute check; a step where no row uses them returns its logits untouched.

    logit_bias           logit[t] += bias[t] for every biased token id
    repetition penalty   for every token id in the prompt or the output so far: l / p if l > 0 else l * p
    presence/frequency   l - frequency x c - presence x (c > 0), c = how often the id occurs in the output so far
                         (not the prompt: OpenAI's definition; a continuation's output_offset tokens are output)
    min_tokens           while the output position is below min_tokens, the sequence's stop ids get -inf
    reasoning budget     from output position reasoning_budget on, while reasoning_end does not occur in the
                         output so far, every logit but reasoning_end's is -inf: the reasoning is closed there.
                         Applied after bias and penalties (nothing before it can undo it; min_tokens after it bans
                         stop ids only); the grammar mask after the processors is not open before that token.
                         It reads the output counts, so a budgeted sequence holds a slot like a penalised one

The penalties need each sequence's token history. It lives on the logits' device, one row of a (slots, V) bool
table (ids in prompt or output) and of a (slots, V) float32 table (output counts) per penalised sequence: filled
from its tokens the first time it samples here (all known then: only later steps' tokens can still be in flight),
then extended with every token it samples, on the device, so the overlapped path never waits for a token to reach
the host. A speculative row sees the drafts before it as well: the very history plain decoding has at that
position when those drafts are accepted (and when they are not, the row is thrown away); such steps are
synchronous, so accepted tokens are added from the host.
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
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)  # (slots, V) output occurrences
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
        biased = [(i, t, b) for i in hot for t, b in rows[i][0].seq.sampling.logit_bias]
        if biased:
            at, ids, bias = zip(*biased)
            flat = self._tensor(at) * self.vocab + self._tensor(ids)
            values = torch.tensor(bias, dtype=logits.dtype).to(self.device, non_blocking=True)
            logits = logits.flatten().index_add(0, flat, values).view_as(logits)
        penalised = [i for i in hot if _history(rows[i][0].seq)]
        if penalised:
            logits = self._penalise(logits, rows, penalised, positions)
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
        tokens = tokens.index_select(0, rows)
        _mark(self.seen, slots, tokens)
        _count(self.counts, slots, tokens)

    def accept(self, seq: Sequence, tokens: list[int]) -> None:
        """A speculative step's verified tokens of `seq` (accepted drafts and the bonus token)."""
        slot = self.slots.get(seq.request_id)
        if slot is not None:
            slots, ids = self._tensor([slot] * len(tokens)), self._tensor(tokens)
            _mark(self.seen, slots, ids)
            _count(self.counts, slots, ids)

    def drop(self, request_id: str) -> None:
        """The request samples no more here (finished, aborted, released): its slot is free."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _penalise(self, logits: torch.Tensor, rows: list[Row], penalised: list[int],
                  positions: list[int]) -> torch.Tensor:
        slots = [self._slot(rows[i][0].seq) for i in penalised]
        at, slot_t = self._tensor(penalised), self._tensor(slots)
        specs = [rows[i][0].seq.sampling for i in penalised]
        repeat = any(s.repetition_penalty != 1.0 for s in specs)
        output = any(s.counts_output for s in specs)
        # (n, V) copies: drafts below touch only this step's rows
        seen = self.seen.index_select(0, slot_t) if repeat else None
        counts = self.counts.index_select(0, slot_t) if output else None
        drafted = [(j, d) for j, i in enumerate(penalised) for d in rows[i][0].drafts[: rows[i][1]]]
        if drafted:
            j, d = zip(*drafted)
            j, d = self._tensor(j), self._tensor(d)
            if seen is not None:
                _mark(seen, j, d)
            if counts is not None:
                _count(counts, j, d)
        x = logits.index_select(0, at)  # (n, V)
        if seen is not None:  # a row without it has p = 1: x / 1 and x * 1 are x exactly
            p = self._floats([s.repetition_penalty for s in specs])
            x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
        if counts is not None:  # likewise 0 x count subtracts exactly nothing
            frequency = self._floats([s.frequency_penalty for s in specs])
            presence = self._floats([s.presence_penalty for s in specs])
            x = x - frequency * counts - presence * (counts > 0)
            due = [(j, s.reasoning_end) for j, (i, s) in enumerate(zip(penalised, specs))
                   if 0 <= s.reasoning_budget <= positions[i]]
            if due:
                x = _close_reasoning(x, counts, self._tensor([j for j, _ in due]), self._tensor([e for _, e in due]))
        self._pending = (at, slot_t)
        return logits.index_copy(0, at, x)

    def _slot(self, seq: Sequence) -> int:
        slot = self.slots.get(seq.request_id)
        if slot is not None:
            return slot
        if not self._free:
            grown = max(8, 2 * self.seen.shape[0])
            self._free = list(range(grown - 1, self.seen.shape[0] - 1, -1))
            more = grown - self.seen.shape[0]
            self.seen = torch.cat([self.seen, self.seen.new_zeros(more, self.vocab)])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(more, self.vocab)])
        slot = self._free.pop()
        assert min(seq.token_ids) >= 0, "a sequence's first sampled step has no token in flight"
        self.slots[seq.request_id] = slot
        self.seen[slot] = False  # (a slot's previous owner may have left stale bits)
        self.counts[slot] = 0.0
        _mark(self.seen, self._tensor([slot] * seq.num_tokens), self._tensor(seq.token_ids))
        # the output so far: the last output_position ids (a continuation's output_offset of them came in its
        # prompt; prefill's first token is in a decode worker's prompt the same way)
        output = seq.token_ids[seq.num_tokens - seq.output_position:]
        if output:
            _count(self.counts, self._tensor([slot] * len(output)), self._tensor(output))
        return slot

    def _tensor(self, values: list[int] | tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _floats(self, values: list[float]) -> torch.Tensor:
        """(n, 1) float32 on the device: one value per penalised row."""
        return torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True)[:, None]


def _history(seq: Sequence) -> bool:
    """Whether the sequence's sampling reads its token history (the slot tables)."""
    return seq.sampling.repetition_penalty != 1.0 or seq.sampling.counts_output


def _close_reasoning(x: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """x (n, V) logits and counts (n, V) output occurrences (drafts included); `rows` (m,) past their budget, `end`
    (m,) their reasoning_end ids -> x with each of those rows that has not produced its end yet forced to it. All
    on the device: whether the end occurred is read from the counts there, never from the host."""
    still_open = counts.index_select(0, rows).gather(1, end[:, None]) == 0  # (m, 1)
    forced = torch.full((len(rows), x.shape[1]), float("-inf"), dtype=x.dtype, device=x.device)
    forced.scatter_(1, end[:, None], 0.0)  # (m, V): only the end token can be drawn (greedy or sampled)
    return x.index_copy(0, rows, torch.where(still_open, forced, x.index_select(0, rows)))


def _mark(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """table[rows[i], cols[i]] = True for every i, in place. A fill at flat indices: advanced-index assignment
    (table[rows, cols] = True) waits for the device on CUDA, which would stall the overlapped steps."""
    table.view(-1).index_fill_(0, rows * table.shape[1] + cols, True)


def _count(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """table[rows[i], cols[i]] += 1 for every i, in place (repeated pairs add up; whole numbers, so exact)."""
    table.view(-1).index_add_(0, rows * table.shape[1] + cols, torch.ones_like(cols, dtype=table.dtype))
