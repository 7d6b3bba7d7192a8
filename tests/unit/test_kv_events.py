"""KV events without a broker: the pure PrefixIndex, and the publisher against a recording fake bus."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from services.balancer.prefix_index import PrefixIndex, Run, Sync
from shared import subjects
from shared.engine.block_manager import BlockManager
from shared.kv_events import EventPublisher
from shared.schemas.events import (
    OP_REMOVED,
    OP_STORED,
    OP_TICK,
    TIER_LOCAL,
    TIER_RAM,
    TIER_SSD,
    KvEvent,
    KvSnapshot,
    KvSnapshotRequest,
)

H = [bytes([i]) * 16 for i in range(12)]  # stand-ins for chained block hashes


def ev(seq: int, op: str = OP_STORED, hashes: list[bytes] | None = None, tier: str = TIER_LOCAL, source: str = "w1",
       epoch: str = "e1") -> KvEvent:
    return KvEvent(source, epoch, seq, op, tier, hashes or [])


def snap(seq: int, hashes: dict[str, list[bytes]], source: str = "w1", epoch: str = "e1") -> KvSnapshot:
    return KvSnapshot(source, epoch, seq, "s", hashes)


def synced_index(source: str = "w1", epoch: str = "e1") -> PrefixIndex:
    index = PrefixIndex()
    assert index.load(snap(0, {}, source, epoch)) is Sync.OK
    return index


# --- PrefixIndex -------------------------------------------------------------------------------------------------


def test_apply_in_order_gives_runs_and_removal_cuts_them() -> None:
    index = synced_index()
    assert index.apply(ev(1, hashes=H[:4])) is Sync.OK
    assert index.run("w1", H[:6]) == Run((TIER_LOCAL,) * 4)
    assert index.run("w1", [H[1], H[2]]).blocks == 2  # a run starts wherever the prompt starts
    assert index.run("w1", [H[9], *H[:4]]).blocks == 0  # the first block missing: nothing usable
    assert index.apply(ev(2, OP_REMOVED, [H[2]])) is Sync.OK
    assert index.run("w1", H[:6]).blocks == 2  # a hole ends the run even though H[3] is still held
    assert index.holdings("w1") == {TIER_LOCAL: {H[0], H[1], H[3]}}
    assert index.runs(H[:6]) == {"w1": Run((TIER_LOCAL, TIER_LOCAL))}
    assert index.run("unknown", H).blocks == 0


def test_unknown_source_is_a_gap_until_its_snapshot_then_later_events_apply_on_top() -> None:
    index = PrefixIndex()
    assert index.apply(ev(5, hashes=[H[5]])) is Sync.GAP  # never heard of w1: its earlier holdings are unknown
    assert index.apply(ev(6, OP_REMOVED, [H[0]])) is Sync.GAP
    assert index.apply(ev(7, hashes=[H[7]])) is Sync.GAP
    assert not index.synced("w1")
    # The snapshot was taken at seq 5: it already has H[5]; 6 and 7 were heard meanwhile and apply on top.
    assert index.load(snap(5, {TIER_LOCAL: [H[0], H[1], H[5]]})) is Sync.OK
    assert index.synced("w1") and index.seq("w1") == 7
    assert index.holdings("w1") == {TIER_LOCAL: {H[1], H[5], H[7]}}
    assert index.apply(ev(8, hashes=[H[8]])) is Sync.OK


def test_a_seq_jump_is_a_gap_and_the_old_holdings_serve_until_the_snapshot() -> None:
    index = synced_index()
    index.apply(ev(1, hashes=H[:3]))
    assert index.apply(ev(3, hashes=[H[3]])) is Sync.GAP  # seq 2 was lost
    assert not index.synced("w1")
    assert index.run("w1", H).blocks == 3  # nearly right beats knowing nothing while the snapshot comes
    assert index.apply(ev(4, OP_REMOVED, [H[0]])) is Sync.GAP  # still out of step: kept for after the snapshot
    assert index.load(snap(3, {TIER_LOCAL: H[:4]})) is Sync.OK  # 3 is in the snapshot, 4 applies on top
    assert index.holdings("w1") == {TIER_LOCAL: set(H[1:4])}
    assert index.seq("w1") == 4


def test_snapshot_older_than_a_lost_event_is_still_a_gap() -> None:
    index = synced_index()
    index.apply(ev(1, hashes=[H[0]]))
    assert index.apply(ev(4, hashes=[H[4]])) is Sync.GAP
    # A snapshot at seq 2 cannot bridge to 4: event 3 is neither in it nor heard.
    assert index.load(snap(2, {TIER_LOCAL: [H[0], H[2]]})) is Sync.GAP
    assert not index.synced("w1")
    assert index.load(snap(4, {TIER_LOCAL: [H[0], H[2], H[4]]})) is Sync.OK
    assert index.holdings("w1") == {TIER_LOCAL: {H[0], H[2], H[4]}}


def test_ticks_reveal_a_lost_last_event_and_stale_events_are_ignored() -> None:
    index = synced_index()
    index.apply(ev(1, hashes=[H[0]]))
    assert index.apply(ev(1, OP_TICK)) is Sync.OK  # idle, nothing missed
    assert index.apply(ev(1, OP_REMOVED, [H[0]])) is Sync.OK  # a seq already applied changes nothing
    assert index.holdings("w1") == {TIER_LOCAL: {H[0]}}
    assert index.apply(ev(2, OP_TICK)) is Sync.GAP  # the source numbered event 2; we never got it
    assert index.load(snap(2, {TIER_LOCAL: [H[0], H[1]]})) is Sync.OK
    assert index.run("w1", H).blocks == 2


def test_a_new_epoch_means_the_publisher_restarted() -> None:
    index = synced_index()
    index.apply(ev(1, hashes=H[:3]))
    assert index.apply(ev(2, hashes=[H[3]], epoch="e2")) is Sync.GAP  # seq 2 follows 1, but from a new run
    assert index.load(snap(1, {TIER_LOCAL: [H[3]]}, epoch="e2")) is Sync.OK  # its event 2 is after the snapshot
    assert index.holdings("w1") == {TIER_LOCAL: {H[3]}}  # what the old run held is gone with it
    assert index.seq("w1") == 2


def test_store_runs_split_by_tier_and_a_block_counts_in_its_fastest_tier() -> None:
    index = synced_index("kv")
    index.apply(ev(1, hashes=H[:6], tier=TIER_SSD, source="kv"))
    index.apply(ev(2, hashes=H[:2], tier=TIER_RAM, source="kv"))  # promoted, still on disk too
    run = index.run("kv", H[:8])
    assert run.tiers == (TIER_RAM, TIER_RAM, TIER_SSD, TIER_SSD, TIER_SSD, TIER_SSD)
    assert run.by_tier() == {TIER_RAM: 2, TIER_SSD: 4}
    assert run.by_tier(start=3) == {TIER_SSD: 3}
    index.apply(ev(3, OP_REMOVED, [H[1]], tier=TIER_SSD, source="kv"))  # still in RAM: the run holds
    index.apply(ev(4, OP_REMOVED, [H[0]], tier=TIER_RAM, source="kv"))  # back to disk only
    assert index.run("kv", H[:8]).tiers == (TIER_SSD, TIER_RAM, TIER_SSD, TIER_SSD, TIER_SSD, TIER_SSD)
    assert index.holdings("kv") == {TIER_SSD: set(H[:6]) - {H[1]}, TIER_RAM: {H[1]}}


def test_several_sources_each_answer_their_own_run() -> None:
    index = PrefixIndex()
    for source, held, tier in (("w1", H[:5], TIER_LOCAL), ("w2", H[:2], TIER_LOCAL), ("kv", H[:8], TIER_SSD)):
        index.load(snap(0, {}, source=source))
        index.apply(ev(1, hashes=held, tier=tier, source=source))
    index.load(snap(0, {}, source="w3"))
    runs = index.runs(H[:10])
    assert {s: r.blocks for s, r in runs.items()} == {"w1": 5, "w2": 2, "kv": 8}
    assert index.store_sources() == ["kv"]
    index.forget("w1")
    assert index.sources() == ["kv", "w2", "w3"] and index.run("w1", H).blocks == 0


# --- EventPublisher ----------------------------------------------------------------------------------------------


@dataclass
class FakeBus:
    published: list[tuple[str, Any]] = field(default_factory=list)
    served: dict[str, Any] = field(default_factory=dict)
    max_payload: int = 1 << 20

    async def publish(self, subject: str, message: Any, **kwargs: Any) -> None:
        self.published.append((subject, message))

    async def serve(self, subject: str, request_type: type, handler: Any, **kwargs: Any) -> Any:
        self.served[subject] = handler
        return self

    async def unsubscribe(self) -> None: ...


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_publisher_merges_runs_numbers_in_order_and_splits_big_changes() -> None:
    bus = FakeBus()
    pub = EventPublisher(bus, "w1", tick_s=60.0, max_event_hashes=3)  # type: ignore[arg-type]
    pub.record(OP_STORED, TIER_LOCAL, [H[0]])
    pub.record(OP_STORED, TIER_LOCAL, [H[1], H[2]])  # same kind: merged into one event...
    pub.record(OP_REMOVED, TIER_LOCAL, [H[0]])
    pub.record(OP_STORED, TIER_LOCAL, H[3:7])  # ...and split at max_event_hashes
    await settle()
    events = [m for s, m in bus.published]
    assert {s for s, _ in bus.published} == {subjects.kv_events("w1")}
    assert [(e.seq, e.op, e.hashes) for e in events] == [
        (1, OP_STORED, H[0:3]),
        (2, OP_REMOVED, [H[0]]),
        (3, OP_STORED, H[3:6]),
        (4, OP_STORED, [H[6]]),
    ]
    bus.published.clear()
    for h in H[:3]:  # a store writing two tiers in turn: one event per tier, each tier's changes in order
        pub.stored(TIER_RAM, [h])
        pub.stored(TIER_SSD, [h])
    pub.removed(TIER_RAM, [H[0]])
    pub.stored(TIER_SSD, [H[3]])
    await settle()
    assert [(e.seq, e.op, e.tier, e.hashes) for _, e in bus.published] == [
        (5, OP_STORED, TIER_RAM, H[:3]),
        (6, OP_STORED, TIER_SSD, H[:3]),
        (7, OP_STORED, TIER_SSD, [H[3]]),
        (8, OP_REMOVED, TIER_RAM, [H[0]]),
    ]
    assert all(e.epoch == pub.epoch and e.source == "w1" for e in events)
    await pub.close()


async def test_publisher_ticks_when_idle_and_records_from_other_threads() -> None:
    bus = FakeBus()
    pub = EventPublisher(bus, "w1", tick_s=0.05)  # type: ignore[arg-type]
    await asyncio.sleep(0.12)
    assert [(m.op, m.seq) for _, m in bus.published][:1] == [(OP_TICK, 0)]
    bus.published.clear()
    thread = threading.Thread(target=lambda: [pub.record(OP_STORED, TIER_LOCAL, [h]) for h in H])
    thread.start()
    thread.join()
    await asyncio.sleep(0.02)
    changes = [m for _, m in bus.published if m.op == OP_STORED]
    assert [h for e in changes for h in e.hashes] == H and changes[-1].seq == len(changes)
    await pub.close()


async def test_publisher_overflow_skips_a_seq_so_consumers_resync() -> None:
    bus = FakeBus()
    pub = EventPublisher(bus, "w1", tick_s=60.0, max_buffered_hashes=4)  # type: ignore[arg-type]
    pub.record(OP_STORED, TIER_LOCAL, H[:3])
    pub.record(OP_STORED, TIER_LOCAL, H[3:6])  # 6 > 4 waiting: the first change is dropped
    await settle()
    ((_, event),) = bus.published
    assert (event.seq, event.hashes) == (2, H[3:6])  # seq 1 was used up by the dropped change
    index = synced_index(epoch=pub.epoch)
    assert index.apply(event) is Sync.GAP
    await pub.close()


async def test_snapshot_pages_carry_the_seq_they_reflect() -> None:
    bus = FakeBus()
    pub = EventPublisher(bus, "kv", tick_s=60.0, page_hashes=4)  # type: ignore[arg-type]
    holdings = {TIER_RAM: H[:3], TIER_SSD: H[3:9]}
    await pub.serve_snapshots(lambda: holdings)
    pub.stored(TIER_SSD, H[3:9])  # as the kvcache store's listener calls it
    await settle()
    handler = bus.served[subjects.kv_snapshot("kv")]
    first = await handler(KvSnapshotRequest())
    assert (first.seq, first.epoch, first.next_offset) == (1, pub.epoch, 4)
    assert first.hashes == {TIER_RAM: H[:3], TIER_SSD: H[3:4]}
    holdings = {}  # the store changes: pages still come from the snapshot taken
    second = await handler(KvSnapshotRequest(first.snapshot_id, 4))
    third = await handler(KvSnapshotRequest(first.snapshot_id, 8))
    assert (second.hashes, second.next_offset) == ({TIER_SSD: H[4:8]}, 8)
    assert (third.hashes, third.next_offset) == ({TIER_SSD: H[8:9]}, 0)
    assert (await handler(KvSnapshotRequest("gone", 4))).error
    await pub.close()


async def test_block_manager_listener_and_snapshot_keep_an_index_exact() -> None:
    """The engine's contract end to end without a broker: every change the block manager makes reaches the index
    through the publisher's events, and its snapshot agrees."""
    bus = FakeBus()
    pub = EventPublisher(bus, "w1", tick_s=60.0)  # type: ignore[arg-type]
    blocks = BlockManager(num_blocks=4, block_tokens=16)
    blocks.listener = lambda op, hashes: pub.record(op, TIER_LOCAL, hashes)
    await pub.serve_snapshots(lambda: {TIER_LOCAL: blocks.cached_hashes()})
    index = PrefixIndex()
    index.load(await bus.served[subjects.kv_snapshot("w1")](KvSnapshotRequest()))
    for round_ in range(3):  # each round caches 3 blocks, evicting earlier ones (4 blocks in all)
        table = blocks.allocate(3)
        assert table is not None
        for i, block in enumerate(table):
            blocks.publish(block, H[3 * round_ + i])
        blocks.free(table)
        await settle()
    for _, event in bus.published:
        assert index.apply(event) is Sync.OK
    assert index.holdings("w1") == {TIER_LOCAL: set(blocks.cached_hashes())}
    assert len(blocks.cached_hashes()) == 4
    await pub.close()


def test_publisher_source_must_be_a_subject_token() -> None:
    async def make() -> None:
        EventPublisher(FakeBus(), "a.b")  # type: ignore[arg-type]

    with pytest.raises(ValueError):
        asyncio.run(make())
