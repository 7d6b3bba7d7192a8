"""The mesh as the gateway hears it: the workers' heartbeats and the other services' presence.

Pure bookkeeping with `now` passed in (monotonic seconds, our clock: freshness must not depend on clock skew),
so readiness and the per-worker gauges are tested without a broker. A worker or service silent for longer than
`timeout_s` (the balancer's default worker timeout) is gone: it counts for neither.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from shared.presence import PRESENCE_TIMEOUT_S
from shared.schemas.health import Presence
from shared.schemas.workers import Heartbeat

ROLES = ("prefill", "decode")


class Fleet:
    def __init__(self, timeout_s: float = PRESENCE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._workers: dict[str, tuple[float, Heartbeat]] = {}  # worker id -> (heard at, latest beat)
        self._services: dict[tuple[str, str], tuple[float, Presence]] = {}  # (service, instance) -> ...
        self._boots: dict[str, float] = {}  # a service process's Presence.boot -> when last heard
        self._draft_rates: dict[str, float] = {}  # worker id -> drafts proposed per second between its last beats

    def heard_worker(self, beat: Heartbeat, now: float) -> None:
        prev = self._workers.get(beat.worker_id)
        if prev is not None and now > prev[0] and beat.spec_drafted >= prev[1].spec_drafted:
            self._draft_rates[beat.worker_id] = (beat.spec_drafted - prev[1].spec_drafted) / (now - prev[0])
        elif prev is not None:  # a restarted worker (its counter began again): no rate until its next beat
            self._draft_rates.pop(beat.worker_id, None)
        self._workers[beat.worker_id] = (now, beat)

    def draft_rates(self, now: float) -> dict[str, float]:
        """Speculative drafts per second of every live worker that has beaten twice, by id (heartbeat to
        heartbeat: what a scrape sees does not depend on how often it scrapes)."""
        self._forget(now)
        return {w: r for w, r in self._draft_rates.items() if w in self._workers}

    def heard_service(self, presence: Presence, now: float) -> None:
        self._services[(presence.service, presence.instance)] = (now, presence)
        if presence.boot:
            self._boots[presence.boot] = now

    def last_heard(self, boot: str) -> float | None:
        """When the service process `boot` was last heard (None: not for a while, or never)."""
        return self._boots.get(boot)

    def workers(self, now: float) -> list[Heartbeat]:
        """The latest heartbeat of every live worker, by id."""
        self._forget(now)
        return [beat for _, (_, beat) in sorted(self._workers.items())]

    def services(self, now: float) -> list[Presence]:
        self._forget(now)
        return [presence for _, (_, presence) in sorted(self._services.items())]

    def missing(self, models: Sequence[str], now: float) -> list[str]:
        """What the mesh lacks to serve every model in `models`; [] = ready."""
        workers = Counter((w.role, w.model) for w in self.workers(now))
        services = self.services(now)
        lacking = [] if any(p.service == "balancer" for p in services) else ["a balancer"]
        for model in models:
            recipe = next((p for p in services if p.service == "recipe" and model in p.models), None)
            if recipe is None:
                lacking.append(f"a recipe for {model}")
            served = recipe.aliases.get(model, model) if recipe is not None else model  # workers serve one name
            lacking += [f"a {role} worker for {served}" for role in ROLES if not workers[(role, served)]]
        return list(dict.fromkeys(lacking))  # an alias and its model lack the same workers: say it once

    def _forget(self, now: float) -> None:
        cutoff = now - self.timeout_s
        self._workers = {k: seen for k, seen in self._workers.items() if seen[0] >= cutoff}
        self._draft_rates = {k: r for k, r in self._draft_rates.items() if k in self._workers}
        self._services = {k: seen for k, seen in self._services.items() if seen[0] >= cutoff}
        if len(self._boots) > 2 * len(self._services) + 16:  # processes gone long ago (restarts): bounded memory
            self._boots = {b: at for b, at in self._boots.items() if at >= now - 60 * self.timeout_s}
