"""A same-host fast path for KV bytes: a worker's shared-memory arena, with NATS carrying only descriptors.

The worker owns the arena (a file under /dev/shm, mapped by the worker and, on first use, by the kvcache
service). A put lends the store one slot that the engine exported a batch of blocks into (one copy, device or
cache -> arena) and sends their lengths; the store copies them into its RAM tier. A get lends the store one slot
to write the run into; the worker hands the engine views of the slot (`lend`), and the engine imports straight
from them (one copy, arena -> cache); the slot comes back when the last view is gone. NATS carries keys, an
offset and lengths, never the bytes.

    offset 0      token (16 random bytes): the store checks it, so a store on another host (or a stale map of
                  an earlier arena under the same name) is found out and the client falls back to NATS
    offset 4096   slot 0 | slot 1 | ... each `slot_bytes`

Nothing leaks when a process dies mid-transfer:
- A slot is lent to the store under a deadline (CLOCK_MONOTONIC, one clock for every process of a host): the
  store writes into it only before the deadline, and reads out of it before checking the deadline. A request
  that timed out (the store hung or died) leaves its slot retired until the deadline plus a grace has passed
  (`lose`); then it is lent again, because no late write can land in it any more.
- The worker holds a shared flock on its arena for its life; the kernel drops it when the process dies however
  it dies. The store's sweep (`ArenaMaps.sweep`) and the next worker of the same instance name (`remove_stale`)
  find an arena nobody holds and remove it: no pid check, so it works across pid namespaces too.
The file is named after the worker's instance and pid (two meshes on one host never share one); `close` unlinks it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
PREFIX = "deepinfer-kv-"
HEADER = 4096
TOKEN_BYTES = 16
GRACE_S = 1.0  # after a lent slot's deadline, before it is lent again: the store's last write is a memcpy away

ARENA_MIB = 128  # a worker's arena by default (--kv-arena-mib): a run up to about this imports with one copy


def arena_path(instance: str, pid: int | None = None) -> Path:
    return SHM_DIR / f"{PREFIX}{instance}-{os.getpid() if pid is None else pid}"


def owner_alive(path: Path) -> bool:
    """Whether a live process holds the arena at `path` (its owner's flock); False when it is gone too."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the probe's lock
    return False


def remove_stale(instance: str) -> int:
    """Remove the arenas of `instance` whose owner died; how many."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}{instance}-*"):
        if path.name.rsplit("-", 1)[1].isdigit() and not owner_alive(path):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class Arena:
    def __init__(self, path: Path, slots: int, slot_bytes: int) -> None:
        assert slots > 0 and slot_bytes > 0
        self.path = path
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.token = os.urandom(TOKEN_BYTES)
        path.unlink(missing_ok=True)  # a dead predecessor's file: a new inode, so no stale map aliases this one
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # before the token: whoever finds the token sees the owner alive
        os.ftruncate(self._fd, HEADER + slots * slot_bytes)
        self._map = mmap.mmap(self._fd, HEADER + slots * slot_bytes)
        self._map[:TOKEN_BYTES] = self.token
        self._lock = threading.Lock()  # views given back on the engine thread (`lend`), slots taken on the loop
        self._free = list(range(slots - 1, -1, -1))
        self._retired: list[tuple[float, int]] = []  # (lendable again at, slot) of requests that timed out
        self.lost = 0  # requests that timed out holding a slot
        self.reclaimed = 0  # of their slots, those lent again after their deadline
        self.before_close: list[Callable[[], None]] = []  # e.g. un-page-locking the map for the GPU

    @property
    def free_slots(self) -> int:
        with self._lock:
            self._reclaim(time.monotonic())
            return len(self._free)

    @property
    def lent_slots(self) -> int:
        """Slots lent now: to the store, or to views the engine has not imported yet (retired ones excluded)."""
        with self._lock:
            return self.slots - len(self._free) - len(self._retired)

    def take(self) -> int | None:
        """A free slot's offset, or None when every slot is lent or retired."""
        with self._lock:
            self._reclaim(time.monotonic())
            return HEADER + self._free.pop() * self.slot_bytes if self._free else None

    def give(self, offset: int) -> None:
        with self._lock:
            self._free.append((offset - HEADER) // self.slot_bytes)

    def take_run(self, nbytes: int) -> int | None:
        """The offset of enough free slots back to back for `nbytes` (a peer hand-over's region), or None."""
        n = -(-nbytes // self.slot_bytes)
        with self._lock:
            self._reclaim(time.monotonic())
            free = sorted(self._free)
            for i in range(len(free) - n + 1):
                if free[i + n - 1] - free[i] == n - 1:  # sorted and distinct: n consecutive slots
                    taken = set(free[i : i + n])
                    self._free = [s for s in self._free if s not in taken]
                    return HEADER + free[i] * self.slot_bytes
        return None

    def give_run(self, offset: int, nbytes: int) -> None:
        first = (offset - HEADER) // self.slot_bytes
        with self._lock:
            self._free += range(first, first + -(-nbytes // self.slot_bytes))

    def lock_range(self, offset: int, nbytes: int) -> bool:
        """Take the write lock on a region (see `range_lock`): False while a reader in another process holds it."""
        return range_lock(self._fd, fcntl.F_WRLCK, offset, nbytes)

    def unlock_range(self, offset: int, nbytes: int) -> None:
        range_lock(self._fd, fcntl.F_UNLCK, offset, nbytes)

    def lose(self, offset: int, deadline: float) -> None:
        """The request holding this slot timed out: the store may write into it until `deadline`, so it is lent
        again only after that (plus a grace)."""
        with self._lock:
            self.lost += 1
            self._retired.append((deadline + GRACE_S, (offset - HEADER) // self.slot_bytes))

    def _reclaim(self, now: float) -> None:
        back = [slot for at, slot in self._retired if at <= now]
        if back:
            self._retired = [(at, slot) for at, slot in self._retired if at > now]
            self._free += back
            self.reclaimed += len(back)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """`nbytes` of the slot at `offset`, writable, for an exporter to fill."""
        assert nbytes <= self.slot_bytes, "a batch larger than a slot"
        return memoryview(self._map)[offset : offset + nbytes]

    def region(self, offset: int, nbytes: int) -> memoryview:
        """`nbytes` from `offset` (a run of slots `take_run` gave), writable."""
        assert HEADER <= offset and offset + nbytes <= HEADER + self.slots * self.slot_bytes, "outside the arena"
        return memoryview(self._map)[offset : offset + nbytes]

    def write(self, offset: int, blobs: Sequence[bytes]) -> list[int]:
        """Copy `blobs` one after the other into the slot at `offset`; their lengths."""
        at = offset
        for blob in blobs:
            self._map[at : at + len(blob)] = blob
            at += len(blob)
        assert at - offset <= self.slot_bytes, "a batch larger than a slot"
        return [len(b) for b in blobs]

    def read(self, offset: int, lengths: Sequence[int]) -> list[bytes]:
        """Copies of the blobs in the slot at `offset` (the slot may be given back at once)."""
        out, at = [], offset
        for n in lengths:
            out.append(self._map[at : at + n])
            at += n
        return out

    def lend(self, offset: int, lengths: Sequence[int]) -> list[memoryview]:
        """Read-only views of the blobs in the slot at `offset`, no copy: the slot stays taken while any of them
        lives and is given back when the last one is gone (on whichever thread drops it)."""
        holder = np.frombuffer(self._map, np.uint8, count=self.slot_bytes, offset=offset)
        holder.flags.writeable = False
        weakref.finalize(holder, self.give, offset)
        whole = memoryview(holder)  # its slices keep `holder` alive; they are the only references left
        views, at = [], 0
        for n in lengths:
            views.append(whole[at : at + n])
            at += n
        return views

    @property
    def mapping(self) -> mmap.mmap:
        """The whole map (header and slots): for registering it with a device's DMA (page-locking)."""
        return self._map

    def close(self) -> None:
        if self._fd < 0:
            return
        self.path.unlink(missing_ok=True)
        for undo in self.before_close:
            undo()
        self.before_close.clear()
        try:
            self._map.close()
        except BufferError:  # views still lent (a request being torn down): the map goes with the last of them
            pass
        os.close(self._fd)  # and with it the owner's lock
        self._fd = -1


# --- byte-range locks: who may write a region of an arena, across processes ------------------------------------
# Open-file-description locks (fcntl F_OFD_SETLK): one per open of the file, dropped by the kernel when that
# process dies however it dies, and never by closing another descriptor (as POSIX record locks are). A peer
# hand-over's region is written by its owner only under the write lock and read by a decode worker only under a
# read lock, so a region a reader holds is never lent again, and a dead reader's lock goes with it.

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux (64-bit): l_type, l_whence, l_start, l_len, l_pid


def range_lock(fd: int, kind: int, offset: int, nbytes: int) -> bool:
    """Set `kind` (F_RDLCK, F_WRLCK, F_UNLCK) on bytes [offset, offset + nbytes) of `fd`, without waiting;
    False when another open of the file holds a conflicting lock."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, offset, nbytes, 0))
    except (BlockingIOError, PermissionError):
        return False
    return True


def map_read_only(path: str, token: bytes, prefix: str) -> tuple[Path, int, mmap.mmap] | None:
    """Another process's shared-memory file (an arena, the store's heap) mapped read-only, with the descriptor its
    read locks go on: only a file of ours (`prefix` under /dev/shm) whose owner is alive and whose header shows
    `token`; None otherwise (another host's, gone, or replaced)."""
    p = Path(path)
    if p.parent != SHM_DIR or not p.name.startswith(prefix) or not owner_alive(p):
        return None
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size > HEADER else None
    except OSError:
        mapped = None
    if mapped is None or mapped[:TOKEN_BYTES] != token:
        os.close(fd)
        return None
    return p, fd, mapped


class PeerMap:
    """A reader's map of another worker's arena (a decode worker mapping a prefill worker's), with the descriptor
    its read locks are on; the descriptor closes when the map is dropped and no view of it is left."""

    def __init__(self, path: Path, fd: int, mapped: mmap.mmap) -> None:
        self.path, self.fd, self.map = path, fd, mapped
        self.inode = os.fstat(fd).st_ino
        weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: str, token: bytes) -> PeerMap | None:
        """The arena at `path` mapped read-only, if it is an arena, its token matches and its owner is alive."""
        found = map_read_only(path, token, PREFIX)
        return None if found is None else cls(*found)

    def current(self, token: bytes) -> bool:
        """Whether this map is still of the live arena at its path with `token` (not a replaced or dead one)."""
        try:
            same = os.stat(self.path).st_ino == self.inode
        except OSError:
            return False
        return same and self.map[:TOKEN_BYTES] == token and owner_alive(self.path)

    def hold(self, offset: int, nbytes: int) -> bool:
        """A read lock on the region: its owner cannot write it again until `release`."""
        return 0 < offset and offset + nbytes <= len(self.map) and range_lock(self.fd, fcntl.F_RDLCK, offset, nbytes)

    def release(self, offset: int, nbytes: int) -> None:
        range_lock(self.fd, fcntl.F_UNLCK, offset, nbytes)


class ArenaMaps:
    """The store's side: clients' arenas mapped by path on first use, checked against the request's token."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._inodes: dict[str, int] = {}

    def get(self, path: str, token: bytes) -> mmap.mmap | None:
        """The mapped arena at `path` if its token matches (remapped once if the file was replaced), else None."""
        for attempt in range(2):
            mapped = self._maps.get(path) if attempt == 0 else self._open(path)
            if mapped is not None and mapped[:TOKEN_BYTES] == token:
                return mapped
        return None

    def _open(self, path: str) -> mmap.mmap | None:
        p = Path(path)
        if p.parent != SHM_DIR or not p.name.startswith(PREFIX):
            return None  # only arenas, never an arbitrary file a request names
        self._unmap(path)
        try:
            fd = os.open(p, os.O_RDWR)
        except OSError:
            return None  # another host's arena, or gone
        try:
            size = os.fstat(fd).st_size
            if size <= HEADER:
                return None
            self._maps[path] = mmap.mmap(fd, size)
            self._inodes[path] = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        return self._maps[path]

    def sweep(self) -> int:
        """Unmap arenas whose file is gone or replaced (their worker stopped), and remove those whose owner died
        without removing its file (killed mid-transfer): a map would keep the memory of an unlinked file alive,
        and a dead worker's file would keep it in /dev/shm. Returns how many."""
        gone = []
        for path in self._maps:
            try:
                if os.stat(path).st_ino == self._inodes[path]:
                    if owner_alive(Path(path)):
                        continue
                    Path(path).unlink(missing_ok=True)
            except OSError:
                pass
            gone.append(path)
        for path in gone:
            self._unmap(path)
        return len(gone)

    def _unmap(self, path: str) -> None:
        old = self._maps.pop(path, None)
        if old is not None:
            old.close()
            del self._inodes[path]

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
        self._inodes.clear()
