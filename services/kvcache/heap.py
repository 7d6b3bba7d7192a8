"""The RAM tier's payloads in a shared-memory heap the store owns (file format and the reader: shared/kv_heap.py).

`Heap` is the file and a first-fit allocator over it: free extents kept sorted by offset and merged with their
neighbours on every free, so blobs of one size (a model's KV blocks) never fragment it: any free extent fits the
next one. A blob that is held is never freed under its holder: a free while held is deferred to the last
release. Two kinds of holder:
- views the store itself lends (`pinned`: a reply being encoded, a home write reading the RAM copy),
  released when the view is garbage;
- read leases of same-host workers (`HeapPayloads.lend`), released by the worker's message, or at the deadline
  plus a grace once no reader holds a read lock on the bytes (`Heap.probe`).

`HeapPayloads` is what the RAM tier (tiers/ram.py) stores its payloads in when the heap is on.
"""

from __future__ import annotations

import bisect
import collections
import fcntl
import itertools
import logging
import mmap
import os
import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.kv_arena import GRACE_S, HEADER, SHM_DIR, TOKEN_BYTES, range_lock
from shared.kv_heap import ALIGN, heap_path, remove_stale

log = logging.getLogger(__name__)

Buffer = bytes | memoryview


def _round(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class Heap:
    def __init__(self, path: Path, capacity_bytes: int) -> None:
        self.path = path
        self.capacity = _round(capacity_bytes)
        self.token = os.urandom(TOKEN_BYTES)
        path.unlink(missing_ok=True)  # a dead predecessor of this name: a new inode, so no old map aliases it
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # held for the store's life: readers see their owner alive
        os.ftruncate(self._fd, HEADER + self.capacity)  # sparse: pages are resident once written
        self._map = mmap.mmap(self._fd, HEADER + self.capacity)
        self._map[:TOKEN_BYTES] = self.token
        self._lock = threading.Lock()
        # Pinned views dropped (on any thread, maybe by the garbage collector in the middle of an allocation
        # here) only queue their release; the next call that takes the lock applies it. deque.append is atomic.
        self._dropped: collections.deque[int] = collections.deque()
        self._starts = [HEADER]  # free extents, sorted by offset: parallel lists of start and size
        self._sizes = [self.capacity]
        self._live: dict[int, int] = {}  # offset -> allocated size
        self._holds: dict[int, int] = {}  # offset -> holders
        self._doomed: set[int] = set()  # freed while held: freed at the last release

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            while self._dropped:
                self._unhold(self._dropped.popleft())
            yield

    # --- allocation --------------------------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> int | None:
        """The offset of `nbytes` of free heap, or None when no free extent is that large."""
        need = _round(nbytes)
        with self._locked():
            for i, size in enumerate(self._sizes):
                if size >= need:
                    at = self._starts[i]
                    if size == need:
                        del self._starts[i], self._sizes[i]
                    else:
                        self._starts[i] += need
                        self._sizes[i] -= need
                    self._live[at] = need
                    return at
        return None

    def free(self, offset: int) -> None:
        """Give a blob back; while it is held, at its last release."""
        with self._locked():
            if offset in self._holds:
                self._doomed.add(offset)
            else:
                self._release(offset)

    def hold(self, offset: int) -> None:
        with self._locked():
            assert offset in self._live and offset not in self._doomed, "holding a freed blob"
            self._holds[offset] = self._holds.get(offset, 0) + 1

    def unhold(self, offset: int) -> None:
        with self._locked():
            self._unhold(offset)

    def _unhold(self, offset: int) -> None:
        left = self._holds[offset] - 1
        if left:
            self._holds[offset] = left
            return
        del self._holds[offset]
        if offset in self._doomed:
            self._doomed.discard(offset)
            self._release(offset)

    def is_held(self, offset: int) -> bool:
        with self._locked():
            return offset in self._holds

    def _release(self, offset: int) -> None:
        size = self._live.pop(offset)
        i = bisect.bisect(self._starts, offset)
        # merge with the free extent after it, then with the one before it
        if i < len(self._starts) and offset + size == self._starts[i]:
            size += self._sizes[i]
            del self._starts[i], self._sizes[i]
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:
            self._sizes[i - 1] += size
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)

    # --- bytes -------------------------------------------------------------------------------------------------

    def write(self, offset: int, data: Buffer) -> None:
        assert len(data) <= self._live[offset], "a write past its blob"
        self._map[offset : offset + len(data)] = data

    def pinned(self, offset: int, nbytes: int) -> memoryview:
        """A read-only view of a blob, no copy; the blob is held while the view (or a slice of it) lives."""
        self.hold(offset)
        holder = np.frombuffer(self._map, np.uint8, count=nbytes, offset=offset)
        holder.flags.writeable = False
        weakref.finalize(holder, self._dropped.append, offset)
        return memoryview(holder)

    def probe(self, offset: int) -> bool:
        """Whether no reader in another process holds a read lock on the blob at `offset` (shared/kv_heap.py)."""
        size = self._live[offset]
        if not range_lock(self._fd, fcntl.F_WRLCK, offset, size):
            return False
        range_lock(self._fd, fcntl.F_UNLCK, offset, size)
        return True

    # --- accounting --------------------------------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        with self._locked():
            return sum(self._sizes)

    @property
    def largest_free(self) -> int:
        with self._locked():
            return max(self._sizes, default=0)

    @property
    def held(self) -> int:
        """Blobs held now (by pinned views or read leases)."""
        with self._locked():
            return len(self._holds)

    @property
    def deferred(self) -> int:
        """Blobs freed while held, waiting for their last release."""
        with self._locked():
            return len(self._doomed)

    def extents(self) -> list[tuple[int, int]]:
        """The free extents (start, size), in order: for tests of the allocator's invariants."""
        with self._locked():
            return list(zip(self._starts, self._sizes))

    def close(self) -> None:
        if self._fd < 0:
            return
        self.path.unlink(missing_ok=True)
        try:
            self._map.close()
        except BufferError:  # views still lent (a reply in flight at shutdown): the map goes with the last one
            pass
        os.close(self._fd)  # and with it the owner's flock
        self._fd = -1


