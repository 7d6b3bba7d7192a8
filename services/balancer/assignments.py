"""Which worker holds which request, so a lost worker's requests are known and never left hanging.

An entry lives from dispatch until the worker reports the request done (`workers.done`), the request is
cancelled, the next role takes it over (a decode job arriving ends the prefill part), or its role's TTL passes
(a backstop for done reports that never came). Cancelled request ids are remembered for a while so a job that
is still waiting in a route queue is dropped instead of placed. Pure bookkeeping; `now` is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CANCEL_MEMORY_S = 300.0


@dataclass(frozen=True)
class Assignment:
    request_id: str
    role: str
    worker_id: str
    job: Any  # kept only where the role can re-route it (None otherwise): prompts can be large
    at: float
    expires_at: float
    attempt: int = 0  # how many times this job has been re-routed
    migration: int = 0  # the request's migration the job belongs to (GenerateRequest.migration)
    trace: Any = None  # the routing span's context, so a re-route joins the request's trace


class Assignments:
    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Assignment] = {}  # (request id, role) -> assignment
        self._by_worker: dict[str, set[tuple[str, str]]] = {}
        self._cancelled: dict[str, float] = {}  # request id -> when

    def add(self, a: Assignment) -> None:
        self.drop(a.request_id, a.role)
        key = (a.request_id, a.role)
        self._by_key[key] = a
        self._by_worker.setdefault(a.worker_id, set()).add(key)

    def get(self, request_id: str, role: str) -> Assignment | None:
        return self._by_key.get((request_id, role))

    def drop(self, request_id: str, role: str, worker_id: str | None = None, migration: int | None = None
             ) -> Assignment | None:
        """Forget an assignment; with `worker_id`, only if that worker still holds it (not re-routed since); with
        `migration`, only if it is of that migration or an earlier one (a later continuation stays)."""
        key = (request_id, role)
        a = self._by_key.get(key)
        if a is None or (worker_id is not None and a.worker_id != worker_id):
            return None
        if migration is not None and a.migration > migration:
            return None
        del self._by_key[key]
        keys = self._by_worker[a.worker_id]
        keys.discard(key)
        if not keys:
            del self._by_worker[a.worker_id]
        return a

    def take_worker(self, worker_id: str) -> list[Assignment]:
        """Remove and return every assignment held by `worker_id` (it left the pool)."""
        keys = self._by_worker.pop(worker_id, set())
        return sorted((self._by_key.pop(k) for k in keys), key=lambda a: a.at)

    def cancel(self, request_id: str, roles: list[str], now: float) -> None:
        self._cancelled[request_id] = now
        for role in roles:
            self.drop(request_id, role)

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def expire(self, now: float) -> int:
        stale = [a for a in self._by_key.values() if a.expires_at <= now]
        for a in stale:
            self.drop(a.request_id, a.role)
        self._cancelled = {r: t for r, t in self._cancelled.items() if now - t < CANCEL_MEMORY_S}
        return len(stale)

    def __len__(self) -> int:
        return len(self._by_key)
