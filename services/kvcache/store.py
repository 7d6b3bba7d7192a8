"""The KV store: three tiers behind one interface, the routing between them, and the counters the service reports.

Keys are opaque bytes: long-term blocks use the chained block hash (`shared.hashing`), short-term entries (a
request's partial tail block, its model state) a key the caller chose, with a TTL. The store never returns bytes
for a key it does not hold exactly and intact: tiers verify a checksum on every read and treat a bad record as
absent.

Where an entry lives:

    put, long-term (ttl 0)   ->  RAM  +  SSD (write-through; SSD is the copy that counts)
    put, short-term (ttl>0)  ->  RAM  +  LMDB (TTL, at most the max TTL)
    get                      ->  RAM, then LMDB, then SSD; a hit below RAM is promoted into RAM
    RAM full                 ->  drop the least recently used RAM copies (their home tier still holds them)
    no SSD tier configured   ->  long-term blocks live in LMDB, as before the SSD tier existed

LMDB may also hold long-term "warm" blocks: all of them when the SSD tier is off, and those written by a version
of this service that had no SSD tier. With the SSD tier on, such a block moves to SSD the first time it is read.

A put reports success when the entry's home tier (SSD or LMDB) stored it; the RAM copy is best effort. Leases
(`leases.py`) taken by `lookup` make every tier's capacity eviction skip the leased keys.

A `Listener` (`watch`) hears which long-term keys each tier gained and lost, for KV events; `long_term_keys`
lists what each tier holds now, for snapshots. Short-term keys are not reported: they are per request.

Two threads call the store. The disk tiers (LMDB, SSD) are touched only by the service's one I/O thread. The RAM
tier, the leases and the counters sit behind a lock, so the event loop can serve what RAM holds at once
(`hot_run`, `hot_lookup`, `put_hot`) while a disk write is under way on the I/O thread: a put is a RAM copy first,
readable immediately, then the write to its home tier (`put_home`), whose result the put reports.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from services.kvcache.leases import Leases

RUN_READ = 16  # keys per disk read of a prefix run (the SSD tier reads a run's segment pieces together)
MAX_KEY_BYTES = 256  # LMDB keys are at most 511 bytes and the tiers' indexes prefix 8 bytes to them

# (payload, expires_at): expires_at 0.0 = long-term, no expiry. A RAM payload in the shared heap is a read-only
# view of it that holds its bytes while it lives (services/kvcache/heap.py)
Entry = tuple[bytes | memoryview, float]


@dataclass(frozen=True)
class TierStats:
    entries: int
    bytes: int  # stored records (header + payload) that are live
    capacity_bytes: int
    evictions: int  # entries dropped to make room
    expired: int  # entries dropped by TTL
    corrupt: int  # records that failed their checksum (dropped, never returned)
    disk_bytes: int = 0  # bytes the tier holds on disk, live or not (0 for RAM)


class Tier(Protocol):
    """One storage level. `now` is unix time; `expires_at` 0 means long-term (a tier may apply its own TTL)."""

    name: str
    on_removed: Callable[[list[bytes]], None] | None  # called with long-term keys that left (evicted, expired...)

    def holds(self, keys: Sequence[bytes], now: float) -> list[bool]:
        """Which of `keys` this tier holds, unexpired (from its index: a bad checksum shows only at get)."""
        ...

    def get(self, keys: Sequence[bytes], now: float) -> list[Entry | None]: ...

    def put(self, key: bytes, data: bytes, expires_at: float, now: float) -> bool:
        """Store, evicting unleased entries if the tier does that; False when the entry cannot fit."""
        ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def sweep(self, now: float) -> int:
        """Drop expired entries and persist bookkeeping; returns how many expired."""
        ...

    def long_term_keys(self) -> list[bytes]: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


class HotTier(Tier, Protocol):
    """The RAM tier: a Tier whose payloads same-host readers may lease by descriptor (tiers/ram.py)."""

    def lend(self, keys: Sequence[bytes], now: float, deadline: float) -> tuple[int, list[Any]]: ...

    def release(self, lease: int) -> bool: ...


class Listener(Protocol):
    """Hears long-term keys become findable in a tier, or leave it. Called on the store's thread; keep it cheap."""

    def stored(self, tier: str, keys: list[bytes]) -> None: ...

    def removed(self, tier: str, keys: list[bytes]) -> None: ...


