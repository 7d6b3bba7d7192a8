"""The RAM tier: hot copies in process memory, bounded in bytes, least recently used first out.

Every entry here is a copy: its home (SSD for long-term blocks, LMDB for short-term entries) holds it too, so
eviction just forgets the copy and a restart loses nothing. Payloads are kept as the immutable `bytes` the store
was given or read, so a put, a promotion and a hit copy nothing. Leased keys are skipped by eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from services.kvcache.leases import Leases
from services.kvcache.store import Entry, TierStats

ENTRY_OVERHEAD = 64  # a rough per-entry cost (dict slot, tuple, key object) counted against the capacity


class RamTier:
    name = "ram"

    def __init__(self, *, capacity_bytes: int, leases: Leases | None = None) -> None:
        self._capacity = capacity_bytes
        self._leases = leases if leases is not None else Leases()
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # oldest access first
        self._bytes = 0
        self._evictions = self._expired = 0
        self.on_removed: Callable[[list[bytes]], None] | None = None  # long-term keys that left (store.Listener)

    def holds(self, keys: Sequence[bytes], now: float) -> list[bool]:
        return [self._live(key, now) is not None for key in keys]

    def get(self, keys: Sequence[bytes], now: float) -> list[Entry | None]:
        out = []
        for key in keys:
            entry = self._live(key, now)
            if entry is not None:
                self._entries.move_to_end(key)
            out.append(entry)
        return out

    def put(self, key: bytes, data: bytes, expires_at: float, now: float) -> bool:
        need = _cost(key, data)
        if need > self._capacity:
            return False
        held = self._entries.get(key)
        if held is not None and not held[1] and not expires_at:
            self._entries.move_to_end(key)  # a long-term key names its content: already here
            return True
        self._drop(key)
        if not self._make_room(need, now):
            return False
        self._entries[key] = (data, expires_at)
        self._bytes += need
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        return sum(self._drop(key) for key in keys)

    def sweep(self, now: float) -> int:
        due = [key for key, (_, expires_at) in self._entries.items() if _expired(expires_at, now)]
        for key in due:
            self._drop(key)
        self._expired += len(due)
        return len(due)

    def long_term_keys(self) -> list[bytes]:
        return [key for key, (_, expires_at) in self._entries.items() if not expires_at]

    def stats(self) -> TierStats:
        return TierStats(
            entries=len(self._entries),
            bytes=self._bytes,
            capacity_bytes=self._capacity,
            evictions=self._evictions,
            expired=self._expired,
            corrupt=0,
        )

    def close(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _live(self, key: bytes, now: float) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None and _expired(entry[1], now):
            self._drop(key)
            self._expired += 1
            return None
        return entry

    def _make_room(self, need: int, now: float) -> bool:
        excess = self._bytes + need - self._capacity
        if excess <= 0:
            return True
        victims = []
        for key, (data, _) in self._entries.items():  # oldest first
            if self._leases.held(key, now):
                continue
            victims.append(key)
            excess -= _cost(key, data)
            if excess <= 0:
                break
        if excess > 0:
            return False  # the rest is leased: skip the copy rather than break a promise
        for key in victims:
            self._drop(key)
        self._evictions += len(victims)
        return True

    def _drop(self, key: bytes) -> int:
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self._bytes -= _cost(key, entry[0])
        if not entry[1] and self.on_removed is not None:
            self.on_removed([key])
        return 1


def _cost(key: bytes, data: bytes) -> int:
    return len(key) + len(data) + ENTRY_OVERHEAD


def _expired(expires_at: float, now: float) -> bool:
    return bool(expires_at) and expires_at <= now
