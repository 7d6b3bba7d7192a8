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
class CudaHandle:
    """A CUDA allocation shared with another process, as plain data (what torch's storage-level `_share_cuda_`
    gives: shared/worker/kv_cuda_ipc.py), never pickled."""

    device: int  # the producer's device index (the consumer maps it by `KvPeerCuda.uuid`)
    handle: bytes  # cudaIpcMemHandle of the allocation the buffer lies in
    size_bytes: int  # the storage's
    offset_bytes: int  # the storage's start inside that allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int  # of the buffer (the storage may be larger: the caching allocator's block)


@dataclass(frozen=True)
class KvPeerCuda:
    """Where a hand-over's items lie in the prefill worker's GPU memory: one device buffer, the items back to back
    from 0 (blocks, the partial block, the state as one item); decode copies it device to device and checks the
    copy's digest before it uses a byte."""

    boot_id: str  # the producer's host (its kernel boot id): a handle means nothing on another host
    uuid: str  # the producer's GPU
    handle: CudaHandle
    lengths: list[int]  # every item's, from item 0
    digest: int  # the buffer's 64-bit words summed modulo 2**64, as a signed int64 (kv_cuda_ipc.digest)


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
    cuda: KvPeerCuda | None = None  # set: the items lie in the peer's GPU memory (items and checksums empty)


@dataclass(frozen=True)
class KvPeerDone:
    """decode -> prefill on `kv.peer.<prefill worker>.done`: the pull is over (done or given up); let go."""

    request_id: str
