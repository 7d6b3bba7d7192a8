"""The hand-over protocol over a real nats-server: decode's puller against prefill's hand-overs, whole, from a
peer that is gone, from one that sends a corrupt item, and cut short by a cancel; and on one host through
prefill's peer arena (a descriptor over NATS), with its fallback and the region's end of life."""

from __future__ import annotations

import os

from shared import subjects
from shared.bus import Bus
from shared.worker.kv_peer import Handovers, PeerPuller
from shared.schemas.kv_peer import KvPeerDone, KvPeerPull, KvPeerReply
from shared.worker.kv_peer_transport import ShmExporter
from tests.integration.buses import connect, until

BLOCK = 737_280  # SmolLM2's float32 block
MiB = 1 << 20


async def serving(bus: Bus, worker: str, handovers: Handovers) -> None:
    async def done(message: KvPeerDone, _: object) -> None:
        handovers.end(message.request_id, "done")

    await bus.serve(subjects.kv_peer(worker), KvPeerPull, handovers.serve)
    await bus.subscribe(subjects.kv_peer_done(worker), KvPeerDone, done)
    await bus._nc.flush()  # noqa: SLF001 - the server has the subscriptions before the other connection asks


def exported(n: int, state: int) -> tuple[list[bytes], list[bytes], bytes, bytes]:
    keys = [os.urandom(16) for _ in range(n)]
    return keys, [os.urandom(BLOCK) for _ in range(n)], os.urandom(BLOCK), os.urandom(state)


async def test_a_pull_moves_blocks_and_snapshot_in_many_messages_and_ends_the_hand_over(nats_url: str) -> None:
    prefill, decode = await connect(nats_url, "prefill-t"), await connect(nats_url, "decode-t")
    try:
        handovers = Handovers()
        await serving(prefill, "p0", handovers)
        keys, data, tail, state = exported(40, 9 * MiB)  # 29 MB of blocks; state over one message
        handovers.open("r1", keys)
        handovers.fill("r1", data, tail, state, part_bytes=prefill.max_payload - 64 * 1024)
        puller = PeerPuller(decode, BLOCK, message_bytes=4 * MiB)
        pulled = await puller.pull("p0", "r1", keys, 3)  # the first 3 this worker holds itself
        assert pulled.blocks == data[3:]
        assert pulled.snapshot == (tail, state)
        assert puller.counts["peer_blocks"] == 37
        await until(lambda: len(handovers) == 0, 10, "the done message")
        assert handovers.counts["ended_done"] == 1
        handovers.open("r1b", keys)  # a block-aligned prompt whose blocks decode holds all of already
        handovers.fill("r1b", data, b"", b"", part_bytes=MiB)
        held_here = await puller.pull("p0", "r1b", keys, len(keys))
        assert held_here.blocks == [] and held_here.snapshot == (b"", b"")
        assert puller.counts["peer_corrupt"] == puller.counts["peer_failed"] == 0
    finally:
        await prefill.drain()
        await decode.drain()


async def test_a_gone_peer_or_a_corrupt_item_gives_what_came_before_and_no_snapshot(nats_url: str) -> None:
    class Corrupting(Handovers):
        async def serve(self, pull: KvPeerPull) -> KvPeerReply:
            reply = await super().serve(pull)
            at = 10 - pull.start
            if 0 <= at < len(reply.items):  # one flipped byte in block 10
                reply.items[at] = bytes([reply.items[at][0] ^ 0xFF]) + reply.items[at][1:]
            return reply

    prefill, decode = await connect(nats_url, "prefill-c"), await connect(nats_url, "decode-c")
    try:
        puller = PeerPuller(decode, BLOCK, message_bytes=BLOCK * 5, first_timeout=2, timeout=2)
        gone = await puller.pull("nobody", "r2", [b"k"], 0)  # no such worker: no responders, at once
        assert gone.blocks == [] and gone.snapshot is None and puller.counts["peer_failed"] == 1
        handovers = Corrupting()
        await serving(prefill, "p1", handovers)
        keys, data, tail, _ = exported(20, 0)
        handovers.open("r2", keys)
        handovers.fill("r2", data, tail, b"", part_bytes=MiB)
        pulled = await puller.pull("p1", "r2", keys, 0)
        # block 0 alone, then 5 a message: the message with block 10 in it is refused whole
        assert pulled.blocks == data[:6] and pulled.snapshot is None
        assert puller.counts["peer_corrupt"] == 1 and puller.counts["peer_failed"] == 2
        await until(lambda: len(handovers) == 0, 10, "the done message after a failed pull")
    finally:
        await prefill.drain()
        await decode.drain()


