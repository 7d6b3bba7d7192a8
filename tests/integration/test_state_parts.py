"""A request's short-term state through the real kvcache service in parts (shared/worker.py): a V4-Flash-sized
blob (12.6 MiB in bfloat16) is larger than one NATS message, so prefill stores it in parts and decode joins them."""

from __future__ import annotations

import os
from pathlib import Path

from services.kvcache.config import KvCacheConfig
from services.kvcache.service import KvCacheService
from shared import subjects
from shared.bus import Bus
from shared.kvclient import KvClient
from shared.schemas.kv import KvDelete, KvDeleteReply
from shared.kvclient import get_state, put_state, state_part_key, state_parts
from shared.worker import STATE_PART_OVERHEAD

MiB = 1 << 20


def test_parts_hold_the_blob_and_its_count() -> None:
    blob = bytes(range(256)) * 10
    parts = state_parts(b"state:r", blob, 1000)
    assert [k for k, _ in parts] == [b"state:r", b"state:r#1", b"state:r#2"]
    assert parts[0][1][:4] == (3).to_bytes(4, "little")
    assert parts[0][1][4:] + parts[1][1] + parts[2][1] == blob
    assert state_parts(b"k", b"", 1000) == [(b"k", (1).to_bytes(4, "little"))]


async def test_a_state_larger_than_a_message_round_trips(nats_url: str, tmp_path: Path) -> None:
    service = KvCacheService(KvCacheConfig(tmp_path / "kvcache", capacity_bytes=256 * MiB, map_size=512 * MiB))
    bus = await Bus.connect(nats_url, "state-test")
    try:
        await service.start(bus)
        kv = KvClient(bus)
        part = bus.max_payload - STATE_PART_OVERHEAD
        blob = os.urandom(int(12.6 * MiB))
        assert len(blob) > bus.max_payload
        assert await put_state(kv, b"state:big", blob, part)
        got, keys = await get_state(kv, b"state:big")
        assert got == blob and keys == [state_part_key(b"state:big", i) for i in range(-(-len(blob) // part))]
        assert len(keys) > 1

        small = os.urandom(57880)  # the tiny test checkpoint's
        assert await put_state(kv, b"state:small", small, part)
        assert await get_state(kv, b"state:small") == (small, [b"state:small"])

        # A lost part is a miss (decode then replays), never a short blob.
        assert (await bus.request(subjects.KV_DELETE, KvDelete([keys[-1]]), KvDeleteReply)).deleted == 1
        assert await get_state(kv, b"state:big") == (b"", keys)
        assert await get_state(kv, b"state:none") == (b"", [b"state:none"])
    finally:
        await service.stop()
        await bus.drain()
