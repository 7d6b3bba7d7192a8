"""KV events: what each cache holds, as numbered changes per source plus snapshots to resynchronise from.

A source is one cache whose contents a router wants to know: an engine worker's local prefix cache (source id =
the worker's instance id, tier "local") or one kvcache instance's long-term store (source id = its instance id,
tiers "ram" / "lmdb" / "ssd"). Each source numbers its events 1, 2, 3, ... within an epoch (one run of the publisher):

    kv.events.<source>     KvEvent, core NATS: stored | removed (a change), tick (idle: "my last seq is N")
    kv.snapshot.<source>   KvSnapshotRequest -> KvSnapshot, request/reply, in pages

A consumer applies event seq N+1 on top of seq N; a jump (a lost message), a new epoch (the publisher restarted)
or a source it never heard of means it fetches a snapshot (every hash held, and the seq it corresponds to) and
applies only the events after that seq. Ops are idempotent per (hash, tier): replaying a change the snapshot
already reflects is harmless, so a snapshot may be taken while events are still in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OP_STORED = "stored"  # the hashes became findable in `tier`
OP_REMOVED = "removed"  # the hashes are no longer in `tier`
OP_TICK = "tick"  # nothing changed; `seq` is the source's last seq (lets an idle source's gaps be noticed)
OPS = (OP_STORED, OP_REMOVED, OP_TICK)

TIER_LOCAL = "local"  # an engine worker's own prefix cache (device memory): reusable for free
TIER_RAM = "ram"  # the kvcache store's host-memory tier
TIER_LMDB = "lmdb"  # the kvcache store's memory-mapped tier (page cache when warm, disk when cold)
TIER_SSD = "ssd"  # the kvcache store's disk tier
TIERS = (TIER_LOCAL, TIER_RAM, TIER_LMDB, TIER_SSD)  # fastest first: a hash held in several counts as the first


@dataclass(frozen=True)
class KvEvent:
    source: str
    epoch: str  # one run of the publisher; a new epoch restarts the numbering at 1
    seq: int
    op: str  # one of OPS
    tier: str = ""
    hashes: list[bytes] = field(default_factory=list)  # chained block hashes (shared.hashing), in change order


@dataclass(frozen=True)
class KvSnapshotRequest:
    snapshot_id: str = ""  # "" = take a new snapshot and return its first page
    offset: int = 0  # hashes to skip, counted over the snapshot's tiers in order


@dataclass(frozen=True)
class KvSnapshot:
    """One page of a snapshot (a whole snapshot once a consumer has joined its pages)."""

    source: str
    epoch: str
    seq: int  # the snapshot reflects every event up to and including this seq
    snapshot_id: str
    hashes: dict[str, list[bytes]]  # tier -> the hashes held there (this page's share)
    next_offset: int = 0  # 0 = last page
    error: str = ""  # e.g. the snapshot expired between pages: start again
