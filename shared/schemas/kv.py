"""-> kvcache: KV blocks by chained hash (long-term) and per-request tails (short-term) from prefill and decode;
the store's stats for the gateway's /metrics (`kv.stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KvLookup:
    hashes: list[bytes]  # chained block hashes of a prompt, in order
    lease_s: float = 0.0  # > 0: keep the reported run from eviction this long (the service caps it), for the gets


@dataclass(frozen=True)
class KvLookupReply:
    """The run and where it lies: `tiers` maps each of the store's tiers to the run's blocks there, each block
    counted in its fastest tier (so they add up to `hits`): a router can price a RAM hit as nearly free and a disk
    hit as cheaper than compute but not free."""

    hits: int  # length of the longest stored prefix run of `hashes`
    # tier -> blocks of the run: "ram" (hot copies), "lmdb" (only in LMDB, on disk: short-term entries, warm
    # blocks), "ssd" (only on the SSD tier); every tier the store has, 0 included
    tiers: dict[str, int] = field(default_factory=dict)
    lease_s: float = 0.0  # the lease granted on the run (0 = none)


@dataclass(frozen=True)
class KvGet:
    keys: list[bytes]


@dataclass(frozen=True)
class KvGetReply:
    blobs: list[bytes | None]  # one per key, None where absent


@dataclass(frozen=True)
class KvPut:
    key: bytes
    data: bytes
    ttl_s: float = 0.0  # 0 = long-term (no expiry)


@dataclass(frozen=True)
class KvPutReply:
    stored: bool


@dataclass(frozen=True)
class KvGetRun:
    """The leading run of `keys`, as much of it as one reply carries (the bus's payload limit)."""

    keys: list[bytes]
    max_bytes: int = 0  # the reply's blobs in all at most this (0: the payload limit); the first blob may exceed it


@dataclass(frozen=True)
class KvGetRunReply:
    blobs: list[bytes]  # the blobs of keys[0 : len(blobs)], all present
    ended: bool  # True: keys[len(blobs)] is absent (the run ends there); False: the reply was full, or all were sent


@dataclass(frozen=True)
class KvPutBatch:
    """Many entries in one message (at most the bus's payload limit in all), all with the same TTL."""

    keys: list[bytes]
    blobs: list[bytes]  # one per key
    ttl_s: float = 0.0  # 0 = long-term (no expiry)


@dataclass(frozen=True)
class KvPutBatchReply:
    stored: list[bool]  # one per key: True when its home tier stored it


@dataclass(frozen=True)
class KvPutShm:
    """`kv.put.batch` with the blobs in the sender's shared-memory arena (shared/kv_arena.py), one after another
    from `offset`."""

    keys: list[bytes]
    lengths: list[int]  # one per key
    arena: str  # the arena's path
    token: bytes  # the arena's token: proves the store maps the same file (same host)
    offset: int
    ttl_s: float = 0.0
    # CLOCK_MONOTONIC (one clock on a host): the store reads the slot only before it (0: no deadline); after it
    # the sender may have lent the slot again
    deadline: float = 0.0


@dataclass(frozen=True)
class KvGetRunShm:
    """`kv.get.run` with the blobs written into the sender's arena at `offset`, at most `capacity` bytes."""

    keys: list[bytes]
    arena: str
    token: bytes
    offset: int
    capacity: int
    deadline: float = 0.0  # CLOCK_MONOTONIC: the store writes into the slot only before it (0: no deadline)


@dataclass(frozen=True)
class KvShmReply:
    mapped: bool  # False: the store cannot map that arena (another host): send the bytes over NATS instead
    stored: list[bool] = field(default_factory=list)  # a put's: one per key
    lengths: list[int] = field(default_factory=list)  # a get's: the run's blobs, one after another at offset
    ended: bool = False  # a get's: as KvGetRunReply.ended


@dataclass(frozen=True)
class KvGetHeap:
    """A same-host reader asks where the leading run of `keys` lies in the store's shared heap (shared/kv_heap.py),
    under a read lease until `deadline`. Only the part the RAM tier holds is answered; the reader gets the rest
    the other ways (`kv.get.shm`, `kv.get.run`)."""

    keys: list[bytes]
    arena: str  # the reader's arena and its token: the store maps it, which proves it is on the same host
    token: bytes
    deadline: float  # CLOCK_MONOTONIC: the lease's end the reader asks for (the store may grant less)


@dataclass(frozen=True)
class KvHeapReply:
    heap: str  # the heap's path; "" when the store has no shared heap or the reader is not on its host
    token: bytes = b""  # the heap's token (a fresh one per heap file)
    instance: str = ""  # the store that granted the lease: kv.heap.release.<instance> ends it
    lease: int = 0  # 0: nothing lent (the first key is not in RAM)
    offsets: list[int] = field(default_factory=list)  # blob i of the run lies at heap[offsets[i] :][: lengths[i]]
    lengths: list[int] = field(default_factory=list)
    deadline: float = 0.0  # CLOCK_MONOTONIC: the lease granted; a reader that has not locked the bytes by then
    # must not read them


@dataclass(frozen=True)
class KvHeapRelease:
    """A reader is done with a heap lease (its import is over): the store may free what it deferred (core
    publish; lost, the lease ends at its deadline)."""

    lease: int
    token: bytes  # the heap's: a release meant for a store that has restarted since ends nothing of the new one


@dataclass(frozen=True)
class KvDelete:
    keys: list[bytes]


@dataclass(frozen=True)
class KvDeleteReply:
    deleted: int  # entries that were present


@dataclass(frozen=True)
class KvStats:
    """gateway -> kvcache on `kv.stats`: the store's counters, for /metrics."""


@dataclass(frozen=True)
class KvTierStats:
    entries: int
    bytes: int  # live records
    capacity_bytes: int
    disk_bytes: int  # on disk, live or not (0 for RAM)
    hits: int
    misses: int
    evictions: int
    expired: int
    corrupt: int  # records that failed their checksum: dropped, never returned
    promotions: int  # entries copied into this tier from a slower one


@dataclass(frozen=True)
class KvStatsReply:
    instance: str
    tiers: dict[str, KvTierStats]  # tier ("ram" | "lmdb" | "ssd") -> its stats, fastest first
    counters: dict[str, int] = field(default_factory=dict)  # store-wide: lookups, puts, bytes read/written...
    leases: int = 0  # leases held now
