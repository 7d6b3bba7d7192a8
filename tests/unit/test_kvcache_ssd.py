"""The SSD tier on real segment files: restart, torn and corrupt records, segment-LRU eviction, TTL, leases."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from services.kvcache.leases import Leases
from services.kvcache.tiers import segment
from services.kvcache.tiers.ssd import SsdTier

KiB = 1024
DAY = 86400.0


def key(i: int) -> bytes:
    return b"block-%04d" % i


def blob(i: int, size: int = 20 * KiB) -> bytes:
    return os.urandom(16) + bytes([i % 251]) * (size - 16)


def rec(i: int, size: int = 20 * KiB) -> int:
    return segment.record_size(len(key(i)), size)


def open_tier(path: Path, *, capacity: int = 1 << 20, segment_bytes: int = 256 * KiB, leases: Leases | None = None,
              ttl: float = 7 * DAY) -> SsdTier:
    return SsdTier(path, capacity_bytes=capacity, ttl_s=ttl, segment_bytes=segment_bytes, leases=leases)


def segments(path: Path) -> list[Path]:
    return sorted(path.glob("*.seg"))


def test_put_get_delete_and_reopen(tmp_path: Path) -> None:
    now = time.time()
    tier = open_tier(tmp_path)
    blobs = {i: blob(i) for i in range(30)}
    for i, data in blobs.items():
        assert tier.put(key(i), data, 0.0, now)
    assert not tier.put(b"short", b"x", now + 10, now)  # short-term entries do not belong here
    assert tier.holds([key(0), key(99)], now) == [True, False]
    assert tier.get([key(3), key(99)], now) == [(blobs[3], 0.0), None]
    assert tier.delete([key(5), key(99)]) == 1
    before = tier.stats()
    assert before.entries == 29 and before.disk_bytes >= before.bytes == 29 * rec(0)
    assert len(segments(tmp_path)) > 1  # 30 x 20 KiB over 256 KiB segments
    tier.close()

    tier = open_tier(tmp_path)
    assert tier.stats().entries == 29 and tier.stats().bytes == before.bytes
    got = tier.get([key(i) for i in range(30)], now)
    assert [g[0] if g else None for g in got] == [None if i == 5 else blobs[i] for i in range(30)]  # delete held
    tier.close()


def test_one_process_per_directory(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    with pytest.raises(RuntimeError, match="in use"):
        open_tier(tmp_path)
    tier.close()
    open_tier(tmp_path).close()


def test_a_torn_tail_is_cut_off_and_the_rest_is_found(tmp_path: Path) -> None:
    now = time.time()
    tier = open_tier(tmp_path, segment_bytes=1 << 20)
    for i in range(5):
        tier.put(key(i), blob(i), 0.0, now)
    tier.close()
    (seg,) = segments(tmp_path)
    whole = seg.stat().st_size
    os.truncate(seg, whole - 1000)  # the last record lost its end, as when a writer is killed mid-write

    tier = open_tier(tmp_path)
    assert tier.holds([key(i) for i in range(5)], now) == [True] * 4 + [False]
    assert tier.stats().corrupt == 1
    assert seg.stat().st_size == 4 * rec(0)
    assert tier.put(key(4), b"again", 0.0, now)  # the key can be stored again
    tier.close()


def test_garbage_after_the_last_record_is_cut_off(tmp_path: Path) -> None:
    now = time.time()
    tier = open_tier(tmp_path, segment_bytes=1 << 20)
    tier.put(key(0), blob(0), 0.0, now)
    tier.close()
    (seg,) = segments(tmp_path)
    with open(seg, "ab") as f:
        f.write(segment.HEADER.pack(segment.MAGIC, 0, 1, 4, 10, 0.0, 0, 12345) + b"kkkk" + b"x" * 10)  # bad head_crc
    tier = open_tier(tmp_path)
    assert tier.get([key(0)], now)[0] is not None
    assert seg.stat().st_size == rec(0) and tier.stats().corrupt == 1
    tier.close()


def test_a_rotten_payload_is_never_returned_and_stays_dropped(tmp_path: Path) -> None:
    now = time.time()
    blobs = [blob(i) for i in range(3)]
    tier = open_tier(tmp_path, segment_bytes=1 << 20)
    for i, data in enumerate(blobs):
        tier.put(key(i), data, 0.0, now)
    tier.close()
    (seg,) = segments(tmp_path)
    with open(seg, "r+b") as f:  # flip one bit in the middle of block 1's payload
        f.seek(rec(0) + rec(1) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))

    tier = open_tier(tmp_path)
    assert tier.holds([key(1)], now) == [True]  # the index cannot know yet
    got = tier.get([key(0), key(1), key(2)], now)
    assert got == [(blobs[0], 0.0), None, (blobs[2], 0.0)]
    assert tier.stats().corrupt == 1 and tier.holds([key(1)], now) == [False]
    tier.close()
    tier = open_tier(tmp_path)  # marked dead on disk: not back after a restart
    assert tier.holds([key(0), key(1), key(2)], now) == [True, False, True] and tier.stats().corrupt == 0
    tier.close()


def test_eviction_drops_the_least_recently_used_segment_and_frees_disk(tmp_path: Path) -> None:
    now = time.time()
    tier = open_tier(tmp_path, capacity=4 * rec(0), segment_bytes=rec(0))  # one block per segment: exact LRU
    for i in range(4):
        now += 1
        assert tier.put(key(i), blob(i), 0.0, now)
    now += 1
    tier.get([key(0)], now)  # block 0 is now the most recent; block 1 the oldest
    now += 1
    assert tier.put(key(4), blob(4), 0.0, now)
    assert tier.holds([key(i) for i in range(5)], now) == [True, False, True, True, True]
    stats = tier.stats()
    assert stats.evictions == 1 and stats.disk_bytes <= 4 * rec(0)
    assert sum(p.stat().st_size for p in segments(tmp_path)) == stats.disk_bytes
    assert not tier.put(key(9), blob(9, 5 * rec(0)), 0.0, now)  # bigger than the whole tier
    tier.close()


def test_recency_survives_a_restart(tmp_path: Path) -> None:
    now = time.time()
    tier = open_tier(tmp_path, capacity=3 * rec(0), segment_bytes=rec(0))
    for i in range(3):
        now += 1
        tier.put(key(i), blob(i), 0.0, now)
    now += 1
    tier.get([key(0)], now)
    tier.close()  # persists access times as the segments' mtimes
    tier = open_tier(tmp_path, capacity=3 * rec(0), segment_bytes=rec(0))
    now += 1
    tier.put(key(3), blob(3), 0.0, now)
    assert tier.holds([key(i) for i in range(4)], now) == [True, False, True, True]
    tier.close()


def test_a_leased_segment_is_not_evicted(tmp_path: Path) -> None:
    now = time.time()
    leases = Leases()
    tier = open_tier(tmp_path, capacity=2 * rec(0), segment_bytes=rec(0), leases=leases)
    tier.put(key(0), blob(0), 0.0, now)
    tier.put(key(1), blob(1), 0.0, now + 1)
    leases.take([key(0), key(1)], now + 10)
    assert not tier.put(key(2), blob(2), 0.0, now + 2)  # everything leased: refused, nothing lost
    assert tier.holds([key(0), key(1)], now + 2) == [True, True]
    assert tier.put(key(2), blob(2), 0.0, now + 11)  # leases over: the oldest goes
    assert tier.holds([key(0), key(1), key(2)], now + 11) == [False, True, True]
    tier.close()


def test_ttl_expires_blocks_and_the_sweep_deletes_their_segments(tmp_path: Path) -> None:
    now = time.time()
    removed: list[bytes] = []
    tier = open_tier(tmp_path, segment_bytes=rec(0), ttl=100.0)
    tier.on_removed = removed.extend
    tier.put(key(0), blob(0), 0.0, now)
    tier.put(key(1), blob(1), 0.0, now + 50)
    assert tier.get([key(0)], now + 100) == [None]  # expired on read
    assert tier.sweep(now + 100) == 0 and tier.sweep(now + 150) == 1
    assert tier.stats().expired == 2 and tier.stats().entries == 0
    assert segments(tmp_path) == [] and tier.stats().disk_bytes == 0
    assert removed == [key(0), key(1)]
    tier.close()


def test_big_blocks_and_a_reopen_after_many_segments(tmp_path: Path) -> None:
    now = time.time()
    size = int(3.5 * 1024 * KiB)
    tier = open_tier(tmp_path, capacity=64 << 20, segment_bytes=8 << 20)
    blobs = [blob(i, size) for i in range(6)]
    for i, data in enumerate(blobs):
        assert tier.put(key(i), data, 0.0, now)
    tier.close()
    tier = open_tier(tmp_path, capacity=64 << 20, segment_bytes=8 << 20)
    assert [e[0] if e else None for e in tier.get([key(i) for i in range(6)], now)] == blobs
    assert tier.long_term_keys() == [key(i) for i in range(6)]
    tier.close()


def test_a_big_record_killed_before_its_header_is_a_torn_tail(tmp_path: Path) -> None:
    # Big payloads are written first and their header last (segment.append): a kill in between leaves a hole
    # where the header goes, which must read as the end of the segment.
    now = time.time()
    size = segment.OVERLAP_BYTES * 2
    tier = open_tier(tmp_path, capacity=16 << 20, segment_bytes=8 << 20)
    for i in range(3):
        tier.put(key(i), blob(i, size), 0.0, now)
    tier.close()
    (seg,) = segments(tmp_path)
    with open(seg, "r+b") as f:
        f.seek(2 * rec(0, size))
        f.write(bytes(segment.HEADER.size + len(key(2))))
    tier = open_tier(tmp_path, capacity=16 << 20, segment_bytes=8 << 20)
    assert tier.holds([key(0), key(1), key(2)], now) == [True, True, False]
    assert seg.stat().st_size == 2 * rec(0, size)
    tier.close()


def test_a_run_over_segments_with_one_open_fd_drops_only_the_rotten_block(tmp_path: Path) -> None:
    now = time.time()
    size = segment.OVERLAP_BYTES  # big: written payload first, checksum on the helper thread
    blobs = [blob(i, size) for i in range(5)]
    # Three segments and one fd kept open: every read reopens its segment.
    tier = SsdTier(tmp_path, capacity_bytes=16 << 20, ttl_s=DAY, segment_bytes=2 * rec(0, size), max_open_files=1)
    for i, data in enumerate(blobs):
        tier.put(key(i), data, 0.0, now)
    tier.close()
    seg = segments(tmp_path)[1]  # blocks 2 and 3: flip a byte of block 3's payload
    with open(seg, "r+b") as f:
        f.seek(rec(0, size) + rec(0, size) - 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    tier = SsdTier(tmp_path, capacity_bytes=16 << 20, ttl_s=DAY, segment_bytes=2 * rec(0, size), max_open_files=1)
    got = tier.get([key(i) for i in (0, 1, 2, 3, 3, 4)], now)
    assert [g[0] if g else None for g in got] == [blobs[0], blobs[1], blobs[2], None, None, blobs[4]]
    assert tier.stats().corrupt == 1 and tier.stats().entries == 4
    tier.close()
