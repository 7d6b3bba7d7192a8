"""The RAM tier: hot copies in process memory, bounded in bytes, least recently used first out.

Every entry here is a copy: its home (SSD for long-term blocks, LMDB for short-term entries) holds it too, so
eviction just forgets the copy and a restart loses nothing. Leased keys are skipped by eviction.

Where the payloads lie is a `Payloads` plug-in:
- `BytesPayloads`: the immutable `bytes` the store was given or read, so a put, a promotion and a hit copy
  nothing; private to the process.
- `HeapPayloads` (services/kvcache/heap.py, the default on Linux): a shared-memory heap the store owns; a put
  copies once into it, a hit is a view of it, and same-host workers read runs of it by descriptor under a read
  lease (`lend`), so the store copies nothing on their gets. A payload dropped (evicted, expired, deleted,
  replaced) while a lease or a view holds it keeps its bytes until they let go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from services.kvcache.leases import Leases
from services.kvcache.store import Entry, TierStats

ENTRY_OVERHEAD = 64  # a rough per-entry cost (dict slot, tuple, key object) counted against the capacity


class Payloads(Protocol):
    """Where the RAM tier keeps its payloads: `keep` stores one and returns its handle (anything with a len),
    `read` gives its bytes back, `drop` forgets it."""

    def keep(self, data: bytes | memoryview) -> Any | None:
        """A handle to a copy of `data`, or None when there is no room for it (the tier evicts and retries)."""
        ...

    def read(self, handle: Any) -> bytes | memoryview: ...

    def drop(self, handle: Any) -> None: ...

    def held(self, handle: Any) -> bool:
        """Whether dropping it now would free nothing (a lease or a view holds its bytes)."""
        ...

    def lend(self, handles: list[Any], deadline: float) -> int:
        """A read lease on `handles` until `deadline` (CLOCK_MONOTONIC): its id; 0 when they cannot be lent."""
        ...

    def release(self, lease: int) -> bool: ...

    def expire(self, now: float | None = None) -> int: ...

    def close(self) -> None: ...


class BytesPayloads:
    """Payloads as `bytes` in the process: nothing to lend by descriptor."""

    def keep(self, data: bytes | memoryview) -> bytes:
        return data if isinstance(data, bytes) else bytes(data)

    def read(self, handle: bytes) -> bytes:
        return handle

    def drop(self, handle: bytes) -> None:
        pass

    def held(self, handle: bytes) -> bool:
        return False

    def lend(self, handles: list[Any], deadline: float) -> int:
        return 0

    def release(self, lease: int) -> bool:
        return False

    def expire(self, now: float | None = None) -> int:
        return 0

    def close(self) -> None:
        pass


class RamTier:
    name = "ram"

    def __init__(self, *, capacity_bytes: int, leases: Leases | None = None, payloads: Payloads | None = None) -> None:
        self._capacity = capacity_bytes
        self._leases = leases if leases is not None else Leases()
        self.payloads: Payloads = payloads if payloads is not None else BytesPayloads()
        self._entries: OrderedDict[bytes, tuple[Any, float]] = OrderedDict()  # (handle, expires_at), oldest first
        self._bytes = 0
        self._evictions = self._expired = 0
        self.on_removed: Callable[[list[bytes]], None] | None = None  # long-term keys that left (store.Listener)

    def holds(self, keys: Sequence[bytes], now: float) -> list[bool]:
        return [self._live(key, now) is not None for key in keys]

    def get(self, keys: Sequence[bytes], now: float) -> list[Entry | None]:
        out: list[Entry | None] = []
        for key in keys:
            entry = self._live(key, now)
            if entry is not None:
                self._entries.move_to_end(key)
            out.append(None if entry is None else (self.payloads.read(entry[0]), entry[1]))
        return out

    def lend(self, keys: Sequence[bytes], now: float, deadline: float) -> tuple[int, list[Any]]:
        """(a read lease until `deadline`, the handles of the leading run of `keys` held here): lease 0 and no
        handles when the payloads cannot be lent (`BytesPayloads`) or the first key is not here."""
        handles = []
        for key in keys:
            entry = self._live(key, now)
            if entry is None:
                break
            self._entries.move_to_end(key)
            handles.append(entry[0])
        lease = self.payloads.lend(handles, deadline)
        return (lease, handles) if lease else (0, [])

    def release(self, lease: int) -> bool:
        return self.payloads.release(lease)

    def put(self, key: bytes, data: bytes | memoryview, expires_at: float, now: float) -> bool:
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
        handle = self.payloads.keep(data)
        while handle is None and self._evict_one(now):  # room in bytes, but no free extent fits: older ones go
            handle = self.payloads.keep(data)
        if handle is None:
            return False
        self._entries[key] = (handle, expires_at)
        self._bytes += need
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        return sum(self._drop(key) for key in keys)

    def sweep(self, now: float) -> int:
        self.payloads.expire()
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
        self.payloads.close()

    def _live(self, key: bytes, now: float) -> tuple[Any, float] | None:
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

    def _evict_one(self, now: float) -> bool:
        """Drop the least recently used entry that is not leased and whose bytes would really be freed; False when
        there is none."""
        for key, (handle, _) in self._entries.items():
            if not self._leases.held(key, now) and not self.payloads.held(handle):
                self._drop(key)
                self._evictions += 1
                return True
        return False

    def _drop(self, key: bytes) -> int:
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self._bytes -= _cost(key, entry[0])
        self.payloads.drop(entry[0])
        if not entry[1] and self.on_removed is not None:
            self.on_removed([key])
        return 1


def _cost(key: bytes, data: Any) -> int:
    return len(key) + len(data) + ENTRY_OVERHEAD


def _expired(expires_at: float, now: float) -> bool:
    return bool(expires_at) and expires_at <= now
