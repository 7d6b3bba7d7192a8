"""The LMDB tier: one environment under `<state_dir>/kvcache/`, four named databases.

    blocks  key                      -> record (header + payload, see `record.py`)
    meta    key                      -> (expires_at f64, last_access f64, record bytes u64)
    lru     be64(last_access us)+key -> b""    long-term entries, oldest access first
    expiry  be64(expires_at us)+key  -> b""    short-term entries, soonest expiry first

Every change to one key touches its rows in one write transaction, so the indexes never disagree with the
blocks. Capacity counts record bytes; when a put would pass it, the least recently used long-term (warm) blocks
go, except leased ones. Short-term entries are never evicted for room (a request in flight needs its tail); they
leave by TTL, and a put that cannot fit is refused. Reads do not write: a hit's access time is remembered in
memory and written at the next put or sweep, so the recency order is at most one sweep interval stale.

Durability: the environment is opened without fsync on commit and synced at every sweep. A process crash loses
nothing; a machine crash may lose the last seconds of puts, which for a cache only costs recomputation
(LMDB stays consistent without MDB_WRITEMAP, and the checksum guards what it returns).

The environment is opened once, in the process that uses it: LMDB handles must not cross a fork.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import lmdb

from services.kvcache.leases import Leases
from services.kvcache.store import Entry, TierStats
from services.kvcache.tiers import record

log = logging.getLogger(__name__)

_META = struct.Struct("<ddQ")
_TICK = struct.Struct(">Q")  # big-endian so byte order is time order


class _Meta(NamedTuple):
    expires_at: float  # 0.0 = long-term
    last_access: float
    size: int  # record bytes


@dataclass
class _Change:
    """What one write transaction did, applied to the in-memory totals only once it has committed."""

    bytes: int = 0
    entries: int = 0
    evicted: int = 0
    expired: int = 0
    removed: list[bytes] = field(default_factory=list)  # long-term keys that left


class _NoRoom(Exception):
    """Raised inside a write transaction to abort it: the entry cannot fit."""


def _index(t: float, key: bytes) -> bytes:
    return _TICK.pack(int(t * 1e6)) + key


class LmdbTier:
    name = "lmdb"

    def __init__(self, path: Path, *, capacity_bytes: int, map_size: int, leases: Leases | None = None) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._leases = leases if leases is not None else Leases()
        self._pid = os.getpid()
        # Readahead on (DESIGN.md): values are big and read whole; without it a cold block reads at ~60 MB/s here
        # against ~550 MB/s with it (bench/kv_tiers.py).
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=4, sync=False, metasync=False, readahead=True)
        self._blocks = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._lru = self._env.open_db(b"lru")
        self._expiry = self._env.open_db(b"expiry")
        self._capacity = capacity_bytes
        self._touched: dict[bytes, float] = {}  # long-term hits not yet written to the lru index
        self._entries, self._bytes = self._count()
        self._evictions = self._expired = self._corrupt = 0
        self.on_removed: Callable[[list[bytes]], None] | None = None  # long-term keys that left (store.Listener)

    # --- Tier --------------------------------------------------------------------------------------------------

    def holds(self, keys: Sequence[bytes], now: float) -> list[bool]:
        # Presence only, from the small meta rows: a block that later fails its checksum reads as a miss at get.
        with self._begin() as txn:
            metas = [self._read_meta(txn, key) for key in keys]
        return [meta is not None and not _expired(meta.expires_at, now) for meta in metas]

    def get(self, keys: Sequence[bytes], now: float) -> list[Entry | None]:
        out: list[Entry | None] = []
        corrupt: list[bytes] = []
        self._check_pid()
        with self._env.begin(buffers=True) as txn:  # zero-copy views: one copy per payload, in unpack
            for key in keys:
                raw = txn.get(key, db=self._blocks)
                if raw is None:
                    out.append(None)
                    continue
                try:
                    payload, expires_at = record.unpack(raw)
                except record.CorruptRecord as exc:
                    log.warning("dropping corrupt block %s: %s", key.hex(), exc)
                    corrupt.append(key)
                    out.append(None)
                    continue
                if _expired(expires_at, now):
                    out.append(None)
                    continue
                if not expires_at:
                    self._touched[key] = now
                out.append((payload, expires_at))
        if corrupt:
            self._corrupt += self.delete(corrupt)
        return out

    def put(self, key: bytes, data: bytes, expires_at: float, now: float) -> bool:
        rec = record.pack(data, expires_at)
        if len(rec) > self._capacity:
            return False
        try:
            with self._begin(write=True) as txn:
                self._flush_touched(txn)
                change = self._put_in(txn, key, rec, expires_at, now)
        except _NoRoom:
            return False
        except lmdb.MapFullError:
            log.warning("LMDB map full (%d bytes stored): raise --map-size", self._bytes)
            return False
        self._touched.clear()
        self._apply(change)
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        change = _Change()
        with self._begin(write=True) as txn:
            for key in keys:
                self._remove_in(txn, key, change)
        self._apply(change)
        return -change.entries

    def sweep(self, now: float) -> int:
        change = _Change()
        limit = _TICK.pack(int(now * 1e6))
        with self._begin(write=True) as txn:
            self._flush_touched(txn)
            due = []
            for ikey, _ in txn.cursor(db=self._expiry):
                if ikey[: _TICK.size] > limit:
                    break
                due.append(ikey[_TICK.size :])
            for key in due:
                self._remove_in(txn, key, change)
            change.expired = len(due)
        self._touched.clear()
        self._apply(change)
        self._env.sync(True)  # force: with sync=False a plain sync() is skipped
        return change.expired

    def long_term_keys(self) -> list[bytes]:
        with self._begin() as txn:
            return [bytes(ikey[_TICK.size :]) for ikey, _ in txn.cursor(db=self._lru)]

    def stats(self) -> TierStats:
        return TierStats(
            entries=self._entries,
            bytes=self._bytes,
            capacity_bytes=self._capacity,
            evictions=self._evictions,
            expired=self._expired,
            corrupt=self._corrupt,
            disk_bytes=_allocated(self._path / "data.mdb"),
        )

    def close(self) -> None:
        if self._touched:
            with self._begin(write=True) as txn:
                self._flush_touched(txn)
            self._touched.clear()
        self._env.sync(True)  # force: with sync=False a plain sync() is skipped
        self._env.close()

    # --- inside one write transaction --------------------------------------------------------------------------

    def _put_in(self, txn: lmdb.Transaction[bytes], key: bytes, rec: bytes, expires_at: float, now: float) -> _Change:
        change = _Change()
        old = self._read_meta(txn, key)
        if old is not None and not old.expires_at and not expires_at:
            # A long-term key names its content (the chained hash of the prefix): same key, same bytes.
            self._touch_in(txn, key, now)
            return change
        if old is not None:
            self._remove_in(txn, key, change)
        self._make_room(txn, len(rec), change, now)
        txn.put(key, rec, db=self._blocks)
        txn.put(key, _META.pack(expires_at, now, len(rec)), db=self._meta)
        txn.put(_index(expires_at or now, key), b"", db=self._expiry if expires_at else self._lru)
        change.bytes += len(rec)
        change.entries += 1
        return change

    def _make_room(self, txn: lmdb.Transaction[bytes], need: int, change: _Change, now: float) -> None:
        excess = self._bytes + change.bytes + need - self._capacity
        if excess <= 0:
            return
        victims = []
        for ikey, _ in txn.cursor(db=self._lru):
            key = ikey[_TICK.size :]
            if self._leases.held(key, now):
                continue
            meta = self._read_meta(txn, key)
            excess -= meta.size if meta is not None else 0
            victims.append(key)
            if excess <= 0:
                break
        if excess > 0:
            raise _NoRoom
        for key in victims:
            self._remove_in(txn, key, change)
        change.evicted += len(victims)

    def _remove_in(self, txn: lmdb.Transaction[bytes], key: bytes, change: _Change) -> None:
        meta = self._read_meta(txn, key)
        txn.delete(key, db=self._blocks)
        if meta is None:
            return
        txn.delete(key, db=self._meta)
        if meta.expires_at:
            txn.delete(_index(meta.expires_at, key), db=self._expiry)
        else:
            txn.delete(_index(meta.last_access, key), db=self._lru)
            change.removed.append(key)
        change.bytes -= meta.size
        change.entries -= 1

    def _touch_in(self, txn: lmdb.Transaction[bytes], key: bytes, at: float) -> None:
        meta = self._read_meta(txn, key)
        if meta is None or meta.expires_at or at <= meta.last_access:
            return
        txn.delete(_index(meta.last_access, key), db=self._lru)
        txn.put(_index(at, key), b"", db=self._lru)
        txn.put(key, _META.pack(0.0, at, meta.size), db=self._meta)

    def _flush_touched(self, txn: lmdb.Transaction[bytes]) -> None:
        for key, at in self._touched.items():
            self._touch_in(txn, key, at)

    # --- helpers -----------------------------------------------------------------------------------------------

    def _begin(self, *, write: bool = False) -> lmdb.Transaction[bytes]:
        self._check_pid()
        return self._env.begin(write=write)

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("LMDB environment used across fork: open the store in the process that uses it")

    def _read_meta(self, txn: lmdb.Transaction[bytes], key: bytes) -> _Meta | None:
        raw = txn.get(key, db=self._meta)
        return None if raw is None else _Meta._make(_META.unpack(raw))

    def _apply(self, change: _Change) -> None:
        self._bytes += change.bytes
        self._entries += change.entries
        self._evictions += change.evicted
        self._expired += change.expired
        if change.removed and self.on_removed is not None:
            self.on_removed(change.removed)

    def _count(self) -> tuple[int, int]:
        entries = total = 0
        with self._begin() as txn:
            for _, raw in txn.cursor(db=self._meta):
                entries += 1
                total += _Meta._make(_META.unpack(raw)).size
        return entries, total


def _allocated(path: Path) -> int:
    """Disk blocks actually used by a (sparse) file."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def _expired(expires_at: float, now: float) -> bool:
    return bool(expires_at) and expires_at <= now
