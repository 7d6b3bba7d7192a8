"""The hand-over's pieces without a broker: how a reply is cut, what the puller accepts, how a hand-over ends."""

from __future__ import annotations

import asyncio
import os

from shared.worker.kv_peer import CHECKSUMS, PREFERRED, Handovers, PeerPuller, checksum, pick
from shared.schemas.kv_peer import KvPeerPull, KvPeerReply

BLOCK = 64


def blocks(n: int) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in range(n)]


def test_pick_fills_up_to_the_bound_and_always_takes_one() -> None:
    items = [b"a" * 10, b"b" * 10, b"c" * 30, b"d" * 5]
    assert pick(items, 0, 25) == items[:2]
    assert pick(items, 2, 25) == [items[2]]  # bigger than the bound: alone
    assert pick(items, 1, 100, count=2) == items[1:3]
    assert pick(items, 4, 100) == []


def reply(items: list[bytes], nblocks: int, tail: bool = False, parts: int = 0) -> KvPeerReply:
    return KvPeerReply(True, items, [checksum(i) for i in items], nblocks, tail, parts)


def test_the_puller_rejects_a_flipped_byte_a_short_block_and_a_missing_checksum() -> None:
    puller = PeerPuller(None, BLOCK, message_bytes=1 << 20)  # type: ignore[arg-type]  (no bus: checks only)
    good = blocks(3)
    assert puller.intact(reply(good, 3), 0)
    flipped = reply(good, 3)
    flipped.items[1] = bytes([good[1][0] ^ 1]) + good[1][1:]
    assert not puller.intact(flipped, 0)
    short = [good[0], good[1][:-1]]
    assert not puller.intact(KvPeerReply(True, short, [checksum(i) for i in short], 3), 0)
    assert not puller.intact(KvPeerReply(True, good, [checksum(good[0])], 3), 0)
    assert not puller.intact(reply([], 3), 0)
    assert puller.intact(reply([], 3), 3)  # nothing left past the blocks decode holds itself: whole, not corrupt
    # past the blocks and the partial block, state parts may have any length
    assert puller.intact(reply([good[0], b"state"], 1, tail=True, parts=1), 1)
    assert not puller.intact(reply([good[0], b"x"], 1, tail=True, parts=1), 0)  # a partial block is full-size


async def test_a_pull_waits_for_the_export_and_gets_every_item_in_parts() -> None:
    handovers = Handovers()
    keys = [b"k%d" % i for i in range(4)]
    handovers.open("r", keys)
    waiting = asyncio.ensure_future(handovers.serve(KvPeerPull("r", 1, keys[1:], max_bytes=2 * BLOCK)))
    await asyncio.sleep(0)
    assert not waiting.done()  # not exported yet
    data, tail, state = blocks(4), os.urandom(BLOCK), os.urandom(100)
    handovers.fill("r", data, tail, state, part_bytes=40)
    got = await waiting
    assert got.found and got.items == data[1:3] and (got.blocks, got.tail, got.state_parts) == (4, True, 3)
    rest = await handovers.serve(KvPeerPull("r", 4, [], max_bytes=10 * BLOCK))
    assert rest.items == [tail, state[:40], state[40:80], state[80:]]
    assert handovers.counts["blocks_served"] == 2


async def test_other_hashes_get_nothing() -> None:
    handovers = Handovers()
    handovers.open("r", [b"a", b"b"])
    handovers.fill("r", blocks(2), b"", b"", part_bytes=10)
    assert not (await handovers.serve(KvPeerPull("r", 0, [b"a", b"x"], 1 << 20))).found
    assert not (await handovers.serve(KvPeerPull("other", 0, [b"a", b"b"], 1 << 20))).found
    assert handovers.counts["refused"] == 1


async def test_a_cancel_answers_a_waiting_pull_and_drops_the_bytes() -> None:
    handovers = Handovers()
    handover = handovers.open("r", [b"a"])
    waiting = asyncio.ensure_future(handovers.serve(KvPeerPull("r", 0, [b"a"], 1 << 20)))
    await asyncio.sleep(0)
    handovers.end("r", "cancelled")
    assert not (await waiting).found
    handovers.fill("r", blocks(1), b"", b"", part_bytes=10)  # the export finishing after the cancel: dropped
    assert len(handovers) == 0 and handover.items == [] and handovers.counts["ended_cancelled"] == 1


async def test_the_lease_ends_a_hand_over_nobody_pulls() -> None:
    handovers = Handovers(lease_s=0.01)
    handover = handovers.open("r", [b"a"])
    handovers.fill("r", blocks(1), b"", b"", part_bytes=10)
    await asyncio.wait_for(handover.ended.wait(), 10)
    assert len(handovers) == 0 and handover.items == [] and handovers.counts["ended_expired"] == 1


async def test_ending_twice_or_unknown_is_harmless_and_a_redelivery_replaces() -> None:
    handovers = Handovers()
    first = handovers.open("r", [b"a"])
    handovers.open("r", [b"a"])
    assert first.ended.is_set() and len(handovers) == 1 and handovers.counts["ended_replaced"] == 1
    handovers.end("r", "done")
    handovers.end("r", "done")
    handovers.end("nobody", "done")
    assert len(handovers) == 0 and handovers.counts["ended_done"] == 1


def test_a_reply_checks_in_the_checksum_it_names_and_an_unknown_one_is_refused() -> None:
    puller = PeerPuller(None, BLOCK, message_bytes=1 << 20)  # type: ignore[arg-type]
    data = blocks(2)
    for kind in CHECKSUMS:  # crc32 everywhere, xxh3 where the xxhash package is installed
        assert puller.intact(KvPeerReply(True, data, [checksum(i, kind) for i in data], 2, checksum=kind), 0)
    assert not puller.intact(KvPeerReply(True, data, [checksum(i) for i in data], 2, checksum="md4"), 0)


async def test_the_peer_answers_in_the_checksum_asked_for_or_in_crc32() -> None:
    handovers = Handovers()
    handovers.open("r", [b"a"])
    data = blocks(1)
    handovers.fill("r", data, b"", b"", part_bytes=10)
    unknown = await handovers.serve(KvPeerPull("r", 0, [b"a"], 1 << 20, checksum="md4"))
    assert unknown.checksum == "crc32" and unknown.checksums == [checksum(data[0])]
    asked = await handovers.serve(KvPeerPull("r", 0, [b"a"], 1 << 20, checksum=PREFERRED))
    assert asked.checksum == PREFERRED and asked.checksums == [checksum(data[0], PREFERRED)]
