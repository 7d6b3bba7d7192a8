"""prefill/decode <-> kvcache: KV blocks by chained hash (long-term) and per-request tails (short-term)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KvLookup:
    hashes: list[bytes]  # chained block hashes of a prompt, in order
    lease_s: float = 0.0  # > 0: keep the reported run from eviction this long (the service caps it), for the gets


@dataclass(frozen=True)
class KvLookupReply:
    """The run and where it lies: hits = ram_hits + lmdb_hits + ssd_hits (each block counted in its fastest tier),
    so a router can price a RAM hit as nearly free and a disk hit as cheaper than compute but not free."""

    hits: int  # length of the longest stored prefix run of `hashes`
    ram_hits: int = 0  # blocks of the run in the kvcache's RAM tier
    lmdb_hits: int = 0  # blocks of the run only in LMDB (on disk): short-term entries, warm blocks
    ssd_hits: int = 0  # blocks of the run only on the SSD tier
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
    tier: str  # "ram" | "lmdb" | "ssd"
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
    tiers: list[KvTierStats]
    counters: dict[str, int] = field(default_factory=dict)  # store-wide: lookups, puts, bytes read/written...
    leases: int = 0  # leases held now


# --- the hand-over: decode pulls a request's prompt KV straight from the prefill worker (shared/worker/kv_peer.py) 


@dataclass(frozen=True)
class KvPeerPull:
    """decode -> prefill on `kv.peer.<prefill worker>`: items [start, ...) of a request's hand-over, as many as
    fit `max_bytes` (the first one always). Items are the prompt's full blocks, then its partial last block (if
    any), then its model state in parts. `keys`: the block hashes the caller expects from `start` on; a
    hand-over under other hashes answers `found=False` (never someone else's bytes)."""

    request_id: str
    start: int
    keys: list[bytes]
    max_bytes: int
    count: int = 0  # at most this many items (0: as many as fit)
    checksum: str = "crc32"  # the checksum the caller would rather have: "xxh3" (where installed) | "crc32"
    # transports the caller can read the bytes through, best first (shared/worker/kv_peer_transport.py): a peer
    # that holds the hand-over in one of them answers with a descriptor (KvPeerReply.shm), not the bytes
    via: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class KvPeerShm:
    """Where a hand-over's items [start, ...) lie in the prefill worker's arena (shared/kv_arena.py), one after
    another from `offset`: read them under a read lock on the region (PeerMap.hold), check each item's checksum."""

    arena: str  # the arena's path
    token: bytes  # the arena's token: proves the reader maps the same file (same host, same arena)
    offset: int
    lengths: list[int]  # one per item


@dataclass(frozen=True)
class KvPeerReply:
    found: bool  # False: no live hand-over of that request here (ended, expired, cancelled, other hashes)
    items: list[bytes] = field(default_factory=list)  # items [start, start + len(items))
    checksums: list[int] = field(default_factory=list)  # of each item, checked on arrival
    blocks: int = 0  # the hand-over's full blocks
    tail: bool = False  # an item for the partial last block follows them
    state_parts: int = 0  # items of model state after that
    checksum: str = "crc32"  # which: the one asked for where the peer has it, else crc32 (everyone has it)
    shm: KvPeerShm | None = None  # set: the items lie there (items is empty; checksums are of all of them)


@dataclass(frozen=True)
class KvPeerDone:
    """decode -> prefill on `kv.peer.<prefill worker>.done`: the pull is over (done or given up); let go."""

    request_id: str
