"""The experts role on the bus: routing counts in (experts.load), plans out (experts.plan). All decisions are the
role's (role.py); this only feeds it and publishes what it returns, ticking every `tick_s`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.balancer.experts.loads import BadLoad
from services.balancer.experts.role import ExpertsRole
from shared import subjects
from shared.bus import Bus, Envelope, Subscription
from shared.schemas.experts import ExpertLoad

log = logging.getLogger(__name__)

TICK_S = 1.0


class ExpertsFeed:
    def __init__(self, role: ExpertsRole, clock: Callable[[], float], tick_s: float = TICK_S) -> None:
        self.role = role
        self._clock = clock
        self._tick_s = tick_s
        self._bus: Bus | None = None
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        # reports that arrive while the role plans on its thread wait here: the role is never touched from two
        # threads at once, and the loop never waits for the planner
        self._held: list[tuple[ExpertLoad, float]] | None = None
        self.stats: dict[str, int] = {}  # the role's counters as of the loop's last look (health reads these)

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        self._sub = await bus.subscribe(subjects.EXPERT_LOAD, ExpertLoad, self._on_load)
        self._task = asyncio.create_task(self._tick_forever())

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _on_load(self, load: ExpertLoad, _: Envelope) -> None:
        if self._held is not None:
            self._held.append((load, self._clock()))
        else:
            self._observe(load, self._clock())

    def _observe(self, load: ExpertLoad, now: float) -> None:
        try:
            self.role.observe(load, now)
        except BadLoad as exc:  # one worker's bad report: dropped, the others still count
            self.role.stats["bad_loads"] += 1
            log.warning("expert counts dropped: %s", exc)
        self.stats = dict(self.role.stats)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            try:
                await self.tick()
            except Exception:
                log.exception("expert placement tick failed")

    async def tick(self) -> None:
        assert self._bus is not None
        # the planner is CPU work (~1 s for 43 layers on 64 GPUs): off the loop, so routing never waits for it
        self._held = []
        try:
            plans = await asyncio.to_thread(self.role.tick, self._clock())
        finally:
            held, self._held = self._held, None
            self.stats = dict(self.role.stats)
            for load, at in held:
                self._observe(load, at)
        for plan in plans:
            log.info("expert plan %d for %s: %d layers changed, %.1f MB to move, max/mean GPU load %.3f -> %.3f",
                     plan.version, plan.group, plan.layers_changed, plan.moved_bytes / 1e6, plan.imbalance_before,
                     plan.imbalance_after)
            await self._bus.publish(subjects.EXPERT_PLAN, plan)
