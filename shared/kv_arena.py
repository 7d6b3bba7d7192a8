"""A same-host fast path for KV bytes: a worker's shared-memory arena, with NATS carrying only descriptors.

The worker owns the arena (a file under /dev/shm, mapped by the worker and, on first use, by the kvcache
service). A put writes a batch's blobs into one free slot and sends their lengths; the store copies them out. A
get lends the store one slot to write the run into and reads the blobs back out of it. NATS carries keys, an
offset and lengths, never the bytes.

    offset 0      token (16 random bytes): the store checks it, so a store on another host (or a stale map of
                  an earlier arena under the same name) is found out and the client falls back to NATS
    offset 4096   slot 0 | slot 1 | ... each `slot_bytes`

A slot is lent to one request at a time. When a request times out the store may still write into its slot later,
so that slot is retired (`lose`), never lent again: a late write can only land where nobody reads. The file is
named after the worker's instance and pid (two meshes on one host never share one); `close` unlinks it, and a
worker that died leaves its file behind until the next worker of its instance name starts and removes it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "deepinfer-kv-"
HEADER = 4096
TOKEN_BYTES = 16


def arena_path(instance: str, pid: int | None = None) -> Path:
    return SHM_DIR / f"{PREFIX}{instance}-{os.getpid() if pid is None else pid}"


def remove_stale(instance: str) -> int:
    """Remove the arenas of dead processes of `instance`; how many."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}{instance}-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class Arena:
    def __init__(self, path: Path, slots: int, slot_bytes: int) -> None:
        assert slots > 0 and slot_bytes > 0
        self.path = path
        self.slot_bytes = slot_bytes
        self.token = os.urandom(TOKEN_BYTES)
        path.unlink(missing_ok=True)  # a dead predecessor's file: a new inode, so no stale map aliases this one
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER + slots * slot_bytes)
            self._map = mmap.mmap(fd, HEADER + slots * slot_bytes)
        finally:
            os.close(fd)
        self._map[:TOKEN_BYTES] = self.token
        self._free = list(range(slots - 1, -1, -1))
        self.lost = 0  # slots retired after a timeout

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A free slot's offset, or None when every slot is lent or retired."""
        return HEADER + self._free.pop() * self.slot_bytes if self._free else None

    def give(self, offset: int) -> None:
        self._free.append((offset - HEADER) // self.slot_bytes)

    def lose(self, offset: int) -> None:
        """The request holding this slot timed out: the store may write into it yet, so it is never lent again."""
        self.lost += 1

    def write(self, offset: int, blobs: Sequence[bytes]) -> list[int]:
        """Copy `blobs` one after the other into the slot at `offset`; their lengths."""
        at = offset
        for blob in blobs:
            self._map[at : at + len(blob)] = blob
            at += len(blob)
        assert at - offset <= self.slot_bytes, "a batch larger than a slot"
        return [len(b) for b in blobs]

    def read(self, offset: int, lengths: Sequence[int]) -> list[bytes]:
        out, at = [], offset
        for n in lengths:
            out.append(self._map[at : at + n])
            at += n
        return out

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


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
        old = self._maps.pop(path, None)
        if old is not None:
            old.close()
            del self._inodes[path]
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
        """Unmap arenas whose file is gone or replaced (their worker stopped or died): a map would keep the
        memory of an unlinked file alive. Returns how many."""
        gone = []
        for path in self._maps:
            try:
                if os.stat(path).st_ino == self._inodes[path]:
                    continue
            except OSError:
                pass
            gone.append(path)
        for path in gone:
            self._maps.pop(path).close()
            del self._inodes[path]
        return len(gone)

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
        self._inodes.clear()