@dataclass
class Counters:
    lookups: int = 0
    lookup_blocks_hit: int = 0
    lookup_blocks_missed: int = 0
    leases: int = 0  # lookups that leased their run
    get_hits: int = 0
    get_misses: int = 0
    bytes_read: int = 0
    puts: int = 0
    puts_refused: int = 0
    bytes_written: int = 0
    deletes: int = 0
    migrations: int = 0  # long-term blocks moved from LMDB to SSD on read


@dataclass
class Traffic:
    """What the store saw of one tier: the tier itself does not know whether a miss fell through to another."""

    hits: int = 0
    misses: int = 0
    promotions: int = 0  # entries copied into this tier from a slower one


@dataclass(frozen=True)
class Run:
    """A lookup's answer: the longest stored prefix run, and the fastest tier holding each of its blocks."""

    hits: int
    by_tier: dict[str, int] = field(default_factory=dict)
    lease_s: float = 0.0  # how long the run is leased (0: not leased)


class KvStore:
    def __init__(
        self,
        *,
        short_term: Tier,
        long_term: Tier | None = None,
        ram: HotTier | None = None,
        max_ttl_s: float,
        max_lease_s: float = 30.0,
        leases: Leases | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ram = ram
        self._short = short_term
        self._long = long_term
        self._read_order = [t for t in (ram, short_term, long_term) if t is not None]  # fastest first
        self._max_ttl_s = max_ttl_s
        self._max_lease_s = max_lease_s
        self.leases = leases if leases is not None else Leases()
        self._clock = clock
        self.counters = Counters()
        self.traffic = {tier.name: Traffic() for tier in self._read_order}
        self._listener: Listener | None = None
        # Guards the RAM tier, the leases and the counters (the event loop and the I/O thread both use them).
        # Re-entrant: a tier's on_removed may run inside a locked call and come back through the listener.
        self._hot = threading.RLock()

    def watch(self, listener: Listener) -> None:
        self._listener = listener
        for tier in self._read_order:
            tier.on_removed = functools.partial(listener.removed, tier.name)

    def long_term_keys(self) -> dict[str, list[bytes]]:
        out = {}
        for tier in self._read_order:
            with self._hot if tier is self._ram else _NO_LOCK:  # never hold the loop's lock over a disk index
                out[tier.name] = tier.long_term_keys()
        return out

    @property
    def tiers(self) -> list[Tier]:
        return list(self._read_order)

    def lookup(self, hashes: Sequence[bytes], lease_s: float = 0.0) -> Run:
        """The longest run of `hashes`, from the first, held by any combination of tiers; leased on request."""
        now = self._clock()
        keys = _valid_prefix(hashes)
        place: list[str | None] = [None] * len(keys)
        for tier in self._read_order:
            todo = [i for i, p in enumerate(place) if p is None]
            if not todo:
                break
            with self._hot if tier is self._ram else _NO_LOCK:
                held = tier.holds([keys[i] for i in todo], now)
            for i, h in zip(todo, held):
                if h:
                    place[i] = tier.name
        hits = place.index(None) if None in place else len(place)
        return self._answer(hashes, keys, [p for p in place[:hits] if p is not None], lease_s, now)

    def hot_lookup(self, hashes: Sequence[bytes], lease_s: float = 0.0) -> Run | None:
        """`lookup` from the RAM tier alone, without touching a disk: None unless RAM holds every hash (only then
        is the run known without asking the tiers below)."""
        if self._ram is None:
            return None
        now = self._clock()
        keys = _valid_prefix(hashes)
        with self._hot:
            if len(keys) < len(hashes) or not all(self._ram.holds(keys, now)):
                return None
            return self._answer(hashes, keys, [self._ram.name] * len(keys), lease_s, now)

    def _answer(self, hashes: Sequence[bytes], keys: list[bytes], place: list[str], lease_s: float, now: float
                ) -> Run:
        hits = len(place)
        by_tier = {tier.name: 0 for tier in self._read_order}
        for name in place:
            by_tier[name] += 1
        granted = min(lease_s, self._max_lease_s) if hits and lease_s > 0 else 0.0
        with self._hot:
            if granted:
                self.leases.take(keys[:hits], now + granted)
                self.counters.leases += 1
            self.counters.lookups += 1
            self.counters.lookup_blocks_hit += hits
            self.counters.lookup_blocks_missed += len(hashes) - hits
        return Run(hits, by_tier, granted)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        now = self._clock()
        found: list[bytes | None] = [None] * len(keys)
        for tier in self._read_order:
            wanted = [i for i, k in enumerate(keys) if found[i] is None and _valid_key(k)]
            if not wanted:
                break
            with self._hot if tier is self._ram else _NO_LOCK:
                entries = tier.get([keys[i] for i in wanted], now)
            with self._hot:
                traffic = self.traffic[tier.name]
                traffic.hits += sum(e is not None for e in entries)
                traffic.misses += sum(e is None for e in entries)
            for i, entry in zip(wanted, entries):
                if entry is not None:
                    found[i] = entry[0]
                    if tier is not self._ram:
                        self._promote(tier, keys[i], entry, now)
        self._count_read([b for b in found if b is not None], len(keys))
        return found

    def hot_run(self, keys: Sequence[bytes], max_bytes: int, first_bytes: int) -> tuple[list[bytes], bool]:
        """(the leading run of `keys` that RAM holds, its blobs within `max_bytes` in all (the first may be up to
        `first_bytes`); True when it stopped at a key RAM lacks). No disk is touched: `read_run` reads on."""
        if self._ram is None:
            return [], bool(keys)
        now = self._clock()
        run: list[bytes] = []
        with self._hot:
            for key in keys:
                entry = self._ram.get([key], now)[0] if _valid_key(key) else None
                if entry is None:
                    break
                if not _fits(entry[0], run, max_bytes, first_bytes):
                    self._count_hot(run)
                    return run, False
                run.append(entry[0])
            self._count_hot(run)
        return run, len(run) < len(keys)

    def read_run(self, keys: Sequence[bytes], max_bytes: int, first_bytes: int) -> tuple[list[bytes], bool]:
        """`hot_run` through every tier, for the I/O thread: True when the run ended at an absent key."""
        run: list[bytes] = []
        for at in range(0, len(keys), RUN_READ):
            for blob in self.get(keys[at : at + RUN_READ]):
                if blob is None:
                    return run, True
                if not _fits(blob, run, max_bytes, first_bytes):
                    return run, False
                run.append(blob)
        return run, False

    def lend_hot(self, keys: Sequence[bytes], deadline: float) -> tuple[int, list[Any]]:
        """A read lease until `deadline` (CLOCK_MONOTONIC) on the leading run of `keys` that RAM holds, for a
        same-host reader of the shared heap: (lease id, where each blob lies); (0, []) when RAM's payloads are
        not shared or the first key is not in RAM. The blobs stay as they are until `release_hot` or the
        deadline, whatever is evicted, expired or deleted meanwhile."""
        if self._ram is None:
            return 0, []
        now = self._clock()
        with self._hot:
            lease, handles = self._ram.lend(_valid_prefix(keys), now, deadline)
            self._count_hot(handles)
        return lease, handles

    def ram_payloads(self) -> object | None:
        """The RAM tier's payload store (tiers/ram.py `Payloads`), for its counters."""
        return getattr(self._ram, "payloads", None)

    def release_hot(self, lease: int) -> bool:
        with self._hot:
            return self._ram is not None and self._ram.release(lease)

    def _count_hot(self, run: Sequence[Any]) -> None:
        assert self._ram is not None
        self.traffic[self._ram.name].hits += len(run)
        self._count_read(run, len(run))

    def _count_read(self, hits: Sequence[Any], asked: int) -> None:
        with self._hot:
            self.counters.get_hits += len(hits)
            self.counters.get_misses += asked - len(hits)
            self.counters.bytes_read += sum(len(b) for b in hits)

    def put(self, key: bytes, data: bytes, ttl_s: float = 0.0) -> bool:
        """Long-term when `ttl_s` is 0, else short-term for min(ttl_s, max TTL) seconds."""
        expires_at = self.put_hot(key, data, ttl_s)
        return expires_at is not None and self.put_home(key, data, expires_at)

    def put_hot(self, key: bytes, data: bytes | memoryview, ttl_s: float = 0.0) -> float | None:
        """The first half of a put, any thread, no disk: a RAM copy (best effort: a refused copy still reads from
        home once `put_home` stored it). Returns the entry's expires_at for `put_home`, None for a bad put."""
        now = self._clock()
        with self._hot:
            self.counters.puts += 1
            if not _valid_key(key) or ttl_s < 0:
                self.counters.puts_refused += 1
                return None
            expires_at = now + min(ttl_s, self._max_ttl_s) if ttl_s > 0 else 0.0
            if self._ram is not None and self._ram.put(key, data, expires_at, now):
                self._stored(self._ram, key, expires_at)
        return expires_at

    def put_hot_from(self, keys: Sequence[bytes], views: Sequence[memoryview], ttl_s: float,
                     valid: Callable[[], bool]) -> list[tuple[float | None, bytes | memoryview]] | None:
        """`put_hot` of blobs lying in a buffer that may be taken back (a worker's arena slot), each copied once:
        into RAM, or where RAM refuses it into a `bytes`. Then `valid()` says whether the buffer was still ours
        for the whole copy: if not, the RAM copies are dropped again and None returned (no reader saw them:
        all under the lock). Else, per key, (expires_at for `put_home`, the bytes it writes: the RAM copy, a
        view that keeps it, or the private one)."""
        now = self._clock()
        out: list[tuple[float | None, bytes | memoryview]] = []
        with self._hot:
            for key, view in zip(keys, views):
                expires_at = self.put_hot(key, view, ttl_s)
                entry = self._ram.get([key], now)[0] if self._ram is not None and expires_at is not None else None
                out.append((expires_at, entry[0] if entry is not None else bytes(view)))
            if not valid():
                if self._ram is not None:
                    self._ram.delete(list(keys))
                return None
        return out

    def put_home(self, key: bytes, data: bytes | memoryview, expires_at: float) -> bool:
        """The second half, on the I/O thread: the write to the entry's home tier, the copy that counts."""
        home = self._short if expires_at or self._long is None else self._long
        if not home.put(key, data, expires_at, self._clock()):
            with self._hot:
                self.counters.puts_refused += 1
                if self._ram is not None:
                    self._ram.delete([key])  # no copy without its home: a later read must not find a lost entry
            return False
        with self._hot:
            self.counters.bytes_written += len(data)
        self._stored(home, key, expires_at)
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        valid = [k for k in keys if _valid_key(k)]
        # Every tier may hold a copy; an entry counts once, by its home tier (RAM copies are not entries of their own).
        deleted = sum(tier.delete(valid) for tier in self._read_order if tier is not self._ram)
        with self._hot:
            if self._ram is not None:
                self._ram.delete(valid)
            self.counters.deletes += deleted
        return deleted

    def sweep(self) -> int:
        now = self._clock()
        with self._hot:
            self.leases.sweep(now)
            expired = self._ram.sweep(now) if self._ram is not None else 0
        return expired + sum(tier.sweep(now) for tier in self._read_order if tier is not self._ram)

    def tier_stats(self) -> list[tuple[str, TierStats, Traffic]]:
        return [(t.name, t.stats(), self.traffic[t.name]) for t in self._read_order]

    def stats(self) -> dict[str, object]:
        return {
            "counters": asdict(self.counters),
            "leases": len(self.leases),
            **{t.name: {**asdict(t.stats()), **asdict(self.traffic[t.name])} for t in self._read_order},
        }

    def close(self) -> None:
        with self._hot:
            for tier in self._read_order:
                tier.close()

    def _promote(self, source: Tier, key: bytes, entry: Entry, now: float) -> None:
        data, expires_at = entry
        with self._hot:
            if self._ram is not None and self._ram.put(key, data, expires_at, now):
                self.traffic[self._ram.name].promotions += 1
                self._stored(self._ram, key, expires_at)
        if source is self._short and not expires_at and self._long is not None:
            # A warm long-term block in LMDB: its home is the SSD tier now.
            if self._long.put(key, data, 0.0, now):
                self._stored(self._long, key, 0.0)
                self._short.delete([key])
                with self._hot:
                    self.counters.migrations += 1

    def _stored(self, tier: Tier, key: bytes, expires_at: float) -> None:
        if self._listener is not None and not expires_at:
            self._listener.stored(tier.name, [key])


def _fits(blob: bytes, run: list[bytes], max_bytes: int, first_bytes: int) -> bool:
    return len(blob) <= (max_bytes - sum(map(len, run)) if run else first_bytes)


_NO_LOCK = contextlib.nullcontext()  # the disk tiers: only the I/O thread touches them


def _valid_key(key: bytes) -> bool:
    return 0 < len(key) <= MAX_KEY_BYTES


def _valid_prefix(keys: Sequence[bytes]) -> list[bytes]:
    """Keys up to the first invalid one: a key no tier can hold ends any prefix run."""
    out: list[bytes] = []
    for key in keys:
        if not _valid_key(key):
            break
        out.append(key)
    return out
