"""How a hand-over's bytes reach decode (`--kv-peer-transport`), by name; NATS carries only a descriptor where it
can, the bytes themselves where it cannot (shared/worker/kv_peer.py is the protocol around them).

    nats      every item in KvPeerReply messages (4 MiB each, a few in flight): any two hosts, ~100-300 MB/s
    shm       same host: prefill exports the prompt once into a region of its peer arena (a file in /dev/shm);
              the pull's reply is a KvPeerShm descriptor; decode maps the arena, takes a read lock on the region,
              checks each item's checksum and the engine imports straight from views of the map (one copy);
              the region is the prefill worker's again once decode's views are gone (its lock released)
    auto      what both sides can do, best first: cuda-ipc when both engines are on CUDA, shm when decode can
              map prefill's arena, else nats. Chosen per pull, never an error.
    cuda-ipc  the same as auto (cuda-ipc first, the host paths behind it): prefill exports the run into one
              device buffer first and shares it by CUDA IPC handle (shared/worker/kv_cuda_ipc.py); decode copies
              it device to device. The shm region (or the bytes) follows for the store and for a decode that
              cannot open the handle.
    An RDMA library (NIXL, Mooncake's transfer engine) is one more entry the same way: an exporter that fills a
    region and describes it, an importer that opens a descriptor.

The region's life, on the prefill side (`ShmExporter`):

    take_run + write lock -> export (engine thread) -> write lock off -> views in the Handover (NATS serves from
    them too) and in the store put -> the last view gone (done, lease, cancel; the store put over) -> `ended`
    -> free once no reader holds a read lock on it (a decode still importing keeps it; a dead one does not)

A region is written only under its write lock and read only under a read lock (shared/kv_arena.py range_lock),
so a reader that lost the race for a region lent again gets the lock only after the new bytes are in, and
their checksums are not the ones it was told: it goes to the store (or recomputes), never imports them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np

from shared.kv_arena import Arena, PeerMap, arena_path, remove_stale
from shared.schemas.kv_peer import KvPeerReply, KvPeerShm

if TYPE_CHECKING:
    from shared.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

MiB = 1 << 20
REGION_SLOT_BYTES = MiB  # the peer arena's unit: a region wastes less than one
BIG_CHECK_BYTES = 8 * MiB  # checksums over more than this run off the event loop
CHECK_THREADS = min(8, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="kv-checksum")
Buffer = Union[bytes, memoryview]


# --- by name --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerTransport:
    """One way the bytes can go. `exporter`: what holds prefill's hand-overs where decode can read them in
    place, made from (the worker's instance, bytes it may fill), None: the bytes go in the replies. `reads`: the
    `via` names decode offers in its pulls, best first."""

    exporter: Callable[[str, int], ShmExporter] | None
    reads: tuple[str, ...]
    device: bool = False  # prefill also hands over from a device buffer by CUDA IPC, where its engine is on a GPU


def _shm_exporter(instance: str, arena_bytes: int) -> ShmExporter:
    return ShmExporter.open(instance, arena_bytes)


PEER_TRANSPORTS: dict[str, PeerTransport] = {
    "nats": PeerTransport(None, ()),
    "shm": PeerTransport(_shm_exporter, ("shm",)),
    # an RDMA library is an entry of its own, its exporter registering the region with the library
    "auto": PeerTransport(_shm_exporter, ("cuda-ipc", "shm"), device=True),
    "cuda-ipc": PeerTransport(_shm_exporter, ("cuda-ipc", "shm"), device=True),
}


def peer_transport(name: str) -> PeerTransport:
    return PEER_TRANSPORTS[name]


# --- prefill: a hand-over's region --------------------------------------------------------------------------------


@dataclass
class Region:
    """A hand-over's items back to back in the arena: full blocks, the partial block, the state's parts."""

    offset: int
    lengths: list[int]
    items: list[memoryview]  # views of the region: while any lives, the region stays the hand-over's


class ShmExporter:
    """A prefill worker's peer arena: regions taken for hand-overs, freed when their views are gone and no
    reader holds them."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self._lock = threading.Lock()  # views die on any thread (the engine's, the loop's)
        self._ended: list[tuple[int, int]] = []  # (offset, nbytes) of regions nobody on this side uses any more
        self._held = 0  # regions taken and not yet free again
        self.counts: dict[str, int] = {"regions": 0, "no_room": 0, "reader_held": 0}

    @classmethod
    def open(cls, instance: str, arena_bytes: int) -> ShmExporter:
        name = f"{instance}-peer"
        remove_stale(name)
        slots = max(1, arena_bytes // REGION_SLOT_BYTES)
        return cls(Arena(arena_path(name), slots, REGION_SLOT_BYTES))

    async def export(self, engine: AsyncEngine, request_id: str, tokens: int, part_bytes: int) -> Region | None:
        """A held request's KV of its first `tokens` into a region: None when the arena has no room (the
        hand-over goes over NATS as bytes)."""
        layout = engine.layout
        runs = -(-tokens // layout.block_tokens)  # full blocks and the partial one, exported full-size each
        state = await engine.export_state(request_id)
        parts = [min(part_bytes, len(state) - at) for at in range(0, len(state), part_bytes)]
        lengths = [layout.block_bytes] * runs + parts
        taken = self.take(lengths)
        if taken is None:
            return None
        offset, out = taken
        blocks = out[: runs * layout.block_bytes]
        filling = asyncio.ensure_future(engine.export_into(request_id, 0, [(0, runs, blocks)]))
        try:
            await asyncio.shield(filling)
        except asyncio.CancelledError:
            # the export runs on the engine thread to its end whatever happens here: the region is free after it
            filling.add_done_callback(lambda _: self.drop(offset, len(out)))
            raise
        except BaseException:
            self.drop(offset, len(out))
            raise
        out[runs * layout.block_bytes :] = state
        return self.lend(offset, lengths)

    def take(self, lengths: list[int]) -> tuple[int, memoryview] | None:
        """A region for items of `lengths`, write-locked: (its offset, a writable view of it), or None when the
        arena has no room. Then `lend` (filled) or `drop` (not)."""
        nbytes = sum(lengths)
        offset = self._take(nbytes) if nbytes else None
        if offset is None:
            self.counts["no_room"] += 1
            return None
        return offset, self.arena.region(offset, nbytes)

    def lend(self, offset: int, lengths: list[int]) -> Region:
        """The filled region: unlocked for readers, its items as views (free again once they are all gone)."""
        nbytes = sum(lengths)
        self.arena.unlock_range(offset, nbytes)
        self.counts["regions"] += 1
        return Region(offset, lengths, self._lend(offset, nbytes, lengths))

    def drop(self, offset: int, nbytes: int) -> None:
        """A region taken and not lent (its export failed)."""
        self.arena.unlock_range(offset, nbytes)
        self._on_gone(offset, nbytes)

    def describe(self, region: Region, start: int) -> KvPeerShm:
        """Items [start, ...) of `region`, for a pull's reply."""
        at = region.offset + sum(region.lengths[:start])
        return KvPeerShm(str(self.arena.path), self.arena.token, at, region.lengths[start:])

    @property
    def free_bytes(self) -> int:
        self._reclaim()
        return self.arena.free_slots * self.arena.slot_bytes

    @property
    def held(self) -> int:
        """Regions not free: lent to hand-overs, or ended and still read by a decode worker."""
        self._reclaim()
        return self._held

    def close(self) -> None:
        self.arena.close()

    def _take(self, nbytes: int) -> int | None:
        self._reclaim()
        offset = self.arena.take_run(nbytes)
        if offset is None:
            return None
        self._held += 1
        if not self.arena.lock_range(offset, nbytes):  # a reader of its last hand-over locked it since: not free
            self._on_gone(offset, nbytes)
            return None
        return offset

    def _lend(self, offset: int, nbytes: int, lengths: list[int]) -> list[memoryview]:
        holder = np.frombuffer(self.arena.region(offset, nbytes), np.uint8)
        weakref.finalize(holder, self._on_gone, offset, nbytes)
        whole = memoryview(holder)  # its slices keep `holder` alive; they are the only references to it
        views, at = [], 0
        for n in lengths:
            views.append(whole[at : at + n])
            at += n
        return views

    def _on_gone(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._ended.append((offset, nbytes))

    def _reclaim(self) -> None:
        """Free every ended region no reader holds (a try of the write lock is the test: atomic, and the lock is
        dropped again at once); the others stay until their reader lets go or dies."""
        with self._lock:
            ended, self._ended = self._ended, []
        kept = []
        for offset, nbytes in ended:
            if self.arena.lock_range(offset, nbytes):
                self.arena.unlock_range(offset, nbytes)
                self.arena.give_run(offset, nbytes)
                self._held -= 1
            else:
                kept.append((offset, nbytes))
        self.counts["reader_held"] = len(kept)  # ended regions a decode worker still reads, now
        if kept:
            with self._lock:
                self._ended += kept


# --- decode: a hand-over read from the region -------------------------------------------------------------------


class ShmImporter:
    """A decode worker's maps of prefill workers' peer arenas, and the views it hands its engine."""

    def __init__(self) -> None:
        self._maps: dict[str, PeerMap] = {}

    def read(self, reply: KvPeerReply, released: Callable[[], None]) -> list[memoryview] | None:
        """Read-only views of the items `reply.shm` describes, under a read lock held until the last of them is
        gone (then `released()` runs, on whichever thread dropped it). None: not mappable here (another host, a
        dead or restarted prefill worker) or the region is being written: the caller pulls over NATS. The
        checksums are the caller's to check, before it uses a byte."""
        desc = reply.shm
        assert desc is not None
        nbytes = sum(desc.lengths)
        peer = self._map(desc.arena, desc.token)
        if peer is None or nbytes <= 0 or not peer.hold(desc.offset, nbytes):
            return None
        holder = np.frombuffer(peer.map, np.uint8, count=nbytes, offset=desc.offset)
        weakref.finalize(holder, _release, peer, desc.offset, nbytes, released)
        whole = memoryview(holder)
        views, at = [], 0
        for n in desc.lengths:
            views.append(whole[at : at + n])
            at += n
        return views

    def _map(self, path: str, token: bytes) -> PeerMap | None:
        known = self._maps.get(path)
        if known is not None and known.current(token):
            return known
        # a new arena (a prefill worker started or restarted): forget the maps of those gone, whose memory a
        # map would keep (their views, if any, keep them until they go)
        self._maps = {p: m for p, m in self._maps.items() if p != path and Path(p).exists()}
        fresh = PeerMap.open(path, token)
        if fresh is not None:
            self._maps[path] = fresh
        return fresh

    def __len__(self) -> int:
        return len(self._maps)


def _release(peer: PeerMap, offset: int, nbytes: int, released: Callable[[], None]) -> None:
    peer.release(offset, nbytes)
    released()


async def sums(items: Sequence[Buffer], check: Callable[[Buffer], int]) -> list[int]:
    """Each item's checksum; a big run off the event loop, in as many threads as the pool has (xxh3 and crc32
    let go of the GIL: a 512 MB run is a few tens of ms on 8 cores instead of a hundred on one)."""
    if sum(len(i) for i in items) <= BIG_CHECK_BYTES:
        return [check(i) for i in items]
    loop = asyncio.get_running_loop()
    per = -(-len(items) // CHECK_THREADS)
    groups = [items[at : at + per] for at in range(0, len(items), per)]
    done = await asyncio.gather(*(loop.run_in_executor(_POOL, lambda g=g: [check(i) for i in g]) for g in groups))
    return [s for group in done for s in group]


async def checked(items: Sequence[Buffer], want: Sequence[int], check: Callable[[Buffer], int]) -> bool:
    """Whether every item has its checksum."""
    return len(items) == len(want) and await sums(items, check) == list(want)
