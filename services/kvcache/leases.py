"""Leases: keys a reader has been promised, which capacity eviction must skip until the lease ends.

`kv.lookup` may lease the run it reports, so the blocks it counted are still there (and still in the tier it
named) when the caller's `kv.get`s arrive. A lease only protects against eviction for room; a TTL still ends a
short-term entry, and `kv.delete` still deletes. Leases are short (the service caps them) and live in memory:
a restart ends them all, which is safe, because a reader then sees a miss and recomputes.
"""

from __future__ import annotations

from collections.abc import Iterable


class Leases:
    def __init__(self) -> None:
        self._until: dict[bytes, float] = {}

    def take(self, keys: Iterable[bytes], until: float) -> None:
        for key in keys:
            if self._until.get(key, 0.0) < until:
                self._until[key] = until

    def held(self, key: bytes, now: float) -> bool:
        return self._until.get(key, 0.0) > now

    def active(self, now: float) -> list[bytes]:
        return [key for key, until in self._until.items() if until > now]

    def sweep(self, now: float) -> int:
        """Forget ended leases; returns how many are still held."""
        self._until = {key: until for key, until in self._until.items() if until > now}
        return len(self._until)

    def __len__(self) -> int:
        return len(self._until)
