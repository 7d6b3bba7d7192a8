"""A worker's per-expert routing counts on the bus, and the expert plans it is sent.

    every interval_s   the engine's cumulative (layers, experts) counts, read between two steps (one device
                       sync every few seconds, none per step), less the previous read -> one window's ExpertLoad
                       on experts.load; the last window summarised in the worker's health
    experts.plan       a plan for this worker's group: an expert-parallel worker (--expert-parallel N) applies
                       it between two steps (its ranks move the expert weights, then switch routing tables) and
                       reports its version from then on; a single-rank worker holds every expert once and has
                       nothing to place, so it logs and ignores the plan and keeps reporting plan_version 0
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from shared import subjects
from shared.bus import Bus, Envelope, Subscription
from shared.engine.async_engine import AsyncEngine
from shared.schemas.experts import ExpertLoad, ExpertPlan

log = logging.getLogger(__name__)


class ExpertCounts:
    def __init__(self, engine: AsyncEngine, worker_id: str, role: str, model: str, interval_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.engine = engine
        self.worker_id, self.role, self.model = worker_id, role, model
        self.group = worker_id  # one worker's GPUs are one placement (a single GPU, for now)
        self.interval_s = interval_s
        self._clock = clock
        self._bus: Bus | None = None
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._seen: torch.Tensor | None = None  # the cumulative counts at the last read
        self._seen_at = 0.0
        self._busy: torch.Tensor | None = None  # the last window that routed anything
        self.stats: Counter[str] = Counter()

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        self._seen, self._seen_at = await self.engine.expert_counts(), self._clock()
        assert self._seen is not None, "a model without routed experts has no counts to report"
        self._sub = await bus.subscribe(subjects.EXPERT_PLAN, ExpertPlan, self._on_plan)
        self._task = asyncio.create_task(self._report_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _report_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.report()
            except Exception:  # a lost window is one window: the next read covers from the last good one
                log.exception("expert counts not reported")

    async def report(self) -> ExpertLoad:
        """Read the counts, publish the window since the last read."""
        assert self._bus is not None and self._seen is not None
        counts, now = await self.engine.expert_counts(), self._clock()
        assert counts is not None
        window = counts - self._seen  # (layers, experts)
        layers, experts = window.shape
        load = ExpertLoad(worker_id=self.worker_id, role=self.role, model=self.model, group=self.group,
                          layers=layers, experts=experts, counts=window.flatten().tolist(),
                          window_s=now - self._seen_at, sent_at=now, expert_bytes=self.engine.engine.expert_bytes,
                          ranks_per_node=self.engine.engine.expert_ranks,
                          plan_version=self.engine.engine.expert_plan_version)
        await self._bus.publish(subjects.EXPERT_LOAD, load)
        self._seen, self._seen_at = counts, now
        self.stats["windows"] += 1
        self.stats["pairs"] += int(window.sum())
        if int(window.sum()):
            self._busy = window
        return load

    async def _on_plan(self, plan: ExpertPlan, _: Envelope) -> None:
        if plan.group != self.group:
            return
        if self.engine.engine.expert_ranks > 1:
            await self._apply(plan)
            return
        self.stats["plans_ignored"] += 1
        log.info("expert plan %d for %s ignored: a single-GPU worker holds every expert once (%d layers would "
                 "change, %.1f MB move)", plan.version, self.group, plan.layers_changed, plan.moved_bytes / 1e6)

    async def _apply(self, plan: ExpertPlan) -> None:
        started = time.monotonic()
        try:
            moved = await self.engine.call(self.engine.engine.apply_expert_plan, plan)
        except ValueError as exc:  # a plan for another shape of group: the running placement stays
            self.stats["plans_refused"] += 1
            log.warning("expert plan %d for %s refused: %s", plan.version, self.group, exc)
            return
        self.stats["plans_applied"] += 1
        log.info("expert plan %d for %s applied in %.2fs (%d layers changed, %.1f MB received by rank 0)",
                 plan.version, self.group, time.monotonic() - started, plan.layers_changed, moved / 1e6)

    def health(self) -> dict[str, Any]:
        """The counters (windows sent, token-expert pairs reported, plans ignored) and, of the last window that
        routed anything, the per-layer max / mean expert load (what a placement has to even out), mean and worst
        over layers."""
        out: dict[str, Any] = dict(self.stats)
        if self._busy is not None:
            busy = self._busy.double()
            skew = busy.max(dim=1).values / busy.mean(dim=1).clamp(min=1e-9)  # (layers,)
            out.update(expert_skew_mean=round(float(skew.mean()), 3), expert_skew_max=round(float(skew.max()), 3))
        return out
