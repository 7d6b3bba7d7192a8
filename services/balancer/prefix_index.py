"""The balancer's prefix index: every KV source's holdings (which block hashes it caches, in which tier) as its
events and snapshots describe them. Pure: services/balancer/kv_feed.py feeds it from the bus; the publisher and
the wire types are shared/kv_events.py and shared/schemas/events.py.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from shared.schemas.events import OP_REMOVED, OP_STORED, OP_TICK, TIER_LOCAL, TIERS, KvEvent, KvSnapshot

PENDING_EVENTS = 4096  # events a consumer keeps while its snapshot request is in flight (more: fetch again)


class Sync(StrEnum):
    OK = "ok"  # the index is in step with the source
    GAP = "gap"  # it missed something (or never knew the source): fetch a snapshot and load() it


@dataclass(frozen=True)
class Run:
    """The leading blocks of a prompt a source holds: the tier each one would be read from, in order."""

    tiers: tuple[str, ...] = ()

    @property
    def blocks(self) -> int:
        return len(self.tiers)

    def by_tier(self, start: int = 0) -> dict[str, int]:
        """Blocks of the run from block `start` on, per tier."""
        return dict(Counter(self.tiers[start:]))


def _tier_rank(tier: str) -> tuple[int, str]:
    return (TIERS.index(tier), "") if tier in TIERS else (len(TIERS), tier)


class _Source:
    def __init__(self, max_pending: int) -> None:
        self.epoch = ""
        self.seq = 0
        self.synced = False
        self.held: dict[bytes, int] = {}  # hash -> bit mask of the tiers holding it
        self.bits: dict[str, int] = {}  # tier -> its bit
        self.pending: deque[KvEvent] = deque(maxlen=max_pending)  # heard while out of step
        self._best: dict[int, str] = {}  # bit mask -> the fastest tier in it

    def reset(self, epoch: str, seq: int, holdings: Mapping[str, Iterable[bytes]]) -> None:
        self.epoch, self.seq, self.synced = epoch, seq, True
        self.held.clear()
        self.pending.clear()
        for tier, hashes in holdings.items():
            self.change(OP_STORED, tier, hashes)

    def change(self, op: str, tier: str, hashes: Iterable[bytes]) -> None:
        bit = self.bits.get(tier)
        if bit is None:
            bit = self.bits[tier] = 1 << len(self.bits)
            self._best.clear()
        held = self.held
        if op == OP_STORED:
            for h in hashes:
                held[h] = held.get(h, 0) | bit
        else:
            for h in hashes:
                mask = held.get(h, 0) & ~bit
                if mask:
                    held[h] = mask
                else:
                    held.pop(h, None)

    def best(self, mask: int) -> str:
        tier = self._best.get(mask)
        if tier is None:
            tier = self._best[mask] = min((t for t, b in self.bits.items() if mask & b), key=_tier_rank)
        return tier

    def holdings(self) -> dict[str, set[bytes]]:
        out: dict[str, set[bytes]] = {}
        for h, mask in self.held.items():
            for tier, bit in self.bits.items():
                if mask & bit:
                    out.setdefault(tier, set()).add(h)
        return out


class PrefixIndex:
    """Every source's holdings as its events and snapshots describe them; no I/O.

    A source out of step (after a gap) keeps answering from what it last knew, which is nearly right, until a
    snapshot replaces it; the events heard meanwhile are kept and applied on top of the snapshot.
    """

    def __init__(self, max_pending: int = PENDING_EVENTS) -> None:
        self._sources: dict[str, _Source] = {}
        self._max_pending = max_pending

    def apply(self, event: KvEvent) -> Sync:
        src = self._sources.get(event.source)
        if src is None:
            src = self._sources[event.source] = _Source(self._max_pending)
        tick = event.op == OP_TICK
        if event.op not in (OP_STORED, OP_REMOVED, OP_TICK):
            src.synced = False  # a publisher this consumer does not understand: start over from a snapshot
            return Sync.GAP
        if src.synced and (event.epoch != src.epoch or event.seq > src.seq + (0 if tick else 1)):
            src.synced = False
        if not src.synced:
            if not tick:
                src.pending.append(event)
            return Sync.GAP
        if not tick and event.seq > src.seq:  # (an older one is already reflected)
            src.change(event.op, event.tier, event.hashes)
            src.seq = event.seq
        return Sync.OK

    def load(self, snapshot: KvSnapshot) -> Sync:
        """Replace a source's holdings with a whole snapshot, then apply the events heard after its seq."""
        src = self._sources.get(snapshot.source)
        if src is None:
            src = self._sources[snapshot.source] = _Source(self._max_pending)
        later = [e for e in src.pending if e.epoch == snapshot.epoch and e.seq > snapshot.seq]
        src.reset(snapshot.epoch, snapshot.seq, snapshot.hashes)
        for event in later:
            self.apply(event)
        return Sync.OK if src.synced else Sync.GAP

    def run(self, source: str, hashes: Sequence[bytes]) -> Run:
        """The longest leading run of `hashes` (a prompt's chained block hashes) that `source` holds."""
        src = self._sources.get(source)
        if src is None:
            return Run()
        tiers = []
        for h in hashes:
            mask = src.held.get(h)
            if not mask:
                break
            tiers.append(src.best(mask))
        return Run(tuple(tiers))

    def runs(self, hashes: Sequence[bytes]) -> dict[str, Run]:
        """`run` of every source that holds at least the first block."""
        out = {}
        for source in self._sources:
            run = self.run(source, hashes)
            if run.blocks:
                out[source] = run
        return out

    def store_sources(self) -> list[str]:
        """Sources that are shared stores (tiers other than an engine's local cache), by name."""
        return sorted(s for s, src in self._sources.items() if any(t != TIER_LOCAL for t in src.bits))

    def forget(self, source: str) -> None:
        self._sources.pop(source, None)

    def sources(self) -> list[str]:
        return sorted(self._sources)

    def synced(self, source: str) -> bool:
        src = self._sources.get(source)
        return src is not None and src.synced

    def seq(self, source: str) -> int:
        src = self._sources.get(source)
        return 0 if src is None else src.seq

    def holdings(self, source: str) -> dict[str, set[bytes]]:
        """tier -> hashes (for inspection and tests)."""
        src = self._sources.get(source)
        return {} if src is None else src.holdings()
