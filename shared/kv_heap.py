"""The kvcache service's RAM tier in shared memory, read by same-host workers by descriptor (issue 11).

The store owns the heap: one file under /dev/shm (services/kvcache/heap.py allocates blobs in it). A same-host
`kv.get.heap` answers with where each block lies in it, (offset, length), under a read lease; the worker maps
the heap read-only once (`HeapMap`) and hands its engine views of it, so a store hit is imported with one copy,
heap -> cache, and the store copies nothing.

    offset 0      token (16 random bytes): a fresh one per heap file; the reply names it and the worker's map
                  must show it, so a map of an earlier store's heap is never read for a later store's reply
    offset 4096   blob | blob | free | blob ...   each blob at a multiple of ALIGN

Why no byte is ever wrong:
- The store frees or reuses a leased blob's bytes only after the lease: released by the worker (`kv.heap.
  release.<instance>`), or past its deadline (CLOCK_MONOTONIC) plus a grace *and* while no reader holds a read
  lock on them (`probe`).
- The worker takes a read lock (open-file-description `F_RDLCK`, shared/kv_arena.py `range_lock`) on each blob
  before it lends a view of it, and checks the lease's deadline after taking it: past it, the store may already
  have reused the bytes, so those blocks are a miss for this path (the client reads them the arena's way). The
  locks stay until the last view is dropped (after the engine's import), so a lease ending while the engine is
  slow to import cannot free the bytes under it.
- A worker that dies drops its locks with its last descriptor; its leases end at their deadline.
The file is named after the store's instance, pid and start; a restarted store makes a new file with a new
token, and removes what a dead store of its instance left (its owner's flock is gone, as for arenas).
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from shared.kv_arena import HEADER, SHM_DIR, map_read_only, owner_alive, range_lock

PREFIX = "deepinfer-kvheap-"
ALIGN = 256  # every blob starts at a multiple of this (cache lines; DMA-friendly runs)


_opened = itertools.count()


def heap_path(instance: str) -> Path:
    """A new name each time: the instance, the pid, and how many heaps this process made before (a store
    restarted in the same process gets a new file too)."""
    return SHM_DIR / f"{PREFIX}{instance}-{os.getpid()}-{next(_opened)}"


def remove_stale(instance: str) -> int:
    """Remove the heaps of `instance` whose store died; how many."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}{instance}-*"):
        pid_seq = path.name[len(PREFIX) + len(instance) + 1 :].split("-")
        if len(pid_seq) == 2 and all(p.isdigit() for p in pid_seq) and not owner_alive(path):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def lock_bytes(length: int) -> int:
    """The bytes a read lock covers for a blob of `length` (a zero length would lock to the end of the file)."""
    return max(length, 1)


class HeapMap:
    """A worker's read-only map of one store's heap, with the descriptor its read locks are on. The map and the
    descriptor live while any view of it does (`lend` keeps this object alive through its finalizer)."""

    def __init__(self, path: Path, token: bytes, fd: int, mapped: mmap.mmap) -> None:
        self.path, self.token, self.fd, self.map = path, token, fd, mapped
        self._locked: dict[int, int] = {}  # offset -> views lent over it (one lock per blob: OFD locks don't nest)
        self._lock = threading.Lock()  # views are dropped on the engine thread
        # Views dropped queue their unlock here and apply it when the lock is free: a drop may come from the
        # garbage collector on a thread already inside `_take` (see `_drain`).
        self._dropped: collections.deque[tuple[list[tuple[int, int]], Callable[[], None]]] = collections.deque()
        self.before_close: list[Callable[[], None]] = []  # e.g. un-page-locking the map for the GPU
        weakref.finalize(self, _close, fd, mapped, self.before_close)

    @classmethod
    def open(cls, path: str, token: bytes) -> HeapMap | None:
        """The heap at `path` mapped read-only, if it is a heap of a live store and shows `token`."""
        found = map_read_only(path, token, PREFIX)
        if found is None:
            return None
        p, fd, mapped = found
        return cls(p, token, fd, mapped)

    def names(self, path: str, token: bytes) -> bool:
        return str(self.path) == path and self.token == token

    @property
    def locks_held(self) -> int:
        self._drain()
        with self._lock:
            return len(self._locked)

    def lend(self, offsets: Sequence[int], lengths: Sequence[int], deadline: float, done: Callable[[], None]
             ) -> list[memoryview] | None:
        """Read-only views of the blobs at `offsets`, each read-locked until the last view is dropped (then
        `done` runs, on whichever thread dropped it); None when one cannot be locked or the lease's `deadline`
        (CLOCK_MONOTONIC) had passed once they were: the store may have reused the bytes."""
        extents = list(zip(offsets, lengths))
        inside = all(HEADER <= at and at + n <= len(self.map) for at, n in extents)
        if len(offsets) != len(lengths) or not inside or not self._take(extents):
            return None
        if time.monotonic() >= deadline:
            self._give(extents)
            return None
        holder = np.frombuffer(self.map, np.uint8)
        holder.flags.writeable = False
        weakref.finalize(holder, self._ended, extents, done)  # holds `self` (the descriptor, the locks) till then
        whole = memoryview(holder)
        return [whole[at : at + n] for at, n in extents]

    def _ended(self, extents: list[tuple[int, int]], done: Callable[[], None]) -> None:
        self._dropped.append((extents, done))
        self._drain()

    def _drain(self) -> None:
        """Apply the queued unlocks whenever the lock is free. Every append is followed by a try here and every
        release of the lock by another, so none is left behind: if the appender cannot take the lock, its holder
        has not yet made its own try after releasing it."""
        while self._dropped and self._lock.acquire(blocking=False):
            try:
                ended = []
                while self._dropped:
                    extents, done = self._dropped.popleft()
                    self._unlock(extents)
                    ended.append(done)
            finally:
                self._lock.release()
            for done in ended:
                done()

    def _take(self, extents: list[tuple[int, int]]) -> bool:
        """Read-lock every extent (one lock per blob, counted), or none of them: False when one is refused."""
        with self._lock:
            ok, taken = True, []
            for at, n in extents:
                if not self._locked.get(at) and not range_lock(self.fd, fcntl.F_RDLCK, at, lock_bytes(n)):
                    self._unlock(taken)
                    ok = False
                    break
                self._locked[at] = self._locked.get(at, 0) + 1
                taken.append((at, n))
        self._drain()
        return ok

    def address(self) -> tuple[int, int]:
        """(the map's address, its size): for registering it with a device's DMA (page-locking)."""
        whole = np.frombuffer(self.map, np.uint8)
        return whole.ctypes.data, whole.size

    def _give(self, extents: list[tuple[int, int]]) -> None:
        with self._lock:
            self._unlock(extents)
        self._drain()

    def _unlock(self, extents: list[tuple[int, int]]) -> None:
        for at, n in extents:
            left = self._locked[at] - 1
            if left:
                self._locked[at] = left
                continue
            del self._locked[at]
            range_lock(self.fd, fcntl.F_UNLCK, at, lock_bytes(n))


def _close(fd: int, mapped: mmap.mmap, before: list[Callable[[], None]]) -> None:
    """A map nobody uses any more (no view, no lock left): undo its registrations, then unmap it."""
    for undo in before:
        undo()
    try:
        mapped.close()
    except BufferError:  # an export still being torn down: the map goes with it
        pass
    os.close(fd)
