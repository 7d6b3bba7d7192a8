"""Short-term snapshots through the real kvcache service (shared/worker/short_term.py, shared/worker/kvclient.py).

A V4-Flash-sized state (12.6 MiB in bfloat16) is larger than one NATS message, so it travels in parts; snapshots
are content-addressed, so a follow-up turn finds the longest one its own tokens lead to."""

from __future__ import annotations

import os
from pathlib import Path

from services.kvcache.config import KvCacheConfig
from services.kvcache.service import KvCacheService
from shared import subjects
from shared.bus import Bus
from shared import hashing
from shared.worker import short_term
from shared.worker.kvclient import KvClient, get_parts, part_key, put_parts, split_parts
from shared.schemas.kv import KvDelete, KvDeleteReply
from shared.worker.kv_transfer import STATE_PART_OVERHEAD

MiB = 1 << 20


def test_parts_hold_the_blob_and_its_count() -> None:
    blob = bytes(range(256)) * 10
    parts = split_parts(b"state:r", blob, 1000)
    assert [k for k, _ in parts] == [b"state:r", b"state:r#1", b"state:r#2"]
    assert parts[0][1][:4] == (3).to_bytes(4, "little")
    assert parts[0][1][4:] + parts[1][1] + parts[2][1] == blob
    assert split_parts(b"k", b"", 1000) == [(b"k", (1).to_bytes(4, "little"))]


async def test_a_state_larger_than_a_message_round_trips(nats_url: str, tmp_path: Path) -> None:
    service = KvCacheService(KvCacheConfig(tmp_path / "kvcache", capacity_bytes=256 * MiB, map_size=512 * MiB))
    bus = await Bus.connect(nats_url, "state-test")
    try:
        await service.start(bus)
        kv = KvClient(bus)
        part = bus.max_payload - STATE_PART_OVERHEAD
        blob = os.urandom(int(12.6 * MiB))
        assert len(blob) > bus.max_payload
        assert await put_parts(kv, b"state:big", blob, part)
        got, keys = await get_parts(kv, b"state:big")
        assert got == blob and keys == [part_key(b"state:big", i) for i in range(-(-len(blob) // part))]
        assert len(keys) > 1

        small = os.urandom(57880)  # the tiny test checkpoint's
        assert await put_parts(kv, b"state:small", small, part)
        assert await get_parts(kv, b"state:small") == (small, [b"state:small"])

        # A lost part is a miss (decode then replays), never a short blob.
        assert (await bus.request(subjects.KV_DELETE, KvDelete([keys[-1]]), KvDeleteReply)).deleted == 1
        assert await get_parts(kv, b"state:big") == (b"", keys)
        assert await get_parts(kv, b"state:none") == (b"", [b"state:none"])
    finally:
        await service.stop()
        await bus.drain()


async def test_a_follow_up_finds_the_longest_snapshot_its_tokens_lead_to(nats_url: str, tmp_path: Path) -> None:
    service = KvCacheService(KvCacheConfig(tmp_path / "kvcache", capacity_bytes=64 * MiB, map_size=128 * MiB))
    bus = await Bus.connect(nats_url, "snapshot-test")
    try:
        await service.start(bus)
        kv = KvClient(bus)
        bt, part = 16, bus.max_payload - STATE_PART_OVERHEAD
        ns = hashing.namespace("model:layout", "tenant-a")
        turn1 = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
        answer = turn1 + list(range(500, 530))  # the first turn's prompt and output: 70 tokens
        follow = answer + [7, 8, 9]

        async def save(tokens: list[int], tag: bytes) -> bytes:
            hashes = hashing.block_hashes(tokens, ns, bt)
            snap = short_term.Snapshot(len(tokens), tail=tag * 3, state=tag * 5)
            return await short_term.save(kv, tokens, ns, hashes, bt, snap, part)

        assert await save(turn1, b"p") and await save(answer, b"o")
        hashes = hashing.block_hashes(follow, ns, bt)
        found = await short_term.find(kv, follow, ns, hashes, bt, len(follow) - 1)
        assert found is not None and found[0] == short_term.Snapshot(70, b"ooo", b"ooooo")
        # a limit below the longer one, or missing its blocks: the prompt's end snapshot still serves
        found = await short_term.find(kv, follow, ns, hashes, bt, 60)
        assert found is not None and found[0].length == 40 and found[0].tail == b"ppp"
        found = await short_term.find(kv, follow, ns, hashes[:3], bt, len(follow) - 1)
        assert found is not None and found[0].length == 40
        # other tokens after the same blocks, another tenant: nothing
        other = turn1[:32] + [1] * 40
        assert await short_term.find(kv, other, ns, hashing.block_hashes(other, ns, bt), bt, 70) is None
        ns_b = hashing.namespace("model:layout", "tenant-b")
        assert await short_term.find(kv, follow, ns_b, hashing.block_hashes(follow, ns_b, bt), bt, 72) is None
    finally:
        await service.stop()
        await bus.drain()
