"""The scheduler driven directly, without a model (as vLLM v1's tests/v1/core/test_scheduler.py): a factory
for requests of given lengths, a fake "model step" that only returns token ids, and the block manager's
counts as the witness. Covers chunked prefill, decode batching, prefix-cache hits, overlapped commit/resolve
with its placeholders and take-back, preemption and resume, speculative accept/reject and abort."""

from __future__ import annotations

from collections.abc import Iterable

from shared import hashing
from shared.engine.api import StepOutput
from shared.engine.block_manager import BlockManager
from shared.engine.scheduler import Scheduler, StepPlan
from shared.engine.sequence import SamplingSpec, Sequence, Status

BT = 4  # small blocks keep the arithmetic readable; the scheduler takes any block size
NS = hashing.namespace("test-scheduler")
GREEDY = SamplingSpec(0.0, 0, 1.0, 0)
STOP = 7


# --- factories ----------------------------------------------------------------------------------------------


def make_scheduler(num_blocks: int = 64, max_batch_tokens: int = 64, max_running: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BT), NS, max_batch_tokens, max_running)


def make_request(rid: str, prompt: int | list[int], *, max_new: int = 4, hold: bool = False) -> Sequence:
    """A request with `prompt` tokens (a length: distinct ids per request id, so no accidental prefix hits)."""
    tokens = prompt if isinstance(prompt, list) else [10_000 * (1 + _index(rid)) + i for i in range(prompt)]
    return Sequence(rid, list(tokens), GREEDY, frozenset({STOP}), max_new, 0, hold)


def make_requests(lengths: Iterable[int], **kw: int | bool) -> list[Sequence]:
    return [make_request(f"r{i}", n, **kw) for i, n in enumerate(lengths)]  # type: ignore[arg-type]


def _index(rid: str) -> int:
    return sum(map(ord, rid))