async def test_a_cancel_stops_the_pull_between_messages(nats_url: str) -> None:
    prefill, decode = await connect(nats_url, "prefill-x"), await connect(nats_url, "decode-x")
    try:
        handovers = Handovers()
        await serving(prefill, "p2", handovers)
        keys, data, tail, _ = exported(30, 0)
        handovers.open("r3", keys)
        handovers.fill("r3", data, tail, b"", part_bytes=MiB)
        puller = PeerPuller(decode, BLOCK, message_bytes=BLOCK * 4, window=1)
        pulled = await puller.pull("p2", "r3", keys, 0, stop=lambda: True)  # cancelled after the first message
        assert pulled.blocks == data[:1] and pulled.snapshot is None
        await until(lambda: len(handovers) == 0, 10, "the done message")
        handovers.open("r4", keys)
        handovers.fill("r4", data, tail, b"", part_bytes=MiB)
        asked = []

        def cancelled() -> bool:  # the cancel lands after the third message
            asked.append(1)
            return len(asked) > 2

        pulled = await puller.pull("p2", "r4", keys, 0, stop=cancelled)
        assert len(pulled.blocks) < len(data) and pulled.blocks == data[: len(pulled.blocks)]
        assert pulled.snapshot is None
        await until(lambda: len(handovers) == 0, 10, "the done message")
    finally:
        await prefill.drain()
        await decode.drain()


# --- the same-host path: the items in prefill's peer arena, NATS carrying a descriptor (kv_peer_transport.py) ---


def shm_handovers(lease_s: float = 15.0) -> Handovers:
    return Handovers(lease_s, ShmExporter.open(f"test-peer-{os.getpid()}", 64 * MiB))


def fill_shm(handovers: Handovers, rid: str, keys: list[bytes], data: list[bytes], tail: bytes, state: bytes) -> None:
    exporter = handovers.exporter
    assert exporter is not None
    parts = [state[at : at + MiB] for at in range(0, len(state), MiB)]
    items = [*data, *([tail] if tail else []), *parts]
    taken = exporter.take([len(i) for i in items])
    assert taken is not None
    offset, out = taken
    out[:] = b"".join(items)
    handovers.open(rid, keys)
    assert handovers.fill_region(rid, exporter.lend(offset, [len(i) for i in items]), len(data), bool(tail))


async def test_a_pull_through_shared_memory_reads_the_same_bytes_and_frees_the_region_after(nats_url: str) -> None:
    """Decode reads the items where prefill exported them (a descriptor over NATS, no bytes), identical; the
    hand-over stays until decode's views are gone (the engine imported them), then `done` ends it and the region
    is free again."""
    prefill, decode = await connect(nats_url, "prefill-s"), await connect(nats_url, "decode-s")
    handovers = shm_handovers()
    exporter = handovers.exporter
    assert exporter is not None
    all_free = exporter.free_bytes
    try:
        await serving(prefill, "p3", handovers)
        keys, data, tail, state = exported(40, 3 * MiB)
        fill_shm(handovers, "r5", keys, data, tail, state)
        puller = PeerPuller(decode, BLOCK, message_bytes=4 * MiB, via=["shm"])
        pulled = await puller.pull("p3", "r5", keys, 3)
        assert pulled.held and [bytes(b) for b in pulled.blocks] == data[3:]
        assert pulled.snapshot is not None and bytes(pulled.snapshot[0]) == tail and pulled.snapshot[1] == state
        assert puller.counts["peer_blocks_shm"] == puller.counts["peer_blocks"] == 37
        assert handovers.counts["blocks_served_shm"] == 37 and handovers.counts["blocks_served"] == 0
        await decode._nc.flush()  # noqa: SLF001 - a done, had one been sent, is at the server now
        await prefill._nc.flush()  # noqa: SLF001
        assert len(handovers) == 1  # decode still reads it: no done yet
        del pulled
        await until(lambda: len(handovers) == 0, 10, "the done after the views went")
        assert handovers.counts["ended_done"] == 1 and exporter.free_bytes == all_free and exporter.held == 0
        fill_shm(handovers, "r5b", keys, data, b"", b"")  # block-aligned, and decode holds every block itself
        held_here = await puller.pull("p3", "r5b", keys, len(keys))
        assert held_here.blocks == [] and held_here.snapshot == (b"", b"") and not held_here.held
        assert puller.counts["shm_refused"] == 0
        await until(lambda: len(handovers) == 0, 10, "the done message")
    finally:
        await prefill.drain()
        await decode.drain()
        exporter.close()


