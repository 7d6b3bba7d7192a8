"""The three-tier store (RAM + LMDB + SSD) on real files: where puts go, promotion, lookup's tier split, leases,
the move of warm LMDB blocks to SSD, the listener seam, and the per-tier counters."""

from __future__ import annotations

import time
from pathlib import Path

from services.kvcache.config import KvCacheConfig
from services.kvcache.leases import Leases
from services.kvcache.store import KvStore
from services.kvcache.tiers import segment
from services.kvcache.tiers.lmdb import LmdbTier
from services.kvcache.tiers.ram import ENTRY_OVERHEAD, RamTier
from services.kvcache.tiers.ssd import SsdTier
from shared import hashing

KiB = 1024
SIZE = 10 * KiB


class Clock:
    def __init__(self) -> None:
        self.t = time.time()  # real time: the SSD tier keeps access times as file mtimes

    def __call__(self) -> float:
        return self.t


def chain(n: int) -> list[bytes]:
    return hashing.block_hashes(list(range(n * hashing.BLOCK_TOKENS)), hashing.namespace("tiers"))


def blob(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


RAM_ENTRY = 32 + SIZE + ENTRY_OVERHEAD  # a chained hash is 32 bytes
SSD_RECORD = segment.record_size(32, SIZE)


def open_store(path: Path, clock: Clock, *, ram_blocks: int = 100, ssd_blocks: int = 100, lmdb: LmdbTier | None = None,
               max_lease: float = 30.0) -> KvStore:
    leases = Leases()
    return KvStore(
        ram=RamTier(capacity_bytes=ram_blocks * RAM_ENTRY, leases=leases),
        short_term=lmdb or LmdbTier(path / "lmdb", capacity_bytes=4 << 20, map_size=16 << 20, leases=leases),
        long_term=SsdTier(path / "ssd", capacity_bytes=ssd_blocks * SSD_RECORD, ttl_s=7 * 86400.0,
                          segment_bytes=SSD_RECORD, leases=leases),
        max_ttl_s=180.0,
        max_lease_s=max_lease,
        leases=leases,
        clock=clock,
    )


def entries(store: KvStore) -> dict[str, int]:
    return {name: s.entries for name, s, _ in store.tier_stats()}


def test_long_term_goes_to_ram_and_ssd_short_term_to_ram_and_lmdb(tmp_path: Path) -> None:
    store = open_store(tmp_path, Clock())
    keys = chain(3)
    for i, k in enumerate(keys):
        assert store.put(k, blob(i))
    assert store.put(b"tail:r1", b"tail", ttl_s=60)
    assert entries(store) == {"ram": 4, "lmdb": 1, "ssd": 3}
    run = store.lookup(keys)
    assert (run.hits, run.by_tier) == (3, {"ram": 3, "lmdb": 0, "ssd": 0})
    assert store.delete([keys[0], b"tail:r1"]) == 2
    assert entries(store) == {"ram": 2, "lmdb": 0, "ssd": 2}
    store.close()


def test_ram_eviction_keeps_the_ssd_copy_and_a_read_promotes_it(tmp_path: Path) -> None:
    clock = Clock()
    store = open_store(tmp_path, clock, ram_blocks=2)
    keys = chain(4)
    for i, k in enumerate(keys):
        clock.t += 1
        assert store.put(k, blob(i))
    assert entries(store) == {"ram": 2, "lmdb": 0, "ssd": 4}
    run = store.lookup(keys)
    assert (run.hits, run.by_tier) == (4, {"ram": 2, "lmdb": 0, "ssd": 2})  # the first two only on SSD now
    assert store.get(keys[:1]) == [blob(0)]
    stats = {name: (s, t) for name, s, t in store.tier_stats()}
    assert stats["ssd"][1].hits == 1 and stats["ram"][1].misses == 1 and stats["ram"][1].promotions == 1
    assert stats["ram"][0].evictions == 3  # blocks 0 and 1 went at the puts, block 2 for the promotion
    assert store.lookup(keys).by_tier == {"ram": 2, "lmdb": 0, "ssd": 2}
    assert store.get(keys) == [blob(i) for i in range(4)]
    store.close()


def test_a_restart_finds_long_term_blocks_on_ssd(tmp_path: Path) -> None:
    clock = Clock()
    store = open_store(tmp_path, clock)
    keys = chain(5)
    for i, k in enumerate(keys):
        store.put(k, blob(i))
    store.close()
    store = open_store(tmp_path, clock)
    assert store.lookup(keys).by_tier == {"ram": 0, "lmdb": 0, "ssd": 5}
    assert store.get(keys) == [blob(i) for i in range(5)]
    assert store.lookup(keys).by_tier == {"ram": 5, "lmdb": 0, "ssd": 0}
    store.close()


def test_a_lease_keeps_the_run_in_its_tier_until_it_ends(tmp_path: Path) -> None:
    clock = Clock()
    store = open_store(tmp_path, clock, ram_blocks=3, ssd_blocks=3, max_lease=5.0)
    keys = chain(6)
    for i, k in enumerate(keys[:3]):
        clock.t += 1
        store.put(k, blob(i))
    run = store.lookup(keys[:2], lease_s=60.0)
    assert run.hits == 2 and run.lease_s == 5.0  # capped by the service's maximum
    clock.t += 1
    assert store.put(keys[3], blob(3))  # room comes from block 2, the only unleased one, in RAM and on SSD
    assert store.lookup(keys[:3]).hits == 2 and store.lookup(keys[:2]).by_tier["ram"] == 2
    assert store.lookup([keys[0], keys[1], keys[3]], lease_s=1.0).hits == 3
    assert not store.put(keys[4], blob(4))  # every SSD block leased: refused, nothing promised is lost
    assert store.get([keys[0], keys[1], keys[3]]) == [blob(0), blob(1), blob(3)]
    clock.t += 5.0  # the leases end
    assert store.put(keys[4], blob(4))
    assert store.lookup([keys[0]]).hits == 0  # the least recently used block made room
    assert store.lookup(keys[:0]).lease_s == 0.0 and store.counters.leases == 2
    store.close()


def test_warm_lmdb_blocks_move_to_ssd_when_read(tmp_path: Path) -> None:
    clock = Clock()
    keys = chain(2)
    old = KvStore(short_term=LmdbTier(tmp_path / "lmdb", capacity_bytes=4 << 20, map_size=16 << 20),
                  max_ttl_s=180.0, clock=clock)  # a store from before the SSD tier: long-term blocks in LMDB
    for i, k in enumerate(keys):
        old.put(k, blob(i))
    old.close()
    store = open_store(tmp_path, clock)
    assert store.lookup(keys).by_tier == {"ram": 0, "lmdb": 2, "ssd": 0}
    assert store.get(keys[:1]) == [blob(0)]
    assert entries(store) == {"ram": 1, "lmdb": 1, "ssd": 1}
    assert store.counters.migrations == 1
    assert store.lookup(keys).by_tier == {"ram": 1, "lmdb": 1, "ssd": 0}
    store.close()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, list[bytes]]] = []

    def stored(self, tier: str, keys: list[bytes]) -> None:
        self.events.append(("stored", tier, keys))

    def removed(self, tier: str, keys: list[bytes]) -> None:
        self.events.append(("removed", tier, keys))


