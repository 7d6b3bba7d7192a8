"""Balancer decisions without a broker: registry expiry and corrections, both policies, assignment bookkeeping."""

from __future__ import annotations

from services.balancer.assignments import Assignment, Assignments
from services.balancer.policies import POLICIES, Demand
from services.balancer.policies.decode import MostFreeBlocks
from services.balancer.policies.prefill import LeastCost, prefill_cost
from services.balancer.registry import WorkerLoad, WorkerRegistry
from shared.schemas.workers import Heartbeat

MODEL = "m"


def beat(worker: str, sent_at: float, role: str = "prefill", model: str = MODEL, **load: int) -> Heartbeat:
    fields = {"queued_tokens": 0, "running": 0, "free_blocks": 100, "total_blocks": 100, **load}
    return Heartbeat(worker_id=worker, role=role, model=model, sent_at=sent_at, **fields)


def load(worker: str, **fields: int) -> WorkerLoad:
    base = {"queued_tokens": 0, "running": 0, "free_blocks": 100, "total_blocks": 100, **fields}
    return WorkerLoad(worker_id=worker, role="x", model=MODEL, **base)


# --- registry ----------------------------------------------------------------------------------------------------


def test_registry_joins_and_expires_silent_workers() -> None:
    reg = WorkerRegistry(timeout_s=3.0)
    assert reg.observe(beat("a", 100.0), now=100.0)
    assert reg.observe(beat("b", 101.0), now=101.0)
    assert not reg.observe(beat("a", 102.0), now=102.0)
    assert [w.worker_id for w in reg.candidates("prefill", MODEL, now=103.5)] == ["a", "b"]
    # b was last seen at 101: past the timeout at 104.5, even before expire() runs.
    assert [w.worker_id for w in reg.candidates("prefill", MODEL, now=104.5)] == ["a"]
    assert reg.expire(now=104.5) == ["b"]
    assert "b" not in reg and "a" in reg
    assert reg.expire(now=105.5) == ["a"]
    assert reg.observe(beat("a", 106.0), now=106.0)  # a worker that comes back rejoins


def test_registry_filters_by_role_and_model() -> None:
    reg = WorkerRegistry(timeout_s=3.0)
    reg.observe(beat("p", 0.0), now=0.0)
    reg.observe(beat("d", 0.0, role="decode"), now=0.0)
    reg.observe(beat("other", 0.0, model="bigger"), now=0.0)
    assert [w.worker_id for w in reg.candidates("prefill", MODEL, 0.0)] == ["p"]
    assert [w.worker_id for w in reg.candidates("decode", MODEL, 0.0)] == ["d"]
    assert reg.candidates("prefill", "unknown", 0.0) == []
    assert reg.counts() == {"prefill": 2, "decode": 1}


def test_assignments_since_last_heartbeat_count_until_a_later_heartbeat() -> None:
    reg = WorkerRegistry(timeout_s=3.0)
    reg.observe(beat("a", 10.0, queued_tokens=50), now=10.0)
    reg.assign("a", tokens=100, blocks=7, now=10.2)
    reg.assign("a", tokens=30, blocks=2, now=10.6)
    (a,) = reg.candidates("prefill", MODEL, 10.7)
    assert (a.queued_tokens, a.pending_tokens, a.pending_requests, a.pending_blocks) == (50, 130, 2, 9)
    # A beat sent at 10.4 reflects the first assignment but not the second.
    reg.observe(beat("a", 10.4, queued_tokens=150), now=10.8)
    (a,) = reg.candidates("prefill", MODEL, 10.8)
    assert (a.queued_tokens, a.pending_tokens) == (150, 30)
    # An older beat overtaken on the wire changes nothing but liveness.
    reg.observe(beat("a", 10.1, queued_tokens=0), now=10.9)
    assert reg.candidates("prefill", MODEL, 10.9)[0].queued_tokens == 150


def test_unassign_undoes_a_correction() -> None:
    reg = WorkerRegistry(timeout_s=3.0)
    reg.observe(beat("a", 0.0), now=0.0)
    pending = reg.assign("a", tokens=10, blocks=0, now=0.1)
    assert pending is not None
    reg.unassign("a", pending)
    assert reg.candidates("prefill", MODEL, 0.2)[0].pending_tokens == 0
    assert reg.assign("gone", tokens=1, blocks=0, now=0.2) is None


# --- prefill policy ----------------------------------------------------------------------------------------------


