"""The SSD tier: long-term prefix blocks in append-only segment files, indexed in memory.

    <state_dir>/kvcache/ssd/
        LOCK            flock'ed while a process has the tier open: one owner per directory
        00000001.seg    sealed: full, fdatasync'ed when sealed
        ...
        0000000N.seg    active: records are appended here; fdatasync'ed at every sweep

    index (memory): key -> (segment, offset, payload_len, expires_at, body_crc)

On open the index is rebuilt by reading every record's header (`segment.scan`: one small pread per record, not
the payloads); a torn tail is cut off. Payload checksums are verified on every read, so a record that rotted on
disk is found when it matters and dropped then.

Why segments and not one file per block (both measured by bench/kv_tiers.py, results in
bench/results/2026-11-30-kv-tiers-cpu.md): file-per-block pays a create + rename + directory entry per block and
reads each cold file with a fresh readahead window; at 64 KiB it wrote 8 % and read 17 % of the raw disk's rate,
and at most 47 % / 34 % for big blocks, where segments reached 65-76 % (writes of 737 KiB and 3.5 MiB blocks) and
69-82 % (cold reads). Segments also keep a restart's scan to a few hundred files and eviction to one unlink.

Why pread and not mmap for reads: mmap'ed reads of big blocks ran up to ~25 % faster on this VM, but a media error
or a segment cut short under a mapping is a SIGBUS that kills the service, where pread returns an error and the
record is dropped as corrupt. A cache must survive its disk.

Eviction is least recently used by segment (as in CacheLib's block cache): a segment's last access is the
newest read or write of any block in it, and when a put needs room the whole least recently used segment goes,
which frees its disk space at once with one unlink and needs no compaction. Blocks written together (one
prompt's blocks) are mostly read together, so a segment is a fair unit of recency. A segment holding a leased
block is skipped. Last-access times persist as the segment files' mtimes (set at each sweep), so the order
survives a restart.

Only long-term blocks live here (a put with an expiry is refused), so a block reads back as long-term; the TTL
is this tier's retention. A record's expiry is fixed when it is written (now + the tier's TTL, days). All records
of a segment were written within a short window, so the sweep drops a segment when its newest record has expired;
an older record that expired alone reads as a miss until then.

Deletes and corrupt records flip the record's dead flag on disk (one byte), so a restart does not bring them
back; a segment whose last live record goes is deleted at once.

Crash: a killed process leaves whole records plus at most one torn record (cut off on open, or failing its
checksum); data written before the kill is in the page cache and survives. A machine crash loses at most the
active segment's records since the last sweep. The tier is synchronous and not thread-safe (one I/O thread).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from services.kvcache.leases import Leases
from services.kvcache.store import Entry, TierStats
from services.kvcache.tiers import segment

log = logging.getLogger(__name__)

MiB = 1 << 20
SUFFIX = ".seg"


class _Loc(NamedTuple):
    segment: int
    offset: int
    payload_len: int
    expires_at: float
    crc: int


@dataclass
class _Segment:
    id: int
    path: Path
    size: int = 0  # bytes in the file: where the next record goes
    keys: set[bytes] = field(default_factory=set)  # live records
    live_bytes: int = 0
    last_access: float = 0.0
    max_expires: float = 0.0
    touched: bool = False  # last_access is newer than the file's mtime
    dirty: bool = False  # appended to since the last fdatasync


class SsdTier:
    name = "ssd"

    def __init__(
        self,
        path: Path,
        *,
        capacity_bytes: int,
        ttl_s: float,
        segment_bytes: int = 64 * MiB,
        leases: Leases | None = None,
        max_open_files: int = 64,
    ) -> None:
        assert capacity_bytes > 0 and ttl_s > 0 and segment_bytes > 0
        self._dir = path
        self._capacity = capacity_bytes
        self._ttl_s = ttl_s
        self._segment_bytes = segment_bytes
        self._leases = leases if leases is not None else Leases()
        self._max_open = max_open_files
        self._fds: OrderedDict[int, int] = OrderedDict()  # segment id -> fd, least recently used first
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-crc")  # see segment.append
        self._index: dict[bytes, _Loc] = {}
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._disk = self._live = 0
        self._evictions = self._expired = self._corrupt = 0
        self.on_removed: Callable[[list[bytes]], None] | None = None  # keys that left (store.Listener)
        path.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(path / "LOCK")
        for seg_path in sorted(path.glob("*" + SUFFIX)):
            if seg_path.stem.isdigit():
                self._load(seg_path)
        for seg in list(self._segments.values()):
            if not seg.keys:  # every record dead, expired-and-replaced or torn
                self._drop_segment(seg)

    # --- Tier --------------------------------------------------------------------------------------------------

    def holds(self, keys: Sequence[bytes], now: float) -> list[bool]:
        out = []
        for key in keys:
            loc = self._index.get(key)
            out.append(loc is not None and loc.expires_at > now)
        return out

    def get(self, keys: Sequence[bytes], now: float) -> list[Entry | None]:
        out: list[Entry | None] = []
        for key in keys:
            loc = self._index.get(key)
            if loc is not None and loc.expires_at <= now:
                self._remove(key, mark=False)
                self._expired += 1
                loc = None
            out.append(None if loc is None else self._read(key, loc, now))
        return out

    def put(self, key: bytes, data: bytes, expires_at: float, now: float) -> bool:
        size = segment.record_size(len(key), len(data))
        if expires_at or size > self._capacity or len(key) > segment.MAX_KEY:
            return False
        old = self._index.get(key)
        if old is not None and old.expires_at > now:
            self._touch(self._segments[old.segment], now)  # a long-term key names its content: already stored
            return True
        if old is not None:
            self._remove(key, mark=True)
        if not self._make_room(size, now):
            return False
        seg = self._writable(size)
        expires = now + self._ttl_s
        try:
            crc = segment.append(self._fd(seg.id), seg.size, key, data, expires, self._helper)
        except OSError as exc:
            log.warning("ssd tier: write failed, block not stored: %s", exc)
            return False
        self._index[key] = _Loc(seg.id, seg.size, len(data), expires, crc)
        seg.size += size
        seg.keys.add(key)
        seg.live_bytes += size
        seg.max_expires = max(seg.max_expires, expires)
        seg.dirty = True
        self._touch(seg, now)
        self._disk += size
        self._live += size
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        present = [key for key in keys if key in self._index]
        for key in present:
            self._remove(key, mark=True)
        return len(present)

    def sweep(self, now: float) -> int:
        expired = 0
        for seg in list(self._segments.values()):
            if seg.keys and seg.max_expires <= now:
                expired += len(seg.keys)
                self._drop_segment(seg)
        self._expired += expired
        self._persist()
        return expired

    def long_term_keys(self) -> list[bytes]:
        return list(self._index)

    def stats(self) -> TierStats:
        return TierStats(
            entries=len(self._index),
            bytes=self._live,
            capacity_bytes=self._capacity,
            evictions=self._evictions,
            expired=self._expired,
            corrupt=self._corrupt,
            disk_bytes=self._disk,
        )

    def close(self) -> None:
        self._helper.shutdown()
        self._persist()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        os.close(self._lock)

    # --- records -----------------------------------------------------------------------------------------------

    def _read(self, key: bytes, loc: _Loc, now: float) -> Entry | None:
        # One pread and a check, nothing clever: measured on cold reads, a posix_fadvise(WILLNEED) over the run
        # halved throughput and reading the next block on a helper thread lost ~15 % (the kernel's own readahead
        # on ascending preads does better than either).
        try:
            payload = segment.fetch(self._fd(loc.segment), loc.offset, key, loc.payload_len)
            segment.verify(key, payload, loc.crc)
        except (segment.CorruptRecord, OSError) as exc:
            log.warning("ssd tier: dropping corrupt block %s: %s", key.hex(), exc)
            self._corrupt += 1
            self._remove(key, mark=True)
            return None
        self._touch(self._segments[loc.segment], now)
        return payload, 0.0

    def _remove(self, key: bytes, *, mark: bool) -> None:
        loc = self._index.pop(key)
        seg = self._segments[loc.segment]
        size = segment.record_size(len(key), loc.payload_len)
        seg.keys.discard(key)
        seg.live_bytes -= size
        self._live -= size
        if self.on_removed is not None:
            self.on_removed([key])
        if not seg.keys and seg is not self._active:
            self._drop_segment(seg)
        elif mark:
            try:
                segment.mark_dead(self._fd(seg.id), loc.offset)
            except OSError as exc:  # the record stays dead in memory; a restart may show it again
                log.warning("ssd tier: could not mark a record dead: %s", exc)

    # --- segments ----------------------------------------------------------------------------------------------

    def _load(self, path: Path) -> None:
        seg = _Segment(int(path.stem), path, last_access=path.stat().st_mtime)
        fd = self._fd_for(seg)
        size = os.fstat(fd).st_size
        records, end = segment.scan(fd, size)
        if end < size:
            log.warning("ssd tier: %s has %d bytes of torn or corrupt tail: cut off", path.name, size - end)
            os.ftruncate(fd, end)
            self._corrupt += 1
            os.utime(path, (seg.last_access, seg.last_access))
        seg.size = end
        self._segments[seg.id] = seg
        self._disk += end
        for rec in records:
            if rec.dead:
                continue
            old = self._index.get(rec.key)
            if old is not None:  # a later copy of the same key wins
                prev = self._segments[old.segment]
                prev.keys.discard(rec.key)
                prev.live_bytes -= segment.record_size(len(rec.key), old.payload_len)
                self._live -= segment.record_size(len(rec.key), old.payload_len)
            self._index[rec.key] = _Loc(seg.id, rec.offset, rec.payload_len, rec.expires_at, rec.body_crc)
            seg.keys.add(rec.key)
            seg.live_bytes += rec.size
            seg.max_expires = max(seg.max_expires, rec.expires_at)
            self._live += rec.size

    def _writable(self, size: int) -> _Segment:
        seg = self._active
        if seg is not None and seg.size and seg.size + size > self._segment_bytes:
            self._seal(seg)
            seg = None
        if seg is None:
            next_id = max(self._segments, default=0) + 1
            seg = _Segment(next_id, self._dir / f"{next_id:08d}{SUFFIX}")
            os.close(os.open(seg.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
            self._segments[seg.id] = seg
            self._active = seg
        return seg

    def _seal(self, seg: _Segment) -> None:
        self._active = None
        if not seg.keys:
            self._drop_segment(seg)
            return
        os.fdatasync(self._fd(seg.id))
        seg.dirty = False

    def _make_room(self, need: int, now: float) -> bool:
        while self._disk + need > self._capacity:
            leased = {self._index[k].segment for k in self._leases.active(now) if k in self._index}
            candidates = [s for s in self._segments.values() if s.id not in leased]
            if not candidates:
                return False
            victim = min(candidates, key=lambda s: (s.last_access, s.id))
            self._evictions += len(victim.keys)
            self._drop_segment(victim)
        return True

    def _drop_segment(self, seg: _Segment) -> None:
        for key in seg.keys:
            loc = self._index.pop(key)
            self._live -= segment.record_size(len(key), loc.payload_len)
        if seg.keys and self.on_removed is not None:
            self.on_removed(list(seg.keys))
        seg.keys.clear()
        fd = self._fds.pop(seg.id, None)
        if fd is not None:
            os.close(fd)
        seg.path.unlink(missing_ok=True)
        self._disk -= seg.size
        del self._segments[seg.id]
        if seg is self._active:
            self._active = None

    def _touch(self, seg: _Segment, now: float) -> None:
        if now > seg.last_access:
            seg.last_access = now
            seg.touched = True

    def _persist(self) -> None:
        """Sync the active segment and write last-access times as mtimes."""
        if self._active is not None and self._active.dirty:
            os.fdatasync(self._fd(self._active.id))
            self._active.dirty = False
        for seg in self._segments.values():
            if seg.touched:
                try:
                    os.utime(seg.path, (seg.last_access, seg.last_access))
                except OSError as exc:  # only the recency order across a restart suffers
                    log.warning("ssd tier: could not record access time of %s: %s", seg.path.name, exc)
                seg.touched = False

    def _fd(self, seg_id: int) -> int:
        fd = self._fds.get(seg_id)
        if fd is not None:
            self._fds.move_to_end(seg_id)
            return fd
        return self._fd_for(self._segments[seg_id])

    def _fd_for(self, seg: _Segment) -> int:
        fd = os.open(seg.path, os.O_RDWR)
        self._fds[seg.id] = fd
        while len(self._fds) > self._max_open:  # the least recently used go (never this one: it is the newest)
            os.close(self._fds.popitem(last=False)[1])
        return fd


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"{path.parent} is in use by another kvcache process (one per state dir)") from None
    return fd
