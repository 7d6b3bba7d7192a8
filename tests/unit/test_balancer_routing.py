"""The balancer's routing loop against a recording fake bus and a fake clock: waits, failures, lost workers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from services.balancer.config import BalancerConfig
from services.balancer.service import BalancerService
from shared import hashing, subjects
from shared.bus import Envelope, Retry
from shared.schemas.balancer import LostQuery
from shared.schemas.generate import LOST, Cancel, DecodeJob, GenerateRequest, PrefillJob, SamplingParams, TokenEvent
from shared.schemas.events import TIER_LOCAL, TIER_SSD, KvSnapshot
from shared.schemas.workers import Heartbeat, RequestDone

MODEL = "m"
ENV = Envelope("x", None)  # type: ignore[arg-type]


class Stub:
    async def unsubscribe(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass
class FakeBus:
    submitted: list[tuple[str, Any, str]] = field(default_factory=list)
    published: list[tuple[str, Any]] = field(default_factory=list)
    fail_submit: bool = False
    name: str = "balancer-test"

    async def subscribe(self, *args: Any, **kwargs: Any) -> Stub:
        return Stub()

    async def serve(self, *args: Any, **kwargs: Any) -> Stub:
        return Stub()

    async def work_queue(self, *args: Any, **kwargs: Any) -> Stub:
        return Stub()

    async def submit(self, subject: str, message: Any, *, msg_id: str) -> None:
        if self.fail_submit:
            raise ConnectionError("down")
        self.submitted.append((subject, message, msg_id))

    async def publish(self, subject: str, message: Any, **kwargs: Any) -> None:
        if subject != subjects.PRESENCE:  # the balancer's "I am here", not what these tests watch
            self.published.append((subject, message))


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def request(rid: str, tokens: int = 40, arrival: float = 0.0) -> GenerateRequest:
    return GenerateRequest(rid, MODEL, list(range(tokens)), SamplingParams(), arrival=arrival)


def decode_job(rid: str) -> DecodeJob:
    # 40 prompt tokens: the two full 16-token blocks prefill hashed, and a tail
    return DecodeJob(request(rid), first_token=1, block_hashes=[b"h0", b"h1"], snapshot_key=b"s", cached_tokens=0,
                     prefill_worker="p")


async def heartbeat(svc: BalancerService, worker: str, clock: Clock, role: str = "prefill", **load: int) -> None:
    fields = {"queued_tokens": 0, "running": 0, "free_blocks": 100, "total_blocks": 100, **load}
    await svc._on_heartbeat(Heartbeat(worker, role, MODEL, sent_at=clock.t, **fields), ENV)


@pytest.fixture
async def setup() -> Any:
    clock, bus = Clock(), FakeBus()
    svc = BalancerService(BalancerConfig(worker_timeout_s=3.0, route_wait_s=10.0, retry_delay_s=0.5), clock=clock)
    await svc.start(bus)  # type: ignore[arg-type]
    yield svc, bus, clock
    await svc.stop()


def errors(bus: FakeBus) -> list[tuple[str, str]]:
    return [(m.request_id, m.error) for s, m in bus.published if isinstance(m, TokenEvent) and m.error_status == 503]


def lost(bus: FakeBus) -> list[tuple[str, int]]:
    """(request id, migration) of every "lost" event: the recipe resumes those requests."""
    return [(m.request_id, m.migration) for s, m in bus.published
            if isinstance(m, TokenEvent) and m.finish_reason == LOST]


async def test_no_worker_retries_then_fails_with_503(setup: Any) -> None:
    svc, bus, clock = setup
    with pytest.raises(Retry):
        await svc.route("prefill", request("r1", arrival=clock.t - 4.0))  # waited 4 s of 10 already
    clock.t += 5.0
    with pytest.raises(Retry):
        await svc.route("prefill", request("r1", arrival=clock.t - 9.0))
    clock.t += 1.5
    await svc.route("prefill", request("r1", arrival=clock.t - 10.5))
    assert errors(bus) == [("r1", "no prefill worker available")]
    assert bus.published[0][0] == subjects.tokens("r1")
    assert bus.submitted == []


async def test_places_spreads_and_ignores_redelivery(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await heartbeat(svc, "p2", clock)
    for rid in ("r1", "r2", "r3"):
        await svc.route("prefill", request(rid))
    await svc.route("prefill", request("r1"))  # redelivered after a lost ack: already placed
    placed = [(s, m.worker_id, i) for s, m, i in bus.submitted]
    assert placed == [
        (subjects.prefill_work("p1"), "p1", "r1:prefill"),
        (subjects.prefill_work("p2"), "p2", "r2:prefill"),
        (subjects.prefill_work("p1"), "p1", "r3:prefill"),
    ]
    assert all(isinstance(m, PrefillJob) for _, m, _ in bus.submitted)


async def test_lost_prefill_worker_reroutes_and_lost_decode_worker_hands_its_request_back(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await heartbeat(svc, "p2", clock, queued_tokens=10_000)
    await heartbeat(svc, "d1", clock, role="decode")
    await svc.route("prefill", request("r1"))
    await svc.route("prefill", request("r2"))
    await svc.route("decode", decode_job("r3"))
    await svc._on_done(RequestDone("r2", "p1", "prefill"), ENV)  # r2 left p1: nothing to recover
    assert [m.worker_id for _, m, _ in bus.submitted] == ["p1", "p1", "d1"]
    clock.t += 2.0
    await heartbeat(svc, "p2", clock, queued_tokens=10_000)  # only p2 stays alive
    clock.t += 2.0
    await svc.reap(clock.t)
    assert "p1" not in svc.registry and "d1" not in svc.registry
    subject, job, msg_id = bus.submitted[-1]
    assert (subject, job.request.request_id, job.worker_id, msg_id) == (
        subjects.prefill_work("p2"),
        "r1",
        "p2",
        "r1:prefill:1",
    )
    assert len(bus.submitted) == 4
    assert errors(bus) == [("r3", "worker lost")]  # with a 503, for a consumer that does not resume
    assert lost(bus) == [("r3", 0)]  # the recipe resumes it: a distinct kind, not a 503 to match by text
    assert svc.assignments.get("r1", "prefill").worker_id == "p2"  # type: ignore[union-attr]
    # nobody but the lost workers lets go: the requests live on
    assert [m for s, m in bus.published if s == subjects.CANCEL] == [
        Cancel("r1", "re-routed", worker_id="p1", role="prefill"), Cancel("r3", "worker lost", worker_id="d1", role="decode")]


async def test_lost_prefill_worker_with_no_other_worker_hands_its_request_back(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await svc.route("prefill", request("r1"))
    clock.t += 3.5
    await svc.reap(clock.t)
    assert errors(bus) == [("r1", "worker lost")] and lost(bus) == [("r1", 0)]
    assert len(svc.assignments) == 0


def cancels(bus: FakeBus) -> list[tuple[str, str]]:
    return [(m.request_id, m.reason) for s, m in bus.published if s == subjects.CANCEL and isinstance(m, Cancel)]


async def test_every_failure_it_sends_the_client_is_also_a_cancel(setup: Any) -> None:
    svc, bus, clock = setup
    await svc.route("prefill", request("r1", arrival=clock.t - 10.5))  # no worker, waited out
    await heartbeat(svc, "d1", clock, role="decode")
    await svc.route("decode", decode_job("r2"))
    clock.t += 3.5
    await svc.reap(clock.t)  # d1 silent: r2 is handed back (to resume), d1 alone lets go of it
    assert errors(bus) == [("r1", "no prefill worker available"), ("r2", "worker lost")]
    assert [m for s, m in bus.published if s == subjects.CANCEL] == [
        Cancel("r1", "no prefill worker available"), Cancel("r2", "worker lost", worker_id="d1", role="decode")]


async def test_a_continuation_is_routed_as_a_new_migration_and_the_old_one_cannot_disturb_it(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await heartbeat(svc, "d1", clock, role="decode")
    await svc.route("prefill", request("r1"))
    await svc.route("decode", decode_job("r1"))
    clock.t += 2.0
    await heartbeat(svc, "p1", clock)
    await heartbeat(svc, "d2", clock, role="decode")
    clock.t += 2.0
    await svc.reap(clock.t)  # d1 lost mid-decode
    assert lost(bus) == [("r1", 0)]
    # the recipe resumes r1: prompt + 5 streamed tokens, as migration 1
    original = request("r1")
    resumed = dataclasses.replace(original, prompt_ids=original.prompt_ids + [7] * 5, output_offset=5, migration=1)
    await svc.route("prefill", resumed)
    await svc.route("prefill", original)  # a late redelivery of migration 0: the request moved past it
    await svc.route("decode", dataclasses.replace(decode_job("r1"), request=resumed))
    await svc.route("decode", decode_job("r1"))  # migration 0's hand-off again: dropped as well
    ids = [i for _, _, i in bus.submitted]
    assert ids == ["r1:prefill", "r1:decode", "r1:prefill:m1", "r1:decode:m1"]  # none in another's dedup window
    assert bus.submitted[-1][1].worker_id == "d2"
    await svc._on_done(RequestDone("r1", "d2", "decode", migration=0), ENV)  # an old run's end on d2
    assert svc.assignments.get("r1", "decode").migration == 1  # type: ignore[union-attr]
    clock.t += 2.0
    await heartbeat(svc, "p1", clock)
    clock.t += 2.0
    await svc.reap(clock.t)  # d2 lost too: the second loss names migration 1
    assert lost(bus) == [("r1", 0), ("r1", 1)]
    assert Cancel("r1", "worker lost", worker_id="d2", migration=1, role="decode") in [m for _, m in bus.published]


async def test_a_lost_worker_that_comes_back_is_told_again_what_ended_while_it_was_gone(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "d1", clock, role="decode")
    await heartbeat(svc, "d2", clock, role="decode")
    await svc.route("decode", decode_job("r1"))
    lost = svc.assignments.get("r1", "decode").worker_id  # type: ignore[union-attr]
    other = "d2" if lost == "d1" else "d1"
    clock.t += 2.0
    await heartbeat(svc, other, clock, role="decode")
    clock.t += 2.0
    await svc.reap(clock.t)
    await heartbeat(svc, other, clock, role="decode")  # still in the pool: no rejoin, nothing sent again
    assert cancels(bus) == [("r1", "worker lost")]
    await heartbeat(svc, lost, clock, role="decode")  # restarted: its redelivered job for r1 must not run
    assert cancels(bus) == [("r1", "worker lost")] * 2
    clock.t += 4.0
    await svc.reap(clock.t)
    await heartbeat(svc, lost, clock, role="decode")  # a second return: already told
    assert cancels(bus) == [("r1", "worker lost")] * 2


async def test_a_restarting_worker_asks_what_moved_on_before_its_first_job(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await svc.route("prefill", request("r1"))
    clock.t += 4.0
    await svc.reap(clock.t)  # p1 lost, no other worker: r1 is handed back to resume
    moved = [m for s, m in bus.published if s == subjects.CANCEL]
    assert (await svc._lost(LostQuery("p1"))).cancels == moved == [Cancel("r1", "worker lost", "p1", role="prefill")]
    assert (await svc._lost(LostQuery("p2"))).cancels == []
    assert (await svc._lost(LostQuery("p1"))).cancels == moved  # asking keeps them: the rejoin sends them again
    await heartbeat(svc, "p1", clock)
    assert (await svc._lost(LostQuery("p1"))).cancels == []


async def test_a_rerouted_request_is_let_go_by_the_lost_worker_alone(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await svc.route("prefill", request("r1"))
    clock.t += 2.0
    await heartbeat(svc, "p2", clock)
    clock.t += 2.0
    await svc.reap(clock.t)  # p1 silent: r1 goes to p2
    targeted = [m for s, m in bus.published if s == subjects.CANCEL]
    assert targeted == [Cancel("r1", "re-routed", worker_id="p1", role="prefill")]
    await svc._on_cancel(targeted[0], ENV)  # its own broadcast comes back: the request lives on at p2
    assert svc.assignments.get("r1", "prefill").worker_id == "p2"  # type: ignore[union-attr]
    await heartbeat(svc, "p1", clock)  # p1 restarted: its redelivered job for r1 must not run there
    assert [m for s, m in bus.published if s == subjects.CANCEL] == targeted * 2
    assert errors(bus) == []


async def test_decode_waits_for_room_and_clears_the_prefill_assignment(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await heartbeat(svc, "d1", clock, role="decode", free_blocks=2)
    await svc.route("prefill", request("r1"))
    with pytest.raises(Retry):  # 41 tokens need 3 blocks; d1 has 2
        await svc.route("decode", decode_job("r1"))
    assert svc.assignments.get("r1", "prefill") is None  # prefill handed the request on
    await heartbeat(svc, "d1", clock, role="decode", free_blocks=50)
    await svc.route("decode", decode_job("r1"))
    subject, job, msg_id = bus.submitted[-1]
    assert (subject, job.worker_id, msg_id) == (subjects.decode_work("d1"), "d1", "r1:decode")


async def test_cancelled_requests_are_dropped_and_forgotten(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await svc.route("prefill", request("r1"))
    await svc._on_cancel(Cancel("r1"), ENV)
    await svc._on_cancel(Cancel("r2"), ENV)
    await svc.route("prefill", request("r2"))  # still queued when the cancel came: never placed
    assert len(bus.submitted) == 1 and len(svc.assignments) == 0
    clock.t += 3.5
    await svc.reap(clock.t)
    assert errors(bus) == []  # r1 was cancelled: nothing to fail


async def test_failed_submit_leaves_no_bookkeeping(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    bus.fail_submit = True
    with pytest.raises(ConnectionError):
        await svc.route("prefill", request("r1"))
    assert len(svc.assignments) == 0
    assert svc.registry.candidates("prefill", MODEL, clock.t)[0].pending_tokens == 0


def test_rejects_unknown_roles() -> None:
    with pytest.raises(ValueError):
        BalancerConfig(("prefill", "vision-typo"))


# --- cache-aware prefill, decode affinity, policies by name ------------------------------------------------------


async def cache_beat(svc: BalancerService, worker: str, clock: Clock, role: str = "prefill", queued: int = 0,
                     free: int = 100) -> None:
    beat = Heartbeat(worker, role, MODEL, queued, 0, free, 100, sent_at=clock.t, cache_id="cid", block_tokens=16)
    await svc._on_heartbeat(beat, ENV)


def holds(svc: BalancerService, worker: str, tokens: list[int], tier: str = TIER_LOCAL) -> None:
    keys = hashing.block_hashes(tokens, hashing.namespace("cid"), 16)
    svc.index.load(KvSnapshot(worker, "e", 0, "s", {tier: keys}))


async def test_prefill_goes_to_the_worker_holding_the_prefix_and_counts_only_what_it_computes(setup: Any) -> None:
    svc, bus, clock = setup
    for w in ("p1", "p2", "p3"):
        await cache_beat(svc, w, clock, queued=50 if w == "p2" else 0)
    prompt = list(range(200))  # 12 full blocks and a tail
    holds(svc, "p2", prompt[:160])  # 10 blocks in p2's own cache
    holds(svc, "kv", prompt[:192], tier=TIER_SSD)  # all 12 in the shared store (so p1/p3 could load them)
    await svc.route("prefill", GenerateRequest("r1", MODEL, prompt, SamplingParams()))
    # p2: 200 - 160 - 0.75 * 32 + 50 = 66; p1, p3: 200 - 0.75 * 192 = 56: p2's queue outweighs its cache.
    assert bus.submitted[-1][1].worker_id == "p1"
    await cache_beat(svc, "p2", clock)  # p2's queue drained: 16 against p1's 56 + 8 pending
    await svc.route("prefill", GenerateRequest("r2", MODEL, prompt, SamplingParams()))
    assert bus.submitted[-1][1].worker_id == "p2"
    loads = {w.worker_id: w.pending_tokens for w in svc.registry.candidates("prefill", MODEL, clock.t)}
    assert loads == {"p1": 8, "p2": 8, "p3": 0}  # what each computes itself: 200 - 192 loaded or cached
    assert (svc.stats["local_hit_tokens_prefill"], svc.stats["store_hit_tokens_prefill"]) == (160, 192 + 32)


async def test_a_follow_up_turn_decodes_where_the_previous_one_did(setup: Any) -> None:
    svc, bus, clock = setup
    await cache_beat(svc, "d1", clock, role="decode", free=90)
    await cache_beat(svc, "d2", clock, role="decode", free=80)
    first = list(range(40))
    keys = hashing.block_hashes(first, hashing.namespace("cid"), 16)
    job = DecodeJob(GenerateRequest("t1", MODEL, first, SamplingParams()), 1, keys, b"", 0, "p")
    await svc.route("decode", job)
    assert bus.submitted[-1][1].worker_id == "d1"
    await svc._on_done(RequestDone("t1", "d1", "decode"), ENV)
    await cache_beat(svc, "d2", clock, role="decode", free=99)  # d2 is now the roomier one
    follow = first + list(range(500, 530))
    keys = hashing.block_hashes(follow, hashing.namespace("cid"), 16)
    job = DecodeJob(GenerateRequest("t2", MODEL, follow, SamplingParams()), 1, keys, b"", 0, "p")
    await svc.route("decode", job)
    assert bus.submitted[-1][1].worker_id == "d1" and svc.stats["affinity_decode"] == 1
    stranger = DecodeJob(GenerateRequest("t3", MODEL, list(range(900, 970)), SamplingParams()), 1, [], b"", 0, "p")
    await svc.route("decode", stranger)
    assert bus.submitted[-1][1].worker_id == "d2"


async def test_policies_are_chosen_by_name() -> None:
    clock, bus = Clock(), FakeBus()
    svc = BalancerService(BalancerConfig(("prefill",), prefill_policy="round-robin"), clock=clock)
    await svc.start(bus)  # type: ignore[arg-type]
    for w in ("p1", "p2"):
        await cache_beat(svc, w, clock, queued=0 if w == "p2" else 10_000)
    for rid in ("r1", "r2", "r3"):
        await svc.route("prefill", request(rid))
    assert [m.worker_id for _, m, _ in bus.submitted] == ["p1", "p2", "p1"]  # load and caches ignored
    await svc.stop()
    with pytest.raises(ValueError):
        BalancerConfig(("prefill",), prefill_policy="psychic")



async def test_a_client_that_hangs_up_during_a_migration_gets_no_continuation_placed(setup: Any) -> None:
    svc, bus, clock = setup
    await heartbeat(svc, "p1", clock)
    await heartbeat(svc, "d1", clock, role="decode")
    await svc.route("decode", decode_job("r1"))
    clock.t += 2.0
    await heartbeat(svc, "p1", clock)
    clock.t += 2.0
    await svc.reap(clock.t)  # d1 lost: r1 handed back to the recipe, which resumes it
    assert lost(bus) == [("r1", 0)]
    await svc._on_cancel(Cancel("r1", "client disconnected"), ENV)  # ...and then the client leaves
    original = request("r1")
    await svc.route("prefill", dataclasses.replace(original, prompt_ids=original.prompt_ids + [7], output_offset=1,
                                                  migration=1))
    assert [i for _, _, i in bus.submitted] == ["r1:decode"] and len(svc.assignments) == 0