def test_the_listener_hears_long_term_keys_come_and_go(tmp_path: Path) -> None:
    clock = Clock()
    store = open_store(tmp_path, clock, ram_blocks=1)
    heard = Recorder()
    store.watch(heard)
    a, b = chain(2)
    store.put(a, blob(0))
    store.put(b"tail:x", b"t", ttl_s=10)  # short-term: not reported
    store.put(b, blob(1))
    store.delete([a])
    assert heard.events == [  # a put makes its RAM copy first (readable at once), then writes its home tier
        ("stored", "ram", [a]),
        ("stored", "ssd", [a]),
        ("removed", "ram", [a]),  # b's RAM copy took its room
        ("stored", "ram", [b]),
        ("stored", "ssd", [b]),
        ("removed", "ssd", [a]),
    ]
    assert store.long_term_keys() == {"ram": [b], "lmdb": [], "ssd": [b]}
    store.close()


def test_config_defaults_and_segment_clamp(tmp_path: Path) -> None:
    config = KvCacheConfig(tmp_path)
    assert config.ssd_ttl_days == 7.0 and config.tail_ttl_s == 180.0 and config.ram_bytes > 0
    assert config.segment_bytes == 64 << 20
    assert KvCacheConfig(tmp_path, ssd_bytes=8 << 20).segment_bytes == 1 << 20


# --- the event loop's RAM path (hot_run / hot_lookup / put_hot + put_home) -------------------------------------------


def test_a_run_is_served_from_ram_then_read_on_from_disk(tmp_path: Path) -> None:
    store = open_store(tmp_path, Clock(), ram_blocks=3)
    keys = chain(6)
    for i, key in enumerate(keys[:5]):
        assert store.put(key, blob(i))  # RAM keeps the last 3, SSD all 5
    hot, at_miss = store.hot_run(keys[2:], max_bytes=2 * SIZE, first_bytes=2 * SIZE)
    assert hot == [blob(2), blob(3)] and not at_miss  # stopped by the byte budget, not by a miss
    big, _ = store.hot_run(keys[4:], max_bytes=1, first_bytes=SIZE)
    assert big == [blob(4)]  # the first blob may exceed the soft budget (a part bigger than a batch goes alone)
    run, at_miss = store.hot_run(keys, max_bytes=10 * SIZE, first_bytes=10 * SIZE)
    assert run == [] and at_miss  # the first two left RAM: the run's start is on disk
    run, at_miss = store.read_run(keys, max_bytes=10 * SIZE, first_bytes=10 * SIZE)
    assert run == [blob(i) for i in range(5)] and at_miss  # keys[5] was never stored: the run ends there
    store.close()


def test_hot_lookup_answers_only_when_ram_holds_the_whole_run(tmp_path: Path) -> None:
    store = open_store(tmp_path, Clock(), ram_blocks=2)
    keys = chain(3)
    for i, key in enumerate(keys):
        store.put(key, blob(i))
    assert store.hot_lookup(keys) is None  # keys[0] is only on SSD: the disk must be asked
    run = store.hot_lookup(keys[1:], lease_s=5.0)
    assert run is not None and run.hits == 2 and run.by_tier["ram"] == 2 and run.lease_s == 5.0
    assert store.lookup(keys).hits == 3
    store.close()


def test_a_put_whose_home_refuses_it_leaves_no_ram_copy(tmp_path: Path) -> None:
    store = open_store(tmp_path, Clock(), ssd_blocks=1)
    key = chain(1)[0]
    too_big = b"x" * (4 * SSD_RECORD)
    expires_at = store.put_hot(key, too_big)
    assert expires_at == 0.0 and store.hot_run([key], 1 << 20, 1 << 20)[0] == [too_big]  # readable at once
    assert not store.put_home(key, too_big, expires_at)
    assert store.hot_run([key], 1 << 20, 1 << 20) == ([], True) and store.get([key]) == [None]
    assert store.put_hot(b"", b"x") is None  # a bad key is refused up front
    store.close()
