"""An exclusive lock on a file, held while the returned file stays open, that names its holder's pid.

flock: the kernel drops it when the process dies, however it dies, so a stale lock file never blocks a restart.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class Locked(Exception):
    """Another process holds the lock; `holder` is its pid as it wrote it ("unknown" if it wrote none)."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"locked by pid {holder}")
        self.holder = holder


def acquire(path: Path) -> IO[str]:
    """Take the lock or raise `Locked` at once (never waits); the file then holds our pid."""
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise Locked(holder) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock
