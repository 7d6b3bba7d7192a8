"""The hand-over: decode pulls a request's prompt KV straight from the prefill worker that computed it, so decode
starts as soon as the bytes land instead of after a put into the kvcache service and a get back out of it.

    prefill: first token -> DecodeJob(peer_lease_s) submitted -> export the KV once -> Handover filled
             -> the same bytes put into the store (for later turns) -> wait until the hand-over ends
    decode:  kv.peer.<prefill worker> pulls, many items a message, a few in flight, each item checked
             -> what did not come (a dead peer, a corrupt item, an expired lease): the store, then recompute

A hand-over's items, in order: the prompt's full blocks 0..n-1, its partial last block (when the prompt does not
end on a block boundary), then the model's per-request state in parts of at most one message each. Every reply
carries a checksum of each item (checked at decode, with each block's length: xxh3 where installed, else crc32);
the pull names the block hashes it expects (checked at prefill), so a pull never gets another request's bytes.

A hand-over ends, and its bytes are dropped, at the first of: decode's `done` (sent however its pull ended),
the balancer's word that the decode worker given the job was lost (a Cancel for that worker, with the
request's "lost" event), its lease (`lease_s` after it opened: a decode worker that never comes), a cancel of
the request. Nothing
outlives the lease but a region of the peer arena a live decode worker still reads from (its read lock).

On one host the items lie in a region of prefill's peer arena and a pull is answered with where they lie
(shared/worker/kv_peer_transport.py): decode reads them from its map of the arena, its engine imports from
there, and `done` goes when the last view of the region is gone. A pull that cannot map the region pulls the
same items over NATS, served from the same region. Between two GPU workers of one host the items lie first in
a device buffer of prefill's (shared/worker/kv_cuda_ipc.py), exported before the host copy: a pull that offers
`cuda-ipc` is answered with its handle as soon as it is filled, and decode copies it device to device.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import zlib
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Union

import torch

from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.engine.kv_cache import DeviceBlob
from shared.schemas.kv_peer import KvPeerDone, KvPeerPull, KvPeerReply
from shared.worker.kv_cuda_ipc import CudaExporter, CudaImporter, DeviceRegion
from shared.worker.kv_peer_transport import Region, ShmExporter, ShmImporter, checked, sums

log = logging.getLogger(__name__)

LEASE_S = 15.0  # how long a prefill worker holds a hand-over for a decode worker that has not said done
FIRST_PULL_TIMEOUT_S = 10.0  # the first pull may wait for prefill's export of the whole prompt
PULL_TIMEOUT_S = 5.0  # each later pull: a peer silent this long is taken for dead (the store takes over)


def _xxh3() -> Callable[[bytes], int] | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64_intdigest


# Item checksums by name. crc32 is everywhere but runs at a few hundred MB/s in Python on a busy CPU, a real share
# of a hand-over; xxh3 runs at memory speed where the xxhash package is installed. A pull names the one its
# worker prefers; the peer answers in it if it has it, else in crc32.
CHECKSUMS: dict[str, Callable[[bytes], int]] = {"crc32": zlib.crc32}
if (_fast := _xxh3()) is not None:
    CHECKSUMS["xxh3"] = _fast
PREFERRED = "xxh3" if "xxh3" in CHECKSUMS else "crc32"


# a view: of prefill's peer arena (the region), or of decode's map of it; or a block in decode's GPU memory
Item = Union[bytes, memoryview, DeviceBlob]


def checksum(item: Item, kind: str = "crc32") -> int:
    return CHECKSUMS[kind](item)


# --- prefill side --------------------------------------------------------------------------------------------


@dataclass
class Handover:
    """One request's prompt KV, held for its decode worker."""

    keys: list[bytes]  # the prompt's full-block hashes: a pull must name the same
    migration: int = 0  # of the request (GenerateRequest.migration): each continuation hands over anew
    items: list[Item] = field(default_factory=list)
    blocks: int = 0
    tail: bool = False
    state_parts: int = 0
    region: Region | None = None  # the items lie in prefill's peer arena (views of it): pulls get a descriptor
    device: DeviceRegion | None = None  # ... and in a device buffer (CUDA IPC): pulls offering cuda-ipc get its handle
    sums: dict[str, list[int]] = field(default_factory=dict)  # the region's item checksums, by kind, once
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # items filled in
    first: asyncio.Event = field(default_factory=asyncio.Event)  # the device buffer or the items, whichever is first
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None