def test_prefill_picks_least_loaded_and_breaks_ties_by_id() -> None:
    policy = LeastCost()
    demand = Demand(prompt_tokens=100)
    assert policy.choose([], demand) is None
    workers = [load("b", queued_tokens=10), load("a", queued_tokens=10), load("c", queued_tokens=500)]
    assert policy.choose(workers, demand).worker_id == "a"  # type: ignore[union-attr]
    # Work sent since the last heartbeat counts: a is now the busier one.
    workers[1] = load("a", queued_tokens=10, pending_tokens=100)
    assert policy.choose(workers, demand).worker_id == "b"  # type: ignore[union-attr]


def test_prefill_burst_spreads_with_corrections() -> None:
    reg = WorkerRegistry(timeout_s=3.0)
    for w in ("a", "b", "c"):
        reg.observe(beat(w, 0.0), now=0.0)
    policy = LeastCost()
    chosen = []
    for _ in range(6):  # no heartbeat in between: only the corrections tell the workers apart
        choice = policy.choose(reg.candidates("prefill", MODEL, 0.1), Demand(prompt_tokens=100))
        assert choice is not None
        reg.assign(choice.worker_id, tokens=100, blocks=0, now=0.1)
        chosen.append(choice.worker_id)
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_prefill_cost_has_a_cache_overlap_term() -> None:
    demand = Demand(prompt_tokens=1000, cached_tokens={"warm": 800})
    warm, cold = load("warm", queued_tokens=300), load("cold", queued_tokens=0)
    assert prefill_cost(cold, demand) == 1000
    assert prefill_cost(warm, demand) == 200 + 300
    assert LeastCost().choose([cold, warm], demand).worker_id == "warm"  # type: ignore[union-attr]
    assert LeastCost(overlap_weight=0.0).choose([cold, warm], demand).worker_id == "cold"  # type: ignore[union-attr]


# --- decode policy -----------------------------------------------------------------------------------------------


def test_decode_prefers_free_blocks_then_fewest_running() -> None:
    policy = MostFreeBlocks()
    demand = Demand(prompt_tokens=33, blocks_needed=3)
    assert policy.choose([], demand) is None
    workers = [load("a", free_blocks=50, running=1), load("b", free_blocks=80, running=9)]
    assert policy.choose(workers, demand).worker_id == "b"  # type: ignore[union-attr]
    workers = [load("a", free_blocks=80, running=4), load("b", free_blocks=80, running=2)]
    assert policy.choose(workers, demand).worker_id == "b"  # type: ignore[union-attr]
    # Blocks promised since the heartbeat are not free: b now has 40, a 80.
    workers = [load("a", free_blocks=80, running=4), load("b", free_blocks=80, pending_blocks=40, pending_requests=1)]
    assert policy.choose(workers, demand).worker_id == "a"  # type: ignore[union-attr]


def test_decode_never_picks_a_worker_without_room_for_the_prompt() -> None:
    policy = MostFreeBlocks()
    workers = [load("a", free_blocks=4), load("b", free_blocks=10, pending_blocks=7)]
    assert policy.choose(workers, Demand(prompt_tokens=80, blocks_needed=5)) is None
    fits = policy.choose(workers, Demand(prompt_tokens=64, blocks_needed=4))
    assert fits is not None and fits.worker_id == "a"
    assert policy.choose(workers, Demand(prompt_tokens=0)).worker_id == "a"  # type: ignore[union-attr]


def test_policies_are_registered_by_name() -> None:
    assert isinstance(POLICIES["least-cost"](), LeastCost)
    assert isinstance(POLICIES["most-free-blocks"](), MostFreeBlocks)


# --- assignments -------------------------------------------------------------------------------------------------


def assignment(rid: str, worker: str, role: str = "prefill", at: float = 0.0, ttl: float = 10.0) -> Assignment:
    return Assignment(rid, role, worker, job=None, at=at, expires_at=at + ttl)


def test_assignments_by_worker_done_cancel_and_ttl() -> None:
    table = Assignments()
    table.add(assignment("r1", "a", at=1.0))
    table.add(assignment("r2", "a", at=0.5))
    table.add(assignment("r3", "b"))
    table.add(assignment("r3", "c", role="decode"))
    assert table.drop("r3", "prefill", worker_id="other") is None  # done from a worker that no longer holds it
    assert table.drop("r3", "prefill", worker_id="b") is not None
    assert [a.request_id for a in table.take_worker("a")] == ["r2", "r1"]  # oldest first
    assert table.take_worker("a") == []
    table.cancel("r3", ["prefill", "decode"], now=2.0)
    assert len(table) == 0 and table.is_cancelled("r3")
    table.add(assignment("r4", "d", at=0.0, ttl=5.0))
    assert table.expire(now=4.9) == 0 and table.expire(now=5.0) == 1
    table.expire(now=1000.0)
    assert not table.is_cancelled("r3")
