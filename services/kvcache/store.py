"""The KV store: tiers behind one interface, plus the counters the service reports.

Keys are opaque bytes: long-term blocks use the chained block hash (`shared.hashing`), short-term entries (a
request's partial tail block) a key the caller chose, with a TTL. The store never returns bytes for a key it does
not hold exactly and intact: tiers verify a checksum on every read and treat a bad record as absent.

Tiers are ordered fastest first. This issue has one (LMDB); the RAM and SSD tiers and promotion between them
plug in here later without changing the service.

The store is synchronous and not thread-safe: the service calls it from one I/O thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

MAX_KEY_BYTES = 256  # LMDB keys are at most 511 bytes and the tiers' indexes prefix 8 bytes to them


@dataclass(frozen=True)
class TierStats:
    entries: int
    bytes: int
    capacity_bytes: int
    evictions: int  # long-term blocks dropped to make room
    expired: int  # short-term entries dropped by TTL
    corrupt: int  # records that failed their checksum (deleted, never returned)


class Tier(Protocol):
    """One storage level. `now` is unix time; `expires_at` 0 means long-term (no expiry)."""

    name: str

    def prefix_run(self, keys: Sequence[bytes], now: float) -> int:
        """How many of `keys`, from the first, this tier holds (unexpired)."""
        ...

    def get(self, keys: Sequence[bytes], now: float) -> list[bytes | None]: ...

    def put(self, key: bytes, data: bytes, expires_at: float, now: float) -> bool:
        """Store, evicting long-term entries if needed; False when the entry cannot fit."""
        ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def sweep(self, now: float) -> int:
        """Drop expired entries and persist bookkeeping; returns how many expired."""
        ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


@dataclass
class Counters:
    lookups: int = 0
    lookup_blocks_hit: int = 0
    lookup_blocks_missed: int = 0
    get_hits: int = 0
    get_misses: int = 0
    bytes_read: int = 0
    puts: int = 0
    puts_refused: int = 0
    bytes_written: int = 0
    deletes: int = 0


class KvStore:
    def __init__(self, tiers: Sequence[Tier], *, max_ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        assert tiers, "a store needs at least one tier"
        self._tiers = list(tiers)
        self._max_ttl_s = max_ttl_s
        self._clock = clock
        self.counters = Counters()

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Length of the longest run of `hashes`, from the first, held by any combination of tiers."""
        now = self._clock()
        keys = _valid_prefix(hashes)
        hits = 0
        while hits < len(keys):
            # Greedy is exact: each step extends by the longest run any tier holds from `hits` on.
            step = max(tier.prefix_run(keys[hits:], now) for tier in self._tiers)
            if step == 0:
                break
            hits += step
        self.counters.lookups += 1
        self.counters.lookup_blocks_hit += hits
        self.counters.lookup_blocks_missed += len(hashes) - hits
        return hits

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        now = self._clock()
        found: list[bytes | None] = [None] * len(keys)
        for tier in self._tiers:
            wanted = [i for i, k in enumerate(keys) if found[i] is None and _valid_key(k)]
            if not wanted:
                break
            for i, blob in zip(wanted, tier.get([keys[i] for i in wanted], now)):
                found[i] = blob
        hits = [b for b in found if b is not None]
        self.counters.get_hits += len(hits)
        self.counters.get_misses += len(keys) - len(hits)
        self.counters.bytes_read += sum(len(b) for b in hits)
        return found

    def put(self, key: bytes, data: bytes, ttl_s: float = 0.0) -> bool:
        """Long-term when `ttl_s` is 0, else short-term for min(ttl_s, max TTL) seconds."""
        self.counters.puts += 1
        if not _valid_key(key) or ttl_s < 0:
            self.counters.puts_refused += 1
            return False
        now = self._clock()
        expires_at = now + min(ttl_s, self._max_ttl_s) if ttl_s > 0 else 0.0
        stored = self._tiers[0].put(key, data, expires_at, now)
        if stored:
            self.counters.bytes_written += len(data)
        else:
            self.counters.puts_refused += 1
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        valid = [k for k in keys if _valid_key(k)]
        deleted = sum(tier.delete(valid) for tier in self._tiers)
        self.counters.deletes += deleted
        return deleted

    def sweep(self) -> int:
        now = self._clock()
        return sum(tier.sweep(now) for tier in self._tiers)

    def stats(self) -> dict[str, object]:
        return {"counters": asdict(self.counters), **{t.name: asdict(t.stats()) for t in self._tiers}}

    def close(self) -> None:
        for tier in self._tiers:
            tier.close()


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