@dataclass(frozen=True)
class HeapRef:
    """Where a RAM payload lies in the heap."""

    offset: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass
class _Lease:
    deadline: float  # CLOCK_MONOTONIC
    offsets: list[int]


class HeapPayloads:
    """The RAM tier's payloads in a `Heap`, and the read leases same-host workers hold on them."""

    def __init__(self, heap: Heap) -> None:
        self.heap = heap
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self.lent = 0  # leases granted
        self.released = 0  # of them, released by their worker
        self.expired = 0  # of them, ended at their deadline (the worker died, or never said)

    def keep(self, data: Buffer) -> HeapRef | None:
        """A copy of `data` in the heap (one memcpy), or None when no free extent fits it."""
        at = self.heap.alloc(len(data))
        if at is None:
            return None
        self.heap.write(at, data)
        return HeapRef(at, len(data))

    def read(self, ref: HeapRef) -> memoryview:
        return self.heap.pinned(ref.offset, ref.length)

    def drop(self, ref: HeapRef) -> None:
        self.heap.free(ref.offset)

    def held(self, ref: HeapRef) -> bool:
        return self.heap.is_held(ref.offset)

    def lend(self, refs: list[HeapRef], deadline: float) -> int:
        """A read lease on `refs` until `deadline` (CLOCK_MONOTONIC): its id (0 for none)."""
        if not refs:
            return 0
        for ref in refs:
            self.heap.hold(ref.offset)
        lease = next(self._ids)
        self._leases[lease] = _Lease(deadline, [ref.offset for ref in refs])
        self.lent += 1
        return lease

    def release(self, lease: int) -> bool:
        """End a lease early (its worker imported the blocks and dropped its locks); False if unknown."""
        held = self._leases.pop(lease, None)
        if held is None:
            return False
        self._end(held)
        self.released += 1
        return True

    def expire(self, now: float | None = None) -> int:
        """End the leases past their deadline plus the grace whose bytes no reader still has locked; how many."""
        now = time.monotonic() if now is None else now
        due = [lid for lid, lease in self._leases.items()
               if lease.deadline + GRACE_S <= now and all(self.heap.probe(at) for at in lease.offsets)]
        for lid in due:
            self._end(self._leases.pop(lid))
        self.expired += len(due)
        return len(due)

    def _end(self, lease: _Lease) -> None:
        for at in lease.offsets:
            self.heap.unhold(at)

    @property
    def leases(self) -> int:
        return len(self._leases)

    def close(self) -> None:
        self._leases.clear()
        self.heap.close()


def open_heap(instance: str, capacity_bytes: int) -> Heap | None:
    """The store's heap under /dev/shm, or None where there is no room for it there (the RAM tier keeps its
    payloads as `bytes` then). A tmpfs smaller than the heap would SIGBUS the store on a write past its size,
    so the heap is made only where /dev/shm has its whole capacity free now."""
    if not SHM_DIR.is_dir():
        return None
    remove_stale(instance)  # a crashed predecessor's heap
    try:
        free = os.statvfs(SHM_DIR)
        if free.f_bavail * free.f_frsize < HEADER + capacity_bytes:
            log.warning("kvcache: /dev/shm has less free than the RAM tier (%d bytes): RAM payloads stay private",
                        capacity_bytes)
            return None
        return Heap(heap_path(instance), capacity_bytes)
    except OSError as exc:
        log.warning("kvcache: no shared heap (%s): RAM payloads stay private", exc)
        return None
