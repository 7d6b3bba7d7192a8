"""The hand-over protocol over a real nats-server: decode's puller against prefill's hand-overs, whole, from a
peer that is gone, from one that sends a corrupt item, and cut short by a cancel."""

from __future__ import annotations

import os

from shared import subjects
from shared.bus import Bus
from shared.worker.kv_peer import Handovers, PeerPuller
from shared.schemas.kv_peer import KvPeerDone, KvPeerPull, KvPeerReply
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
