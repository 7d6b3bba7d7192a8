"""decode -> prefill: the hand-over, decode pulling a request's prompt KV straight from the prefill worker that
computed it, on `kv.peer.<prefill worker>` (shared/worker/kv_peer.py); what the peer cannot give comes from the
kvcache service (kv.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