async def test_a_region_decode_cannot_map_is_pulled_over_nats_from_the_same_bytes(nats_url: str) -> None:
    """Another host (here: a descriptor naming an arena this side has no such file of): the same pull goes on
    over NATS, served from the region, and nothing is refused or lost."""

    class Elsewhere(ShmExporter):
        def describe(self, region, start):  # type: ignore[no-untyped-def]
            real = super().describe(region, start)
            return type(real)(real.arena + "-on-another-host", real.token, real.offset, real.lengths)

    prefill, decode = await connect(nats_url, "prefill-e"), await connect(nats_url, "decode-e")
    handovers = Handovers(exporter=Elsewhere.open(f"test-else-{os.getpid()}", 64 * MiB))
    try:
        await serving(prefill, "p4", handovers)
        keys, data, tail, _ = exported(12, 0)
        fill_shm(handovers, "r6", keys, data, tail, b"")
        puller = PeerPuller(decode, BLOCK, message_bytes=4 * MiB, via=["shm"])
        pulled = await puller.pull("p4", "r6", keys, 0)
        assert not pulled.held and pulled.blocks == data and pulled.snapshot == (tail, b"")
        assert puller.counts["shm_refused"] == 1 and puller.counts["peer_blocks_shm"] == 0
        assert handovers.counts["blocks_served"] == 12
        await until(lambda: len(handovers) == 0, 10, "the done message")
    finally:
        await prefill.drain()
        await decode.drain()
        assert handovers.exporter is not None
        handovers.exporter.close()


async def test_a_cancel_or_a_lease_end_frees_the_region_once_no_reader_holds_it(nats_url: str) -> None:
    """Cancelled or expired before any pull: the region is free at once (a later pull finds nothing and goes to
    the store). Cancelled or expired while decode reads it: free once decode's views are gone, never before."""
    prefill, decode = await connect(nats_url, "prefill-l"), await connect(nats_url, "decode-l")
    handovers = shm_handovers(lease_s=0.5)
    exporter = handovers.exporter
    assert exporter is not None
    all_free = exporter.free_bytes
    try:
        await serving(prefill, "p5", handovers)
        puller = PeerPuller(decode, BLOCK, message_bytes=4 * MiB, via=["shm"], first_timeout=2, timeout=2)
        keys, data, tail, _ = exported(8, 0)
        fill_shm(handovers, "cancelled", keys, data, tail, b"")
        handovers.end("cancelled", "cancelled")
        assert exporter.free_bytes == all_free
        gone = await puller.pull("p5", "cancelled", keys, 0)
        assert gone.blocks == [] and gone.snapshot is None and puller.counts["peer_failed"] == 1
        fill_shm(handovers, "expired", keys, data, tail, b"")
        await until(lambda: handovers.counts["ended_expired"] == 1, 10, "the lease")
        assert exporter.free_bytes == all_free

        for why in ("cancelled", "expired"):
            rid = f"read-then-{why}"
            fill_shm(handovers, rid, keys, data, tail, b"")
            pulled = await puller.pull("p5", rid, keys, 0)
            assert pulled.held and [bytes(b) for b in pulled.blocks] == data
            if why == "cancelled":
                handovers.end(rid, "cancelled")
            else:
                await until(lambda: handovers.counts["ended_expired"] == 2, 10, "the lease")
            assert len(handovers) == 0 and exporter.free_bytes < all_free  # decode's read lock keeps it
            fill_shm(handovers, "next", keys, data, tail, b"")  # a next hand-over takes another region
            handovers.end("next", "done")
            assert [bytes(b) for b in pulled.blocks] == data  # what decode reads was never written over
            del pulled
            assert exporter.free_bytes == all_free
    finally:
        await prefill.drain()
        await decode.drain()
        exporter.close()
