"""prefill/decode <-> kvcache: KV blocks by chained hash (long-term) and per-request tails (short-term)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvLookup:
    hashes: list[bytes]  # chained block hashes of a prompt, in order


@dataclass(frozen=True)
class KvLookupReply:
    hits: int  # length of the longest stored prefix run of `hashes`


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