class Handovers:
    """A prefill worker's hand-overs in flight, by request id, each ended by done, its lease or a cancel."""

    def __init__(self, lease_s: float = LEASE_S, exporter: ShmExporter | None = None,
                 cuda: CudaExporter | None = None) -> None:
        self.lease_s = lease_s
        self.exporter = exporter  # the peer arena, where hand-overs are held on this host (None: bytes only)
        self.cuda = cuda  # device buffers for hand-overs by CUDA IPC (None: the engine is not on a GPU)
        self._open: dict[str, Handover] = {}
        self.counts: Counter[str] = Counter()  # blocks served, and how hand-overs ended, for health

    def __len__(self) -> int:
        return len(self._open)

    def open(self, request_id: str, keys: list[bytes], migration: int = 0) -> Handover:
        """Start holding `request_id`'s hand-over (filled later); its lease starts now."""
        self.end(request_id, "replaced")  # a redelivered prefill job: the newest wins
        handover = Handover(list(keys), migration)
        handover.timer = asyncio.get_running_loop().call_later(self.lease_s, self.end, request_id, "expired")
        self._open[request_id] = handover
        self.counts["opened"] += 1
        return handover

    def fill(self, request_id: str, blocks: list[bytes], tail: bytes, state: bytes, part_bytes: int) -> None:
        """The exported KV: full blocks, the partial last block (b"": none), the model state (b"": none)."""
        handover = self._open.get(request_id)
        if handover is None:
            return  # ended already (cancelled, expired during the export): drop the bytes
        assert part_bytes > 0
        parts = [state[at : at + part_bytes] for at in range(0, len(state), part_bytes)]
        handover.items = [*blocks, *([tail] if tail else []), *parts]
        handover.blocks, handover.tail, handover.state_parts = len(blocks), bool(tail), len(parts)
        handover.ready.set()
        handover.first.set()

    def fill_region(self, request_id: str, region: Region, blocks: int, tail: bool) -> bool:
        """The exported KV in a region of the peer arena (its items: `blocks` full blocks, the partial block if
        `tail`, then the state's parts). False: ended already (the region's views go with `region`)."""
        handover = self._open.get(request_id)
        if handover is None:
            return False
        handover.items, handover.region = list(region.items), region
        handover.blocks, handover.tail = blocks, tail
        handover.state_parts = len(region.items) - blocks - tail
        handover.ready.set()
        handover.first.set()
        return True

    def fill_device(self, request_id: str, region: DeviceRegion) -> bool:
        """The exported KV in a device buffer (before the host copy: pulls that offer cuda-ipc need not wait for
        it). False: ended already (the buffer goes with `region`)."""
        handover = self._open.get(request_id)
        if handover is None:
            return False
        handover.device = region
        handover.first.set()
        return True

    def end(self, request_id: str, why: str, upto: int | None = None) -> None:
        """Drop the hand-over (with `upto`: only if it is of that migration of the request or an earlier one)."""
        handover = self._open.get(request_id)
        if handover is None or (upto is not None and handover.migration > upto):
            return
        del self._open[request_id]
        if handover.timer is not None:
            handover.timer.cancel()
        handover.items, handover.region, handover.device = [], None, None  # the bytes go now, whoever holds it
        handover.ready.set()  # a pull waiting for the export answers "not found"
        handover.first.set()
        handover.ended.set()
        self.counts[f"ended_{why}"] += 1
        if why == "expired":
            log.warning("hand-over of %s (migration %d) ended unpulled at its %.0f s lease", request_id,
                        handover.migration, self.lease_s)

    async def serve(self, pull: KvPeerPull) -> KvPeerReply:
        """Items from `pull.start`, as many as fit `pull.max_bytes` (at least one), once the export is in."""
        handover = self._open.get(pull.request_id)
        if handover is None:
            return KvPeerReply(found=False)
        if list(pull.keys) != handover.keys[pull.start : pull.start + len(pull.keys)]:
            self.counts["refused"] += 1
            return KvPeerReply(found=False)
        kind = pull.checksum if pull.checksum in CHECKSUMS else "crc32"
        if "cuda-ipc" in pull.via and self.cuda is not None:
            await handover.first.wait()  # bounded: the lease ends it (end() sets it)
            device = handover.device
            if self._open.get(pull.request_id) is handover and device is not None:
                self.counts["blocks_served_cuda"] += max(0, device.blocks - pull.start)
                return KvPeerReply(True, [], [], device.blocks, device.tail, device.state_parts, kind,
                                   cuda=device.descriptor)
        if not handover.ready.is_set():
            await handover.ready.wait()  # bounded: the lease ends it (end() sets ready)
        if self._open.get(pull.request_id) is not handover or pull.start > len(handover.items):
            return KvPeerReply(found=False)
        if handover.region is not None and self.exporter is not None and "shm" in pull.via:
            return await self._describe(handover, pull.start, kind)
        items = pick(handover.items, pull.start, pull.max_bytes, pull.count)
        self.counts["blocks_served"] += max(0, min(pull.start + len(items), handover.blocks) - pull.start)
        return KvPeerReply(True, items, [checksum(i, kind) for i in items], handover.blocks, handover.tail,
                           handover.state_parts, kind)

    async def _describe(self, handover: Handover, start: int, kind: str) -> KvPeerReply:
        """Where items [start, ...) lie, with every item's checksum (taken once per kind, off the loop when big)."""
        assert handover.region is not None and self.exporter is not None
        region = handover.region
        if kind not in handover.sums:
            handover.sums[kind] = await sums(region.items, CHECKSUMS[kind])
        if handover.region is not region:
            return KvPeerReply(found=False)  # ended while its checksums were taken
        self.counts["blocks_served_shm"] += max(0, handover.blocks - start)
        return KvPeerReply(True, [], handover.sums[kind][start:], handover.blocks, handover.tail,
                           handover.state_parts, kind, self.exporter.describe(region, start))


def pick(items: Sequence[Item], start: int, max_bytes: int, count: int = 0) -> list[Item]:
    """items[start:], as many as fit max_bytes (the first always), at most `count` (0: no bound)."""
    out: list[Item] = []
    size = 0
    for item in items[start:]:
        if out and (size + len(item) > max_bytes or len(out) == count):
            break
        out.append(item)
        size += len(item)
    return out


# --- decode side ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pulled:
    """What a pull got: the leading run of full blocks from `start` (checked), and the snapshot at the prompt's
    end (partial block, model state) when every item arrived; None otherwise (the store's, or recompute).
    `held`: the blocks (and partial block) are views of prefill's peer arena, under a read lock: the engine
    imports from them, and the peer hears `done` once the last of them is gone."""

    blocks: list[Item]
    snapshot: tuple[Item, bytes] | None
    held: bool = False


class PeerPuller:
    """A decode worker's pulls from prefill workers, over its KV connection: at most `window` messages of
    `message_bytes` in flight in all. `via`: the transports it can read a hand-over through on this host
    (shared/worker/kv_peer_transport.py), best first; empty: the bytes always come in the replies."""

    def __init__(self, bus: Bus, block_bytes: int, *, message_bytes: int, window: int = 2,
                 first_timeout: float = FIRST_PULL_TIMEOUT_S, timeout: float = PULL_TIMEOUT_S,
                 via: Sequence[str] = (), device: str = "cpu") -> None:
        self._bus = bus
        self._block_bytes = block_bytes
        self._message_bytes = message_bytes
        self._window = max(1, window)
        # replies in flight over all this worker's pulls at once, not per pull: the server cuts a connection that
        # has 32 MiB pending as a slow consumer (issue 11), and a decode worker takes many jobs at once
        self._slots = asyncio.Semaphore(self._window)
        self._first_timeout = first_timeout
        self._timeout = timeout
        # cuda-ipc only where this worker's KV lies on a GPU (`device`): it copies into that GPU's memory
        self.via = [v for v in via if v != "cuda-ipc" or device.startswith("cuda")]
        self._importer = ShmImporter() if "shm" in self.via else None
        self._cuda = CudaImporter(torch.device(device)) if "cuda-ipc" in self.via else None
        # peer_blocks (peer_blocks_shm of them through shared memory, peer_blocks_cuda by CUDA IPC), peer_failed,
        # peer_corrupt, shm_refused / cuda_refused (a descriptor this worker could not open: pulled another way),
        # shm_released: for health
        self.counts: Counter[str] = Counter()

    async def pull(self, worker: str, request_id: str, keys: Sequence[bytes], start: int,
                   stop: Callable[[], bool] = lambda: False) -> Pulled:
        """Blocks keys[start:] and the snapshot from `worker`'s hand-over of `request_id`; `stop()` true (a
        cancel) ends it between messages. Always tells the peer it is over, so it lets go at once: now, or, for
        blocks read from its arena, once the engine has let go of them."""
        held = False
        try:
            pulled = await self._pull(worker, request_id, keys, start, stop)
            held = pulled.held
            return pulled
        finally:
            if not held:
                await self._done(worker, request_id)

    async def _done(self, worker: str, request_id: str) -> None:
        try:
            await self._bus.publish(subjects.kv_peer_done(worker), KvPeerDone(request_id))
        except Exception as exc:  # the lease ends it anyway
            log.debug("%s: peer done not sent: %s", request_id, exc)

    async def _pull(self, worker: str, request_id: str, keys: Sequence[bytes], start: int,
                    stop: Callable[[], bool]) -> Pulled:
        # one item first, outside the window: it waits for prefill's export, and says how much there is; where
        # this worker may read the peer's arena, the whole rest is asked for: a descriptor answers, or one item
        first = await self._ask(worker, request_id, keys, start, 0 if self.via else 1, self._first_timeout,
                                slot=False, via=self.via)
        if first is None:
            self.counts["peer_failed"] += 1
            return Pulled([], None)
        if first.cuda is not None:
            got = await self._read_cuda(first, start)
            if got is not None:
                return got
            via = [v for v in self.via if v != "cuda-ipc"]  # the same hand-over through the host: shm, or NATS
            first = await self._ask(worker, request_id, keys, start, 0 if via else 1, self._first_timeout,
                                    slot=False, via=via)
            if first is None:
                self.counts["peer_failed"] += 1
                return Pulled([], None)
        if first.shm is not None:
            read = await self._read_shm(worker, request_id, first, start)
            if read is not None:
                return read
            first = KvPeerReply(True, [], [], first.blocks, first.tail, first.state_parts, first.checksum)
        blocks = first.blocks
        total = blocks + first.tail + first.state_parts
        got = list(first.items)
        while start + len(got) < total and not stop():
            at = start + len(got)
            size = len(first.items[0]) if first.items else self._block_bytes
            per = max(1, self._message_bytes // max(1, size))
            asks = [(s, min(per, total - s)) for s in range(at, total, per)]
            short = False
            async for reply, (_, n) in self._ordered(worker, request_id, keys, asks):
                if reply is None or stop():  # gone, corrupt, or cancelled: what came so far is kept
                    short = True
                    break
                got += reply.items
                if len(reply.items) < n:
                    break  # bigger items than the first message's (state parts): ask again from here
            if short:
                break
        run = got[: blocks - start]
        self.counts["peer_blocks"] += len(run)
        if start + len(got) < total:
            self.counts["peer_failed"] += 1
            return Pulled(run, None)
        rest = got[blocks - start :]
        tail = rest[0] if first.tail else b""
        return Pulled(run, (tail, b"".join(rest[1 if first.tail else 0 :])))

    async def _read_shm(self, worker: str, request_id: str, reply: KvPeerReply, start: int) -> Pulled | None:
        """The hand-over read where the descriptor says, every item checked first; None: not readable here
        (pull over NATS); a failed pull (the store takes over) when an item is not what its checksum says."""
        assert reply.shm is not None and self._importer is not None
        lengths = reply.shm.lengths
        sized = max(0, reply.blocks + reply.tail - start)  # items [0, sized) are blocks, full-size each
        whole = reply.blocks + reply.tail + reply.state_parts - start
        if (len(lengths) != whole or len(reply.checksums) != len(lengths) or reply.checksum not in CHECKSUMS
                or any(n != self._block_bytes for n in lengths[:sized])):
            self.counts["peer_corrupt"] += 1
            return Pulled([], None)
        if not lengths:
            return Pulled([], (b"", b""))  # decode's own cache holds every block, and there is nothing else
        loop = asyncio.get_running_loop()
        views = self._importer.read(reply, lambda: self._released(loop, worker, request_id))
        if views is None:
            self.counts["shm_refused"] += 1
            log.info("%s: cannot read peer %s's arena here: over NATS", request_id, worker)
            return None
        if not await checked(views, reply.checksums, CHECKSUMS[reply.checksum]):
            log.warning("%s: a corrupt item in peer %s's arena: the store takes over", request_id, worker)
            self.counts["peer_corrupt"] += 1
            self.counts["peer_failed"] += 1
            return Pulled([], None)  # the views go with this frame: the lock, then `done`
        run = views[: max(0, reply.blocks - start)]
        rest = views[len(run) :]
        tail: Item = rest[0] if reply.tail else b""
        state = b"".join(rest[1 if reply.tail else 0 :])  # a copy: the engine takes the state as bytes
        self.counts["peer_blocks"] += len(run)
        self.counts["peer_blocks_shm"] += len(run)
        return Pulled(run, (tail, state), held=bool(run) or bool(reply.tail))

    async def _read_cuda(self, reply: KvPeerReply, start: int) -> Pulled | None:
        """The hand-over copied from the peer's GPU memory into this worker's: blocks [start, ...) as views of
        the copy, the state as bytes. None: the handle cannot be opened here (ask through the host); a failed
        pull (the store takes over) when the copy is not what prefill described."""
        assert reply.cuda is not None and self._cuda is not None
        desc = reply.cuda
        whole = reply.blocks + reply.tail + reply.state_parts
        if len(desc.lengths) != whole or any(n != self._block_bytes for n in desc.lengths[: reply.blocks + reply.tail]):
            self.counts["peer_corrupt"] += 1
            return Pulled([], None)
        own = await asyncio.to_thread(self._cuda.read, desc)
        if own is None:
            self.counts["cuda_refused"] += 1
            return None
        if not await asyncio.to_thread(self._cuda.intact, own, desc):
            log.warning("a hand-over copied from a peer GPU is not what it described: the store takes over")
            self.counts["peer_corrupt"] += 1
            self.counts["peer_failed"] += 1
            return Pulled([], None)
        offsets = [0, *itertools.accumulate(desc.lengths)]  # item i lies at [offsets[i], offsets[i + 1])
        run: list[Item] = [DeviceBlob(own, offsets[i], desc.lengths[i]) for i in range(start, reply.blocks)]
        tail: Item = DeviceBlob(own, offsets[reply.blocks], self._block_bytes) if reply.tail else b""
        state = b""
        if reply.state_parts:
            lo = offsets[reply.blocks + reply.tail]
            state = await asyncio.to_thread(lambda: own[lo : offsets[whole]].cpu().numpy().tobytes())
        self.counts["peer_blocks"] += len(run)
        self.counts["peer_blocks_cuda"] += len(run)
        return Pulled(run, (tail, state))

    def _released(self, loop: asyncio.AbstractEventLoop, worker: str, request_id: str) -> None:
        """The last view of a hand-over's region is gone (on any thread): tell the peer."""
        self.counts["shm_released"] += 1
        try:
            asyncio.run_coroutine_threadsafe(self._done(worker, request_id), loop)
        except RuntimeError:  # the loop is closed (shutting down): the lease ends it
            pass

    async def _ordered(self, worker: str, request_id: str, keys: Sequence[bytes], asks: list[tuple[int, int]]
                       ) -> AsyncIterator[tuple[KvPeerReply | None, tuple[int, int]]]:
        """The replies to `asks` ((start, count) pairs) in order, at most `window` in flight; leaving early
        cancels the rest."""
        flying: deque[tuple[tuple[int, int], asyncio.Future[KvPeerReply | None]]] = deque()
        try:
            for ask in asks:
                if len(flying) >= self._window:
                    done_ask, task = flying.popleft()
                    yield await task, done_ask
                s, n = ask
                flying.append((ask, asyncio.ensure_future(self._ask(worker, request_id, keys, s, n, self._timeout,
                                                                    slot=True))))
            while flying:
                done_ask, task = flying.popleft()
                yield await task, done_ask
        finally:
            for _, task in flying:
                task.cancel()

    async def _ask(self, worker: str, request_id: str, keys: Sequence[bytes], start: int, count: int,
                   timeout: float, *, slot: bool, via: Sequence[str] = ()) -> KvPeerReply | None:
        """One pull of `count` items (0: all that fit; with `slot`: inside the worker's window); None when the
        peer is gone, has no such hand-over, or sent an item that fails its check."""
        named = keys[start : start + count] if count else keys[start:]
        pull = KvPeerPull(request_id, start, list(named), self._message_bytes, count, PREFERRED, list(via))
        try:
            if slot:
                async with self._slots:
                    reply = await self._bus.request(subjects.kv_peer(worker), pull, KvPeerReply, timeout=timeout)
            else:
                reply = await self._bus.request(subjects.kv_peer(worker), pull, KvPeerReply, timeout=timeout)
        except BusTimeout as exc:
            log.info("%s: peer %s did not answer (%s): the store takes over", request_id, worker, exc)
            return None
        if not reply.found:
            return None
        if not self.intact(reply, start):
            log.warning("%s: a corrupt item from peer %s: the store takes over", request_id, worker)
            self.counts["peer_corrupt"] += 1
            return None
        return reply

    def intact(self, reply: KvPeerReply, start: int) -> bool:
        """Every item has its checksum, blocks (and the partial block) their size, and the reply is not empty
        but at the end."""
        if reply.shm is not None or reply.cuda is not None:  # a descriptor: checked where the items lie (_read_*)
            return True
        if len(reply.items) != len(reply.checksums) or reply.checksum not in CHECKSUMS:
            return False
        if not reply.items:  # whole only where nothing is left (decode's own cache holds every block)
            return start >= reply.blocks + reply.tail + reply.state_parts
        sized = reply.blocks + reply.tail  # items [0, sized) are blocks, full-size each
        for i, (item, crc) in enumerate(zip(reply.items, reply.checksums), start):
            if checksum(item, reply.checksum) != crc or (i < sized and len(item) != self._block_bytes):
                return False
        return True
