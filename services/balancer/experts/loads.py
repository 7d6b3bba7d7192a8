"""Sliding-window expert loads per worker group: the windows of counts its workers reported, summed over the
last `window_s` seconds. Pure bookkeeping; time comes in as `now` (our clock, on arrival: never the sender's)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from shared.schemas.experts import ExpertLoad


class BadLoad(ValueError):
    """An ExpertLoad whose counts do not fit its own shape, or its group's."""


@dataclass
class GroupLoads:
    """One group's shape (from its latest report) and its windows, oldest first."""

    last: ExpertLoad
    windows: deque[tuple[float, np.ndarray]] = field(default_factory=deque)  # (arrived, (layers, experts))

    def total(self) -> np.ndarray:
        shape = (self.last.layers, self.last.experts)
        return sum((w for _, w in self.windows), np.zeros(shape, dtype=np.int64))


class SlidingLoads:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.groups: dict[str, GroupLoads] = {}

    def observe(self, load: ExpertLoad, now: float) -> None:
        """Add a report's window; raises BadLoad for counts of the wrong size or sign, or a changed shape."""
        if load.layers < 1 or load.experts < 1 or len(load.counts) != load.layers * load.experts:
            raise BadLoad(f"{load.worker_id}: {len(load.counts)} counts for {load.layers} x {load.experts}")
        counts = np.asarray(load.counts, dtype=np.int64).reshape(load.layers, load.experts)
        if (counts < 0).any():
            raise BadLoad(f"{load.worker_id}: negative counts")
        group = self.groups.get(load.group)
        if group is not None and (group.last.layers, group.last.experts) != (load.layers, load.experts):
            # another model under the same group name (a restart with a new checkpoint): start afresh
            group = None
        if group is None:
            group = self.groups[load.group] = GroupLoads(load)
        group.last = load
        group.windows.append((now, counts))
        self.expire(now)

    def expire(self, now: float) -> None:
        for group in self.groups.values():
            while group.windows and now - group.windows[0][0] > self.window_s:
                group.windows.popleft()

    def forget(self, name: str) -> None:
        self.groups.pop(name, None)
