"""Balancer decisions without a broker: registry expiry and corrections, the policies, what each worker has cached
of a prompt, session affinity, assignment bookkeeping."""

from __future__ import annotations

from collections import Counter

import pytest

from services.balancer.affinity import SessionAffinity
from services.balancer.assignments import Assignment, Assignments
from services.balancer.policies import POLICIES, Demand, PolicySettings
from services.balancer.policies.decode import AffinityThenFreeBlocks, MostFreeBlocks
from services.balancer.policies.prefill import LeastCost, Random, RoundRobin, prefill_cost
from services.balancer.prefix import prefix_hits
from services.balancer.registry import WorkerLoad, WorkerRegistry
from shared import hashing
from services.balancer.prefix_index import PrefixIndex
from shared.schemas.events import OP_STORED, TIER_LOCAL, TIER_RAM, TIER_SSD, KvEvent, KvSnapshot
from shared.schemas.workers import Heartbeat

MODEL = "m"


def beat(worker: str, sent_at: float, role: str = "prefill", model: str = MODEL, **load: int) -> Heartbeat:
    fields = {"queued_tokens": 0, "running": 0, "free_blocks": 100, "total_blocks": 100, **load}
    return Heartbeat(worker_id=worker, role=role, model=model, sent_at=sent_at, **fields)


def load(worker: str, **fields: int) -> WorkerLoad:
    base = {"queued_tokens": 0, "running": 0, "free_blocks": 100, "total_blocks": 100, **fields}
    return WorkerLoad(worker_id=worker, role="x", model=MODEL, **base)  # type: ignore[arg-type]


def pick(policy: object, workers: list[WorkerLoad], demand: Demand) -> str:
    choice = policy.choose(workers, demand)  # type: ignore[attr-defined]
    assert choice is not None
    return str(choice.worker_id)


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


def test_prefill_prefers_the_longest_local_prefix_unless_its_queue_outweighs_it() -> None:
    policy = LeastCost()
    demand = Demand(prompt_tokens=1000, cached_tokens={"warm": 640, "lukewarm": 320})
    warm, lukewarm, cold = load("warm", queued_tokens=200), load("lukewarm"), load("cold")
    # warm: 360 + 200 = 560; lukewarm: 680; cold: 1000
    assert pick(policy, [cold, lukewarm, warm], demand) == "warm"
    # warm's queue grows past what its prefix saves: 360 + 400 = 760 > 680
    warm = load("warm", queued_tokens=200, pending_tokens=200)
    assert pick(policy, [cold, lukewarm, warm], demand) == "lukewarm"


def test_a_store_hit_counts_less_than_a_local_hit_and_ssd_less_than_ram() -> None:
    weights = {TIER_RAM: 0.1, TIER_SSD: 0.25}
    policy = LeastCost(tier_weights=weights)
    local = Demand(prompt_tokens=1000, cached_tokens={"a": 800})
    ssd = Demand(prompt_tokens=1000, store_tokens={"a": {TIER_SSD: 800}})
    ram = Demand(prompt_tokens=1000, store_tokens={"a": {TIER_RAM: 800}})
    a = load("a")
    assert prefill_cost(a, local, tier_weights=weights) == 200
    assert prefill_cost(a, ram, tier_weights=weights) == pytest.approx(200 + 80)
    assert prefill_cost(a, ssd, tier_weights=weights) == pytest.approx(200 + 200)
    assert prefill_cost(a, Demand(1000, store_tokens={"a": {"tape": 800}}), tier_weights=weights) == 400  # unknown
    # Same prompt, same store for everyone: a holds 640 tokens locally and loads 160 from SSD; b loads all 800.
    store = {"a": {TIER_SSD: 160}, "b": {TIER_SSD: 800}}
    demand = Demand(prompt_tokens=1000, cached_tokens={"a": 640}, store_tokens=store)
    b = load("b")
    assert pick(policy, [b, a], demand) == "a"  # 240 vs 400
    # ...until a's queue costs more than the 160 tokens its cache saves over b.
    assert pick(policy, [b, load("a", queued_tokens=161)], demand) == "b"
    assert demand.uncached("a") == 200 and demand.uncached("b") == 200 and demand.uncached("c") == 1000