class FakeModel:
    """A model step: for each sampled chunk, the token at the sequence's output position. Called at launch,
    before commit (as the engine samples), so a lagging (overlapped) schedule sees the same positions.
    `script[rid]` lists a request's tokens by output position; others get 100 + position."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = script or {}

    def __call__(self, plan: StepPlan) -> list[int]:
        return [self._token(c.seq) for c in plan.chunks if c.sample]

    def _token(self, seq: Sequence) -> int:
        tokens = self.script.get(seq.request_id)
        pos = seq.output_position
        return tokens[pos] if tokens is not None and pos < len(tokens) else 100 + pos


def shape(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.request_id, c.start, c.num_tokens, c.sample) for c in plan.chunks]


def step(sched: Scheduler, model: FakeModel) -> tuple[StepPlan, list[StepOutput]]:
    """One synchronous step: schedule, run, commit and resolve."""
    plan = sched.schedule()
    return plan, sched.postprocess(plan, model(plan))


def run_sync(sched: Scheduler, model: FakeModel, max_steps: int = 200) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not (sched.waiting or sched.running):
            return out
        for o in step(sched, model)[1]:
            out.setdefault(o.request_id, []).extend(o.token_ids)
    raise AssertionError("the scheduler did not finish")


def run_overlapped(sched: Scheduler, model: FakeModel, inflight: tuple[StepPlan, list[int]] | None = None,
                   max_steps: int = 200) -> dict[str, list[int]]:
    """The engine's overlapped loop: launch (schedule, sample, commit) the next step before resolving the
    previous one (`inflight`: a step already launched)."""
    out: dict[str, list[int]] = {}
    inflight = inflight or _launch(sched, model)
    for _ in range(max_steps):
        if inflight is None:
            return out
        ahead = _launch(sched, model)
        for o in sched.resolve(*inflight):
            out.setdefault(o.request_id, []).extend(o.token_ids)
        inflight = ahead or _launch(sched, model)
    raise AssertionError("the scheduler did not finish")


def _launch(sched: Scheduler, model: FakeModel) -> tuple[StepPlan, list[int]] | None:
    plan = sched.schedule()
    if not plan.chunks:
        return None
    tokens = model(plan)
    sched.commit(plan)
    return plan, tokens


def assert_all_free(sched: Scheduler) -> None:
    bm = sched.blocks
    assert bm.num_free == bm.num_blocks and all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


# --- chunked prefill and decode batching --------------------------------------------------------------------


def test_chunked_prefill_spans_steps_within_the_token_budget() -> None:
    sched = make_scheduler(max_batch_tokens=8)
    a, b = make_requests([21, 10])
    sched.add(a)
    sched.add(b)
    model = FakeModel()
    plans = [step(sched, model)[0] for _ in range(5)]
    assert [shape(p) for p in plans] == [
        [("r0", 0, 8, False)],
        [("r0", 8, 8, False)],
        [("r0", 16, 5, True), ("r1", 0, 3, False)],  # a's last chunk samples; b starts with what is left
        [("r0", 21, 1, True), ("r1", 3, 7, True)],  # decodes are planned before prefill chunks
        [("r0", 22, 1, True), ("r1", 10, 1, True)],
    ]
    assert all(sum(c.num_tokens for c in p.chunks) <= 8 for p in plans)
    assert a.token_ids[21:] == [100, 101, 102] and b.token_ids[10:] == [100, 101]


def test_a_prompt_chunk_reports_no_token_until_it_reaches_the_last_one() -> None:
    sched = make_scheduler(max_batch_tokens=4)
    sched.add(make_request("r", 9, max_new=1))
    outs = [step(sched, FakeModel())[1] for _ in range(3)]
    assert [[(o.token_ids, o.finish_reason) for o in os] for os in outs] == [
        [([], None)], [([], None)], [([100], "length")]
    ]
    assert_all_free(sched)


def test_decodes_are_batched_one_token_each_and_max_running_bounds_the_batch() -> None:
    sched = make_scheduler(max_running=2)
    for s in make_requests([5, 6, 7], max_new=3):
        sched.add(s)
    model = FakeModel()
    plan, outs = step(sched, model)
    assert shape(plan) == [("r0", 0, 5, True), ("r1", 0, 6, True)]  # the third waits for a running slot
    assert [o.token_ids for o in outs] == [[100], [100]]
    plan, _ = step(sched, model)
    assert shape(plan) == [("r0", 5, 1, True), ("r1", 6, 1, True)]
    plan, outs = step(sched, model)
    assert [o.finish_reason for o in outs] == ["length", "length"] and [s.request_id for s in sched.waiting] == ["r2"]
    assert run_sync(sched, model) == {"r2": [100, 101, 102]}
    assert_all_free(sched)


# --- prefix cache -------------------------------------------------------------------------------------------


def test_prefix_hit_reuses_full_blocks_and_counts_references() -> None:
    sched = make_scheduler(num_blocks=8)
    shared = list(range(1, 9))  # two full blocks
    a = make_request("a", shared + [50, 51], max_new=1, hold=True)
    sched.add(a)
    step(sched, FakeModel())
    assert a.status is Status.HELD and len(a.block_table) == 3  # finished, its blocks kept for export
    a_blocks = list(a.block_table)
    b = make_request("b", shared + [60, 61, 62], max_new=2)
    sched.add(b)
    plan = sched.schedule()
    assert shape(plan) == [("b", 8, 3, True)] and b.num_cached == 8  # only the tail is computed
    assert b.block_table[:2] == a_blocks[:2] and b.block_table[2] != a_blocks[2]
    assert [sched.blocks.ref_count(x) for x in b.block_table] == [2, 2, 1]
    sched.release("a")
    assert [sched.blocks.ref_count(x) for x in b.block_table] == [1, 1, 1]
    assert sched.blocks.ref_count(a_blocks[2]) == 0
    sched.postprocess(plan, FakeModel()(plan))
    sched.abort("b")
    assert_all_free(sched)
    assert sched.blocks.cached_prefix(hashing.block_hashes(shared, NS, BT)) == 2  # freed, still findable


def test_prefix_hit_never_covers_the_last_prompt_token() -> None:
    sched = make_scheduler(num_blocks=8)
    prompt = list(range(1, 9))
    sched.add(make_request("a", prompt, max_new=1))
    run_sync(sched, FakeModel())
    c = make_request("c", list(prompt), max_new=1)  # the same 8 tokens: block 1 holds the last one
    sched.add(c)
    assert shape(sched.schedule()) == [("c", 4, 4, True)] and c.num_cached == 4


# --- overlapped scheduling ----------------------------------------------------------------------------------


def test_overlapped_step_is_planned_on_placeholders_and_resolved_later() -> None:
    sched = make_scheduler()
    a, b = make_request("a", 3, max_new=3), make_request("b", 5, max_new=3)
    sched.add(a)
    sched.add(b)
    model = FakeModel({"a": [11, 12, 13], "b": [21, 22, 23]})
    p1 = sched.schedule()
    t1 = model(p1)
    sched.commit(p1)
    assert a.token_ids[3:] == [-1] and b.token_ids[5:] == [-2]  # -(r + 1): row r of the step's samples
    p2 = sched.schedule()  # launched before p1's tokens are known: its inputs are the placeholders
    assert shape(p2) == [("a", 3, 1, True), ("b", 5, 1, True)]
    t2 = model(p2)
    sched.commit(p2)
    assert a.token_ids[3:] == [-1, -1] and b.token_ids[5:] == [-2, -2]
    outs = sched.resolve(p1, t1)
    assert [(o.request_id, o.token_ids, o.finish_reason) for o in outs] == [("a", [11], None), ("b", [21], None)]
    assert a.token_ids[3:] == [11, -1] and b.token_ids[5:] == [21, -2]
    p3 = sched.schedule()
    sched.commit(p3)
    assert sched.schedule().chunks == []  # both last tokens are in flight: nothing more to plan
    sched.resolve(p2, t2)
    outs = sched.resolve(p3, model.script["a"][2:] + model.script["b"][2:])
    assert [(o.token_ids, o.finish_reason) for o in outs] == [([13], "length"), ([23], "length")]
    assert a.token_ids[3:] == [11, 12, 13] and b.token_ids[5:] == [21, 22, 23]
    assert_all_free(sched)


def test_overlapped_and_synchronous_runs_give_the_same_tokens() -> None:
    script = {"r1": [1, 2, STOP, 4, 5]}  # r1 stops at its third token, one step after it was already planned
    sync, overlapped = make_scheduler(max_batch_tokens=6), make_scheduler(max_batch_tokens=6)
    for sched in (sync, overlapped):
        for s in make_requests([9, 4, 13], max_new=5):
            sched.add(s)
    assert run_sync(sync, FakeModel(script)) == run_overlapped(overlapped, FakeModel(script)) == {
        "r0": [100, 101, 102, 103, 104], "r1": [1, 2, STOP], "r2": [100, 101, 102, 103, 104]
    }
    assert_all_free(overlapped)


def test_a_stop_found_one_step_late_takes_back_the_extra_token_and_its_block() -> None:
    sched = make_scheduler(num_blocks=8)
    a = make_request("a", 3, max_new=10, hold=True)
    sched.add(a)
    model = FakeModel({"a": [5, STOP, 9]})
    p1 = _launch(sched, model)  # computes positions 0..2, samples 5
    p2 = _launch(sched, model)  # computes 3 (block 0), samples STOP
    assert p1 is not None and p2 is not None
    assert [o.token_ids for o in sched.resolve(*p1)] == [[5]]
    p3 = _launch(sched, model)  # computes 4: a second block, for a token that will never be reported
    assert p3 is not None and len(a.block_table) == 2 and a.num_generated == 3
    outs = sched.resolve(*p2)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [([STOP], "stop")]
    assert a.status is Status.HELD and a.token_ids[3:] == [5, STOP]
    assert (a.num_generated, a.num_computed, len(a.block_table)) == (2, 4, 1)  # the extra token and block undone
    assert sched.blocks.num_free == 7
    assert sched.resolve(*p3) == []  # the taken-back token is never reported
    sched.release("a")
    assert_all_free(sched)


def test_abort_between_launch_and_resolve_drops_the_output_and_frees_every_block() -> None:
    sched = make_scheduler(num_blocks=8)
    a, b = make_requests([6, 6], max_new=4)
    sched.add(a)
    sched.add(b)
    model = FakeModel()
    p1 = _launch(sched, model)
    assert p1 is not None
    sched.abort("r0")
    outs = sched.resolve(*p1)
    assert [o.request_id for o in outs] == ["r1"] and a.block_table == []
    assert sched.blocks.num_free == 8 - len(b.block_table)
    sched.abort("r1")
    assert_all_free(sched)


# --- preemption ---------------------------------------------------------------------------------------------


def test_preemption_when_blocks_run_out_then_resume_with_the_same_tokens() -> None:
    sched = make_scheduler(num_blocks=4, max_batch_tokens=64)  # 16 token slots
    a, b = make_request("a", 8, max_new=8), make_request("b", 7, max_new=4)
    sched.add(a)
    sched.add(b)
    model = FakeModel()
    plan, outs = step(sched, model)
    assert shape(plan) == [("a", 0, 8, True), ("b", 0, 7, True)] and sched.blocks.num_free == 0
    late = make_request("late", 2, max_new=1)
    sched.add(late)
    plan, _ = step(sched, model)  # a's position 8 needs a third block: the youngest (b) gives its two back
    assert shape(plan) == [("a", 8, 1, True)]  # and nobody is admitted while preempting
    assert b.status is Status.WAITING and b.num_computed == 0 and b.block_table == [] and sched.waiting[0] is b
    assert b.token_ids[7:] == [100]  # its generated token stays: recomputed, never reported again
    assert sched.blocks.num_free == 1
    out = run_sync(sched, model)
    assert out == {"a": [102, 103, 104, 105, 106, 107], "b": [101, 102, 103], "late": [100]}
    assert_all_free(sched)


def test_preempted_while_its_token_is_in_flight_then_resolved_and_resumed() -> None:
    sched = make_scheduler(num_blocks=4)
    a, b = make_request("a", 8, max_new=5), make_request("b", 7, max_new=3)
    sched.add(a)
    sched.add(b)
    model = FakeModel({"b": [31, 32, 33]})
    p1 = _launch(sched, model)
    assert p1 is not None and b.token_ids[7:] == [-2]
    p2 = _launch(sched, model)  # a's position 8 needs a block: b goes, its first token still unknown
    assert p2 is not None and shape(p2[0]) == [("a", 8, 1, True)]
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed == 0
    outs = sched.resolve(*p1)
    assert [(o.request_id, o.token_ids) for o in outs] == [("a", [100]), ("b", [31])]
    assert b.token_ids[7:] == [31] and sched.waiting[0] is b  # the placeholder filled, to be recomputed
    rest = run_overlapped(sched, model, p2)
    assert rest == {"a": [101, 102, 103, 104], "b": [32, 33]}
    assert_all_free(sched)


def test_overlapped_runs_under_block_pressure_match_a_roomy_synchronous_run() -> None:
    script = {"r1": [1, 2, STOP], "r3": [5, STOP]}
    roomy, tight = make_scheduler(num_blocks=64), make_scheduler(num_blocks=6, max_batch_tokens=8)
    for sched in (roomy, tight):
        for s in make_requests([7, 9, 4, 6, 11], max_new=6):
            sched.add(s)
    preempted: list[str] = []
    preempt = tight._preempt
    tight._preempt = lambda s: (preempted.append(s.request_id), preempt(s))[1]  # type: ignore[method-assign]
    assert run_overlapped(tight, FakeModel(script)) == run_sync(roomy, FakeModel(script))
    assert preempted  # the tight run did have to preempt
    assert_all_free(tight)


def test_a_decode_with_no_victim_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=2, max_batch_tokens=64)
    a, b = make_request("a", 3, max_new=4), make_request("b", 4, max_new=4)
    sched.add(a)
    sched.add(b)
    step(sched, FakeModel())  # each prompt fills (part of) one block
    plan, _ = step(sched, FakeModel())  # a (scheduled first) fits; b needs a block and a is no victim now
    assert shape(plan) == [("a", 3, 1, True)]
    assert b.status is Status.WAITING and b.block_table == [] and sched.blocks.num_free == 1


# --- speculative decoding -----------------------------------------------------------------------------------


def _decoding(max_new: int = 10, prompt: int = 4) -> tuple[Scheduler, Sequence]:
    sched = make_scheduler(num_blocks=16)
    seq = make_request("s", prompt, max_new=max_new)
    sched.add(seq)
    step(sched, FakeModel({"s": [1]}))
    return sched, seq


def test_speculative_partial_accept_moves_the_length_back() -> None:
    sched, s = _decoding()
    s.drafts = [11, 12, 13]
    plan = sched.schedule()
    assert shape(plan) == [("s", 4, 4, True)] and plan.chunks[0].drafts == (11, 12, 13)
    sched.commit(plan)
    assert s.num_computed == 8 and s.token_ids[4:] == [1, -1]
    (out,) = sched.resolve(plan, [[11, 99]])  # the first draft agreed with the model, then its own token
    assert out.token_ids == [11, 99] and out.finish_reason is None
    assert s.token_ids[4:] == [1, 11, 99] and (s.num_generated, s.num_computed) == (3, 6)  # 12, 13 rejected
    s.drafts = []  # the engine's drafter replaces them after every step
    assert shape(sched.schedule()) == [("s", 6, 1, True)]


def test_speculative_full_accept_and_a_stop_inside_the_drafts() -> None:
    sched, s = _decoding()
    s.drafts = [11, 12, 13]
    plan = sched.schedule()
    (out,) = sched.postprocess(plan, [[11, 12, 13, 14]])
    assert out.token_ids == [11, 12, 13, 14] and (s.num_generated, s.num_computed) == (5, 8)
    s.drafts = [21, STOP, 23]
    (out,) = sched.postprocess(sched.schedule(), [[21, STOP, 23, 24]])
    assert (out.token_ids, out.finish_reason) == ([21, STOP], "stop")
    assert "s" not in sched.seqs
    assert_all_free(sched)


def test_speculative_drafts_never_exceed_what_may_still_be_emitted() -> None:
    sched, s = _decoding(max_new=3)
    s.drafts = [11, 12, 13]
    plan = sched.schedule()
    assert plan.chunks[0].drafts == (11,)  # 1 generated, 3 allowed: one draft plus the model's own token
    (out,) = sched.postprocess(plan, [[11, 12]])
    assert (out.token_ids, out.finish_reason) == ([11, 12], "length")
    assert_all_free(sched)


# --- abort --------------------------------------------------------------------------------------------------


def test_abort_frees_every_block_wherever_the_request_is() -> None:
    sched = make_scheduler(num_blocks=16, max_batch_tokens=8)
    shared = list(range(1, 9))
    held = make_request("held", shared + [40], max_new=1, hold=True)
    sched.add(held)
    step(sched, FakeModel())
    step(sched, FakeModel())
    assert held.status is Status.HELD
    sharing = make_request("sharing", shared + [50, 51, 52, 53, 54, 55, 56], max_new=4)  # reuses held's blocks
    prefilling = make_request("prefilling", 20)
    waiting = make_request("waiting", 5)
    for s in (sharing, prefilling, waiting):
        sched.add(s)
    sched.schedule()
    assert sharing.status is Status.RUNNING and sched.blocks.ref_count(sharing.block_table[0]) == 2
    assert prefilling.status is Status.RUNNING and waiting.status is Status.WAITING
    for rid in ("held", "sharing", "prefilling", "waiting", "unknown"):
        sched.abort(rid)
    assert not (sched.seqs or sched.running or sched.waiting or sched.held)
    assert_all_free(sched)
