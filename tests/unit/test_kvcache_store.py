"""The KV store with its LMDB tier alone (no RAM, no SSD: long-term blocks live in LMDB, as before the SSD tier),
on real LMDB files: prefix runs, TTL, capacity eviction, corruption, persistence."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest

from services.kvcache.config import KvCacheConfig
from services.kvcache.store import KvStore
from services.kvcache.tiers import record
from services.kvcache.tiers.lmdb import LmdbTier
from shared import hashing

KiB = 1024


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def open_store(path: Path, clock: Clock, capacity: int = 1 << 20, max_ttl: float = 180.0) -> KvStore:
    lmdb_tier = LmdbTier(path, capacity_bytes=capacity, map_size=16 << 20)
    return KvStore(short_term=lmdb_tier, max_ttl_s=max_ttl, clock=clock)


def chain(n: int) -> list[bytes]:
    return hashing.block_hashes(list(range(n * hashing.BLOCK_TOKENS)), hashing.namespace("test-model"))


def blob(i: int, size: int = 10 * KiB) -> bytes:
    return bytes([i % 251]) * size


def test_put_get_and_lookup_prefix_run(tmp_path: Path) -> None:
    store = open_store(tmp_path, Clock())
    keys = chain(5)
    for i in (0, 1, 2, 4):  # block 3 missing: the run stops there
        assert store.put(keys[i], blob(i))
    assert store.lookup(keys).hits == 3
    assert store.lookup(keys[4:]).hits == 1
    assert store.lookup([]).hits == 0
    assert store.get([keys[0], keys[3], keys[4]]) == [blob(0), None, blob(4)]
    assert store.delete([keys[1], b"absent"]) == 1
    assert store.lookup(keys).hits == 1
    c = store.counters
    assert (c.get_hits, c.get_misses, c.bytes_read) == (2, 1, 20 * KiB)
    store.close()


def test_invalid_keys_are_misses_not_errors(tmp_path: Path) -> None:
    store = open_store(tmp_path, Clock())
    assert not store.put(b"", b"x")
    assert not store.put(b"k" * 600, b"x")
    assert not store.put(b"k", b"x", ttl_s=-1)
    assert store.get([b"", b"k" * 600]) == [None, None]
    assert store.lookup([b"k" * 600]).hits == 0
    store.close()


def test_ttl_entries_expire_on_read_and_by_sweep(tmp_path: Path) -> None:
    clock = Clock()
    store = open_store(tmp_path, clock, max_ttl=30.0)
    store.put(b"tail:a", blob(1), ttl_s=10.0)
    store.put(b"tail:b", blob(2), ttl_s=1000.0)  # clamped to the 30 s maximum
    store.put(b"long", blob(3))
    clock.t += 9.9
    assert store.get([b"tail:a", b"tail:b"]) == [blob(1), blob(2)]
    clock.t += 0.2
    assert store.get([b"tail:a"]) == [None]  # expired, even before a sweep
    assert store.lookup([b"tail:a"]).hits == 0
    assert store.sweep() == 1
    clock.t += 20.0
    assert store.sweep() == 1
    assert store.get([b"tail:b", b"long"]) == [None, blob(3)]
    assert store.stats()["lmdb"]["entries"] == 1  # type: ignore[index]
    store.close()


def test_capacity_evicts_least_recently_used_long_term_blocks(tmp_path: Path) -> None:
    clock = Clock()
    size = 100 * KiB
    capacity = 4 * record.size(size)  # room for four blocks
    store = open_store(tmp_path, clock, capacity=capacity)
    keys = chain(6)
    for i in range(4):
        clock.t += 1
        assert store.put(keys[i], blob(i, size))
    clock.t += 1
    assert store.get([keys[0]]) == [blob(0, size)]  # block 0 is now the most recent; block 1 the oldest
    clock.t += 1
    assert store.put(keys[4], blob(4, size))
    assert store.get(keys[:5]) == [blob(0, size), None, blob(2, size), blob(3, size), blob(4, size)]
    stats = store.stats()["lmdb"]
    assert stats["evictions"] == 1 and stats["bytes"] <= capacity  # type: ignore[index]
    assert not store.put(keys[5], blob(5, capacity))  # bigger than the whole store
    store.close()


def test_short_term_entries_are_not_evicted_for_room(tmp_path: Path) -> None:
    size = 100 * KiB
    store = open_store(tmp_path, Clock(), capacity=2 * record.size(size))
    assert store.put(b"tail:1", blob(1, size), ttl_s=60)
    assert store.put(b"tail:2", blob(2, size), ttl_s=60)
    assert not store.put(b"block", blob(3, size))  # no long-term block to evict: refused
    assert store.get([b"tail:1", b"tail:2"]) == [blob(1, size), blob(2, size)]
    store.close()


def test_replacing_a_short_term_entry_and_repeating_a_long_term_put(tmp_path: Path) -> None:
    store = open_store(tmp_path, Clock())
    store.put(b"tail", b"old", ttl_s=60)
    store.put(b"tail", b"newer", ttl_s=60)
    store.put(b"block", b"same")
    store.put(b"block", b"same")
    assert store.get([b"tail", b"block"]) == [b"newer", b"same"]
    stats = store.stats()["lmdb"]
    assert stats["entries"] == 2  # type: ignore[index]
    assert stats["bytes"] == record.size(5) + record.size(4)  # type: ignore[index]
    store.close()


def test_corrupt_record_is_absent_and_deleted(tmp_path: Path) -> None:
    keys = chain(2)
    store = open_store(tmp_path, Clock())
    store.put(keys[0], blob(0))
    store.put(keys[1], blob(1))
    store.close()
    env = lmdb.open(str(tmp_path), max_dbs=4, map_size=16 << 20)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        stored = txn.get(keys[1], db=blocks)
        assert stored is not None
        raw = bytearray(stored)
        raw[-1] ^= 0xFF  # one flipped payload bit
        txn.put(keys[1], bytes(raw), db=blocks)
    env.close()
    store = open_store(tmp_path, Clock())
    assert store.get(keys) == [blob(0), None]
    assert store.lookup(keys).hits == 1  # deleted on detection
    assert store.stats()["lmdb"]["corrupt"] == 1  # type: ignore[index]
    store.close()


def test_reopen_keeps_long_term_blocks_and_totals(tmp_path: Path) -> None:
    keys = chain(3)
    store = open_store(tmp_path, Clock())
    for i, key in enumerate(keys):
        store.put(key, blob(i))
    store.put(b"tail", blob(9), ttl_s=60)
    before = store.stats()["lmdb"]
    store.close()
    store = open_store(tmp_path, Clock())
    assert store.lookup(keys).hits == 3
    assert store.get(keys) == [blob(0), blob(1), blob(2)]
    after = store.stats()["lmdb"]
    assert (after["entries"], after["bytes"]) == (before["entries"], before["bytes"])  # type: ignore[index]
    store.close()


def test_record_rejects_damage() -> None:
    rec = record.pack(b"payload", 12.5)
    assert record.unpack(rec) == (b"payload", 12.5)
    for bad in (rec[:10], rec[:-1], b"\x02" + rec[1:]):
        with pytest.raises(record.CorruptRecord):
            record.unpack(bad)


def test_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        KvCacheConfig(tmp_path, capacity_bytes=10 << 30, map_size=8 << 30)
    with pytest.raises(ValueError):
        KvCacheConfig(tmp_path, tail_ttl_s=0)