def test_round_robin_and_random_ignore_caches_and_load() -> None:
    workers = [load("b"), load("a", queued_tokens=10_000), load("c")]
    demand = Demand(prompt_tokens=100, cached_tokens={"c": 96})
    rr = RoundRobin()
    assert [pick(rr, workers, demand) for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.choose([], demand) is None
    rnd = Random(seed=1)
    picks = Counter(pick(rnd, workers, demand) for _ in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60
    one, two = Random(seed=7), Random(seed=7)  # seeded: a benchmark run can be repeated
    assert [one.choose(workers, demand) for _ in range(9)] == [two.choose(workers, demand) for _ in range(9)]
    assert rnd.choose([], demand) is None


# --- what each worker has of a prompt ----------------------------------------------------------------------------


def cached(index: PrefixIndex, source: str, tier: str, hashes: list[bytes]) -> None:
    index.load(KvSnapshot(source, "e", 0, "s", {}))
    index.apply(KvEvent(source, "e", 1, OP_STORED, tier, hashes))


def test_prefix_hits_hash_the_prompt_like_the_workers_and_split_the_store_past_the_local_run() -> None:
    block, salt = 16, "tenant-1"
    prompt = list(range(1000, 1000 + 10 * block + 5))  # 10 full blocks and a tail
    keys = hashing.block_hashes(prompt, hashing.namespace("cid", salt), block)
    index = PrefixIndex()
    cached(index, "w1", TIER_LOCAL, keys[:6])
    cached(index, "w2", TIER_LOCAL, keys[:2])
    cached(index, "kv", TIER_RAM, keys[:3])
    index.apply(KvEvent("kv", "e", 2, OP_STORED, TIER_SSD, keys[3:8]))
    workers = [
        WorkerLoad("w1", "prefill", MODEL, 0, 0, 100, 100, cache_id="cid", block_tokens=block),
        WorkerLoad("w2", "prefill", MODEL, 0, 0, 100, 100, cache_id="cid", block_tokens=block),
        WorkerLoad("w3", "prefill", MODEL, 0, 0, 100, 100, cache_id="cid", block_tokens=block),
        WorkerLoad("old", "prefill", MODEL, 0, 0, 100, 100),  # says nothing of its cache: no hits
    ]
    hits = prefix_hits(index, prompt, salt, workers)
    assert hits.local == {"w1": 6 * block, "w2": 2 * block}
    assert hits.store == {
        "w1": {TIER_SSD: 2 * block},  # blocks 6, 7
        "w2": {TIER_RAM: 1 * block, TIER_SSD: 5 * block},  # blocks 2..7
        "w3": {TIER_RAM: 3 * block, TIER_SSD: 5 * block},
    }
    assert prefix_hits(index, prompt, "another-tenant", workers).local == {}  # the salt is part of the key
    # A prompt of exactly 6 blocks: the last block holds the last token, always computed, so 5 count.
    assert prefix_hits(index, prompt[: 6 * block], salt, workers).local == {"w1": 5 * block, "w2": 2 * block}


# --- session affinity --------------------------------------------------------------------------------------------


def turn(tokens: list[int]) -> tuple[list[int], list[bytes]]:
    return tokens, hashing.block_hashes(tokens, hashing.namespace("cid"), 16)


def test_affinity_finds_the_worker_of_the_turn_a_prompt_continues() -> None:
    aff = SessionAffinity(ttl_s=100.0)
    system = list(range(64))  # 4 full blocks shared by every conversation
    first, first_keys = turn(system + [500 + i for i in range(21)])  # 85 tokens: 5 blocks and a 5-token tail
    aff.remember("r1", first, first_keys, "d2", now=0.0)
    follow, follow_keys = turn(first + [900 + i for i in range(40)])  # the answer and the next question
    assert aff.owner(follow, follow_keys, now=10.0) == "d2"
    # Another conversation with the same system prompt and first block of question, a different tail: no match.
    other, other_keys = turn(system + [500 + i for i in range(16)] + [7, 7, 7, 7, 7] + [900] * 40)
    assert other_keys[4] == first_keys[4]
    assert aff.owner(other, other_keys, now=10.0) == ""
    # A later turn of the same conversation on another worker: the longest earlier turn wins.
    aff.remember("r2", follow, follow_keys, "d1", now=20.0)
    third, third_keys = turn(follow + [1] * 30)
    assert aff.owner(third, third_keys, now=21.0) == "d1"
    assert aff.owner(first + [3] * 20, turn(first + [3] * 20)[1], now=21.0) == "d2"


def test_affinity_expires_from_when_the_turn_finished() -> None:
    aff = SessionAffinity(ttl_s=100.0)
    first, keys = turn(list(range(40)))
    follow, follow_keys = turn(first + [1] * 20)
    aff.remember("r1", first, keys, "d1", now=0.0)
    aff.done("r1", "d1", now=90.0)  # a long answer: the entry lives 100 s from here
    assert aff.owner(follow, follow_keys, now=150.0) == "d1"
    aff.expire(now=150.0)
    assert len(aff) == 1
    assert aff.owner(follow, follow_keys, now=191.0) == ""
    aff.expire(now=191.0)
    assert len(aff) == 0
    aff.remember("r2", [1, 2], [], "d1", now=0.0)  # shorter than a block: nothing to remember
    assert len(aff) == 0


def test_registry_passes_on_how_workers_name_their_blocks() -> None:
    reg = WorkerRegistry(timeout_s=3.0)
    reg.observe(Heartbeat("a", "prefill", MODEL, 0, 0, 10, 10, 0.0, cache_id="cid", block_tokens=128), now=0.0)
    (a,) = reg.candidates("prefill", MODEL, 0.0)
    assert (a.cache_id, a.block_tokens) == ("cid", 128)


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


def test_decode_goes_back_to_the_previous_turns_worker_when_it_has_room() -> None:
    policy = AffinityThenFreeBlocks()
    workers = [load("a", free_blocks=90), load("b", free_blocks=20, running=7)]
    assert pick(policy, workers, Demand(prompt_tokens=100, blocks_needed=8)) == "a"
    sticky = Demand(prompt_tokens=100, blocks_needed=8, affinity="b")
    assert pick(policy, workers, sticky) == "b"
    # b has room for 20 blocks, of which this balancer promised 15 since its heartbeat: no room, fall back.
    workers[1] = load("b", free_blocks=20, pending_blocks=15)
    assert pick(policy, workers, sticky) == "a"
    # The affinity worker left the pool: the others are still fine.
    assert pick(policy, [workers[0]], sticky) == "a"
    assert policy.choose([load("b", free_blocks=4)], sticky) is None  # nobody has room: wait


def test_policies_are_registered_by_name() -> None:
    assert isinstance(POLICIES["least-cost"](), LeastCost)
    assert isinstance(POLICIES["most-free-blocks"](), MostFreeBlocks)
    assert isinstance(POLICIES["affinity"](), AffinityThenFreeBlocks)
    assert isinstance(POLICIES["round-robin"](), RoundRobin)
    assert isinstance(POLICIES["random"](PolicySettings(seed=3)), Random)
    tuned = POLICIES["least-cost"](PolicySettings(overlap_weight=0.5, ssd_weight=0.4))
    assert isinstance(tuned, LeastCost) and tuned.overlap_weight == 0.5 and tuned.tier_weights[TIER_SSD] == 0.4
    with pytest.raises(ValueError):
        PolicySettings(ram_weight=1.5)


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
