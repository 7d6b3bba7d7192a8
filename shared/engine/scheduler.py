"""Which tokens of which sequences to compute this step: decode first, then prefill chunks, under a budget.

Every sequence just has `num_computed` of its `num_tokens` tokens in the KV cache (vLLM v1 style); a step
computes tokens[num_computed : num_computed + n] for each scheduled sequence: n = 1 when decoding, a chunk of
up to the remaining budget when prefilling. A sequence samples when its chunk reaches its last token.
When blocks run out, the youngest unscheduled running sequence is preempted: its blocks are freed and it waits
again at the head of the queue, to be recomputed (mostly from the local prefix cache) later.

A step's results are applied in two halves, so the next step can be planned while this one still runs on the
device (overlapped scheduling):

    commit(plan)            at launch: num_computed advances; every sampled chunk appends a placeholder token
                            -(r + 1), r = its row in the step's sampled tokens (the next step's input reads that
                            row from the device); a sequence that reaches max_new_tokens is not scheduled again
    resolve(plan, tokens)   when the tokens are on the host: placeholders filled, blocks published, stop/length
                            checked; a sequence that stopped but was already scheduled for one more token (the
                            one-step lag) has that extra token taken back, never reported

postprocess() is the two back to back (the synchronous path).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.engine.api import StepOutput
from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int  # first position computed
    num_tokens: int
    sample: bool  # the chunk ends at the sequence's last token: its logits give the next token
    drafts: tuple[int, ...] = ()  # speculative tokens after the last one: every row is sampled and verified


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    imports: list[tuple[int, bytes]] = field(default_factory=list)  # (block, blob) to write before the forward

    @property
    def num_sampled(self) -> int:
        return sum(c.sample for c in self.chunks)


def _done(seq: Sequence) -> bool:
    """The sequence's last token is already committed (in flight): it only waits to be resolved."""
    return seq.num_generated >= seq.max_new_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, ns: bytes, max_batch_tokens: int, max_running: int,
                 resume: Callable[[Sequence, int], int] | None = None) -> None:
        """resume(seq, restored): the position to compute from when `restored` tokens' blocks are in place
        (default: `restored` itself)."""
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be positive")
        self.resume = resume or (lambda seq, restored: restored)
        self.blocks = blocks
        self.ns = ns  # namespace of the local prefix cache's chained hashes
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.bt = blocks.block_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the youngest is preempted first
        self.held: dict[str, Sequence] = {}
        self.seqs: dict[str, Sequence] = {}

    # --- lifecycle --------------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        assert seq.request_id not in self.seqs
        self.seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            del self.held[request_id]
        self._drop_blocks(seq)
        return seq

    def release(self, request_id: str) -> Sequence | None:
        seq = self.held.get(request_id)
        return None if seq is None else self.abort(request_id)

    def queued_tokens(self) -> int:
        waiting = sum(s.num_tokens - max(s.num_computed, s.prefix_tokens) for s in self.waiting)
        return waiting + sum(s.num_remaining for s in self.running if s.num_remaining > 1)

    # --- one step ---------------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batch_tokens
        scheduled: set[Sequence] = set()
        preempted = False
        for decoding in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not Status.RUNNING or (seq.num_remaining == 1) != decoding or _done(seq):
                    continue  # preempted earlier in this loop, not in this pass, or its last token is in flight
                # a decode verifies its speculative drafts in the same chunk (never more than it may still emit)
                drafts = seq.drafts[: max(0, seq.max_new_tokens - seq.num_generated - 1)] if decoding else []
                n, evicted = self._reserve(seq, min(seq.num_remaining + len(drafts), budget), scheduled)
                preempted |= evicted
                if n:
                    drafts = drafts[: n - 1] if decoding else []
                    plan.chunks.append(Chunk(seq, seq.num_computed, n, seq.num_computed + n - len(drafts)
                                             == seq.num_tokens, tuple(drafts)))
                    # drafts follow the sequence's last token: once scheduled they are spent (an overlapped next
                    # step, scheduled before the drafter has seen this one's token, must not verify them again)
                    seq.drafts = []
                    scheduled.add(seq)
                    budget -= n
        # Admitting while preempting would hand the freed blocks straight back to a newcomer and thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = self._admit(seq, budget, plan)
            if n == 0:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(seq)
            plan.chunks.append(Chunk(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
            budget -= n
        return plan

    def postprocess(self, plan: StepPlan, sampled: list[int]) -> list[StepOutput]:
        self.commit(plan)
        return self.resolve(plan, sampled)

    def commit(self, plan: StepPlan) -> None:
        """The step is launched: its KV is (being) computed and each sampled chunk owes one token."""
        row = 0
        for chunk in plan.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            if chunk.sample:
                row += 1
                seq.token_ids.append(-row)  # placeholder -(r + 1) for sampled row r
                seq.num_generated += 1

    def resolve(self, plan: StepPlan, sampled: list[int] | list[int | list[int]]) -> list[StepOutput]:
        """The committed step's tokens are known: fill them in, publish blocks, finish sequences.

        A chunk with drafts gets a list: the drafts the model agreed with, then its own next token."""
        assert len(sampled) == plan.num_sampled
        tokens = iter(sampled)
        outputs = []
        for chunk in plan.chunks:
            seq = chunk.seq
            token = next(tokens) if chunk.sample else None
            if self.seqs.get(seq.request_id) is not seq or seq.status is Status.HELD:
                continue  # aborted since the launch, or finished a step earlier (this was its extra token)
            new: list[int] = []
            reason = None
            if isinstance(token, list):
                new, reason = self._accept(seq, chunk, token)
            elif token is not None:
                at = chunk.start + chunk.num_tokens  # index of the sampled token in token_ids
                seq.token_ids[at] = token
                new = [token]
                if token in seq.stop_ids:
                    reason = "stop"
                elif seq.num_generated - (seq.num_tokens - 1 - at) >= seq.max_new_tokens:
                    reason = "length"
                if reason is not None and seq.num_tokens > at + 1:
                    self._take_back(seq)  # stopped, yet already computing one more token: drop it
            self._publish(seq)
            if reason is not None:
                self._finish(seq)
            outputs.append(StepOutput(seq.request_id, new, reason, seq.num_cached or 0))
        return outputs

    def _accept(self, seq: Sequence, chunk: Chunk, new: list[int]) -> tuple[list[int], str | None]:
        """A verified speculative chunk (synchronous steps only): the placeholder becomes the accepted drafts
        and the bonus token, up to a stop token or the length limit; rejected drafts' KV is taken back."""
        assert 1 <= len(new) <= len(chunk.drafts) + 1 and all(t >= 0 for t in new)
        at = chunk.start + 1  # the placeholder commit() appended
        before = seq.num_generated - 1
        reason = None
        for i, token in enumerate(new):
            if token in seq.stop_ids:
                reason = "stop"
            elif before + i + 1 >= seq.max_new_tokens:
                reason = "length"
            if reason is not None:
                new = new[: i + 1]
                break
        seq.token_ids[at:] = new
        seq.num_generated = before + len(new)
        seq.num_computed = at + len(new) - 1  # the last token and the accepted drafts have KV; the bonus not yet
        return new, reason

    # --- internals --------------------------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, n: int, scheduled: set[Sequence]) -> tuple[int, bool]:
        """Blocks for `n` more tokens of a running sequence: (tokens granted, whether anyone was preempted).

        A prefill takes a shorter chunk if that is all that fits; a decode preempts younger sequences, and
        itself as a last resort (its blocks then help the others).
        """
        evicted = False
        while not self.blocks.grow(seq.block_table, seq.num_computed + n):
            fit = (len(seq.block_table) + self.blocks.num_free) * self.bt - seq.num_computed
            if n > 1 and fit > 0:
                n = fit
                continue
            # (a sequence whose last token is in flight finishes at the next resolve: never a victim)
            victim = next((s for s in reversed(self.running) if s is not seq and s not in scheduled and not _done(s)),
                          None)
            if victim is None:
                if n == 1:
                    self._preempt(seq)
                    evicted = True
                return 0, evicted
            self._preempt(victim)
            evicted = True
        return n, evicted

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Give a waiting sequence its cached/imported prefix and blocks for a first chunk; 0 if it must wait."""
        # Reuse local blocks only strictly before the last token: its logits have to be computed, and
        # recomputing it must never write into a block that other sequences share.
        hashes = seq.block_hashes(seq.ns or self.ns, (seq.num_tokens - 1) // self.bt, self.bt)
        table = self.blocks.match(hashes)
        computed = len(table) * self.bt
        imports: list[tuple[int, bytes]] = []
        if seq.prefix_tokens > computed:
            blobs = seq.prefix_blobs[len(table) :]
            # b"" stands for a block the sender expected this engine to hold (and did not fetch): if it no
            # longer does, the imported prefix ends there and the rest is computed
            blobs = blobs[: next((i for i, b in enumerate(blobs) if not b), len(blobs))]
            fresh = self.blocks.allocate(len(blobs))
            if fresh is None:
                self.blocks.free(table)
                return 0
            imports = list(zip(fresh, blobs))
            table += fresh
            computed = min(seq.prefix_tokens, len(table) * self.bt, seq.num_tokens - 1)
        # The model may need to recompute some tokens before `computed` (V4's bounded replay rebuilds the
        # short-term state that the blocks do not hold); their blocks stay in the table, read-only.
        start = self.resume(seq, computed)
        n = min(seq.num_tokens - start, budget, (len(table) + self.blocks.num_free) * self.bt - start)
        if n <= 0 or not self.blocks.grow(table, start + n):
            self.blocks.free(table)
            return 0
        seq.block_table = table
        seq.num_computed = start
        if seq.num_cached is None:
            seq.num_cached = start
        seq.prefix_blobs, seq.prefix_tokens = [], 0  # imported now; a preempted sequence recomputes instead
        seq.status = Status.RUNNING
        plan.imports += imports
        return n

    def _preempt(self, seq: Sequence) -> None:
        seq.drafts = []
        self.running.remove(seq)
        self._drop_blocks(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _take_back(self, seq: Sequence) -> None:
        """Undo the commit of a decode step that came one token too late (the overlapped path's lag)."""
        assert seq.status is Status.RUNNING and seq.num_remaining == 1
        seq.token_ids.pop()
        seq.num_generated -= 1
        seq.num_computed -= 1
        keep = -(-seq.num_computed // self.bt)
        self.blocks.free(seq.block_table[keep:])  # the in-flight write to it precedes any reuse on the stream
        del seq.block_table[keep:]

    def _finish(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING:  # preempted while its last token was in flight
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        if seq.hold_kv:
            seq.status = Status.HELD
            self.held[seq.request_id] = seq
        else:
            del self.seqs[seq.request_id]
            self._drop_blocks(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.num_published = 0

    def _publish(self, seq: Sequence) -> None:
        """Offer every full, computed block to the local prefix cache."""
        full = seq.num_computed // self.bt
        if full > seq.num_published:
            hashes = seq.block_hashes(seq.ns or self.ns, full, self.bt)
            for i in range(seq.num_published, full):
                self.blocks.publish(seq.block_table[i], hashes[i])
            seq.num_published = full
