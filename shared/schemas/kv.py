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
