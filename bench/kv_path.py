"""The KV data plane, prefill -> kvcache -> decode, against the host's own ceilings measured in the same run.

    .venv/bin/python bench/kv_path.py [--llama-tokens 8192] [--v4-tokens 77824] [--llama8b-tokens 0]
                                      [--transport nats|shm] [--ram-heap auto|off] [--skip-peer]
                                      [--io run|blocks] [--arena-mib N] [--device cpu|cuda] [--out FILE]

Real parts: a private nats-server (the launcher's config: 8 MiB payloads, 32 MiB pending per connection), the
kvcache service as its own process (`python -m services.kvcache`, RAM + SSD tiers under a temp dir), the
workers' KvClient on its own connection, and the engines' own caches for export / import (on CPU tensors, or
on the GPU with --device cuda):

    llama   SmolLM2-135M's layout: 30 layers x 2 x 16 tokens x 3 KV heads x 64, float32 (737,280 bytes a block)
    llama8b Llama-3-8B's: 32 layers x 2 x 16 tokens x 8 KV heads x 128, bfloat16 (2 MiB a block; --llama8b-tokens)
    v4      V4-Flash widths at full depth: 43 layers (2 HCA, then CSA / HCA interleaved), 128-token blocks,
            bfloat16 compressed entries + indexer keys (842,752 bytes a block)

Per layout (export / import: the engine's share of (a) / (b)), with --io run (the workers' path: one copy each way):
    (a) export + put     KvClient.put_run: the cache exports the run straight into arena slots (export_run), or
                         into one buffer per window over NATS (every block long-term)
    (b) get + import     KvClient.get_run of the run (served from the store's RAM tier), then write_blocks, which
                         imports from the arena's views where they lie (import_run)
and with --io blocks (before the one-copy path): read_blocks (a bytes per block), put_many, get_run, write_blocks.
    (b) store            the part of (b) that is not the import: lookup + get, what the store path adds to a
                         cached turn's first token over the worker-local path. With --transport shm and the store's
                         --ram-heap auto (the default) RAM hits are read by descriptor from the store's shared
                         heap (shared/kv_heap.py: no copy by the store, the import reads the heap); with
                         --ram-heap off the store copies them into the worker's arena (`via heap` counts blocks)
    (c) hand-over        (a) then a lookup and (b): what lies between prefill's first token and decode's first
                         step on the store path (routing and the engine's own step excluded)
    (c) peer             the same on the peer path (shared/worker/kv_peer.py, the default --kv-handover): a prefill
                         process (this file, --peer-child) exports the run with read_blocks into its hand-over
                         when told (the job leaving), while decode pulls it over kv.peer.<worker> (4 MiB
                         messages, 2 in flight, xxh3 checked), then write_blocks: export + one NATS crossing +
                         import, no store
    (c) peer shm         the same hand-over on one host (--kv-peer-transport shm/auto, kv_peer_transport.py):
                         the child exports the run once into a region of its peer arena (export_run), the pull's
                         reply is a descriptor, decode maps the arena, checks every block's xxh3 there and
                         imports from views of the map (write_blocks -> import_run: one copy); the region is the
                         child's again once decode's views are gone
    (c) peer cuda        (--device cuda) the same hand-over between two GPU processes by CUDA IPC
                         (kv_cuda_ipc.py): the child exports the run into one device buffer (export_run on the
                         device), the reply carries its handle, decode copies it device to device, checks its
                         digest and imports from the copy (write_blocks -> import_run: one device copy)
    1 block latency      (a) and (b) for one block, median of --repeat

Ceilings, same bytes, same run:
    memcpy       one host-memory copy of the run's bytes (numpy copyto into a preallocated buffer)
    disk write   the run's bytes written to one file in 8 MiB writes, fsync'ed
    disk read    read back in 8 MiB reads after dropping its pages from the page cache (posix_fadvise)
    nats         the transport alone: the run's bytes as 4 MiB request/replies (one at a time, a 2-byte answer)
                 between two plain nats.py connections on the same server: what Python and NATS carry at best
    h2d / d2h    (--device cuda) the run's bytes host -> device and device -> host in one copy each, from and to
                 pinned host memory, and into pageable memory (what a copy into an unregistered arena gets)

The store path's health in the same run: puts that failed, blocks decode would not get back, and slow-consumer
disconnects in the nats-server log.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import nats
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import subjects
from shared.launch import natsserver  # noqa: E402
from shared.bus import Bus, BusTimeout  # noqa: E402
from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec, export_staged  # noqa: E402
from shared.engine.models.deepseek_v4.cache import V4Cache  # noqa: E402
from shared.engine.models.deepseek_v4.spec import CSA, HCA, DeepseekV4Spec  # noqa: E402
from shared.worker.kv_peer import Handovers, PeerPuller  # noqa: E402
from shared.worker.kv_cuda_ipc import CudaExporter, DeviceRegion, pin_heap, pin_host  # noqa: E402
from shared.worker.kv_peer_transport import ShmExporter  # noqa: E402
from shared.worker.kvclient import KvClient  # noqa: E402
from shared.schemas.health import HealthReply, HealthRequest  # noqa: E402
from shared.schemas.kv_peer import KvPeerDone, KvPeerPull  # noqa: E402
from shared.service import health_subject  # noqa: E402

MiB = 1 << 20
CHUNK = 8 * MiB
INSTANCE = "kvcache-bench"


class Cache(Protocol):
    """What the bench needs of an engine's cache: blocks out as blobs or into a buffer, and back in."""

    block_bytes: int

    def read_blocks(self, blocks: list[int]) -> list[bytes]: ...

    def write_blocks(self, blocks: list[int], blobs: list) -> None: ...

    def export_run(self, blocks: list[int], out: memoryview) -> None: ...


def llama_cache(blocks: int, device: torch.device) -> KVCache:
    spec = CacheSpec(PagedSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_tokens=16, dtype=torch.float32), 0)
    cache = KVCache(spec, blocks, device)
    cache.kv.uniform_()  # real numbers, not pages of zeros the kernel may share
    return cache


def llama8b_cache(blocks: int, device: torch.device) -> KVCache:
    spec = CacheSpec(PagedSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype=torch.bfloat16), 0)
    cache = KVCache(spec, blocks, device)
    cache.kv.uniform_()
    return cache


def tensors(cache: Cache) -> list[torch.Tensor]:
    if isinstance(cache, KVCache):
        return [cache.kv]
    return [t[: cache.num_blocks] for t in cache._paged]  # noqa: SLF001  (past them: the scratch block)


def v4_spec() -> DeepseekV4Spec:
    n = 43
    kinds = (HCA, HCA, *(CSA if i % 2 else HCA for i in range(n - 2)))
    return DeepseekV4Spec(
        vocab_size=1024, hidden_size=4096, num_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1024,
        o_groups=8, o_lora_rank=1024, window=128, index_heads=64, index_head_dim=128, index_topk=512,
        num_experts=256, experts_per_token=6, num_shared_experts=1, moe_intermediate=2048,
        num_layers=n, kinds=kinds, ratios=tuple(4 if k == CSA else 128 for k in kinds), hash_layers=0,
        scoring="sqrtsoftplus", norm_topk_prob=True, routed_scale=1.5, swiglu_limit=10.0, hc_mult=4, hc_iters=20,
        hc_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, compress_rope_scaling=None, rms_eps=1e-6,
        max_position=1 << 20, num_mtp_layers=0, mtp_kinds=(), mtp_ratios=())


def v4_cache(blocks: int, device: torch.device) -> V4Cache:
    cache = V4Cache(v4_spec(), blocks, device, torch.bfloat16)
    for t in cache._paged:  # noqa: SLF001 - fill every long-term tensor
        t.uniform_()
    return cache


LAYOUTS: dict[str, tuple[int, Callable[[int, torch.device], Cache]]] = {
    "llama": (16, llama_cache), "v4": (128, v4_cache), "llama8b": (16, llama8b_cache)}


@dataclass
class Row:
    layout: str
    tokens: int
    blocks: int
    nbytes: int
    memcpy_s: float
    disk_write_s: float
    disk_read_s: float
    nats_s: float
    export_s: float  # read_blocks alone, inside (a)
    import_s: float  # write_blocks alone, inside (b)
    via_heap: int  # of the run's blocks, those (b) read by descriptor from the store's heap
    put_s: float  # (a)
    get_s: float  # (b)
    handover_s: float  # (c)
    peer_s: float  # (c) on the peer path
    peer_shm_s: float  # (c) on the peer path through shared memory
    one_put_s: float
    one_get_s: float
    failed_puts: int
    missing_gets: int
    h2d_s: float = 0.0  # pinned, one copy (0: not measured, CPU)
    d2h_s: float = 0.0
    d2h_pageable_s: float = 0.0
    peer_cuda_s: float = 0.0  # (c) on the peer path by CUDA IPC (0: not measured, CPU)
    d2d_s: float = 0.0  # one device-to-device copy of the run (the GPU's ceiling for the CUDA IPC hand-over)


# --- ceilings ------------------------------------------------------------------------------------------------------


def memcpy_s(nbytes: int, repeat: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return best


def device_copy_s(nbytes: int, device: torch.device, repeat: int) -> tuple[float, float, float]:
    """(host -> device pinned, device -> host pinned, device -> host pageable) of `nbytes`, best of `repeat`."""
    if device.type != "cuda":
        return 0.0, 0.0, 0.0
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = [float("inf")] * 3
    for _ in range(repeat):
        for i, (dst, src) in enumerate(((dev, pinned), (pinned, dev), (pageable, dev))):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - started)
    return best[0], best[1], best[2]


def d2d_s(nbytes: int, device: torch.device, repeat: int) -> float:
    """One device-to-device copy of `nbytes` on `device`, best of `repeat`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def disk_s(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write + fsync, cold read) of `nbytes` in 8 MiB pieces."""
    path = directory / "raw.bin"
    piece = os.urandom(CHUNK)
    os.sync()
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for at in range(0, nbytes, CHUNK):
            f.write(piece[: min(CHUNK, nbytes - at)])
        os.fsync(f.fileno())
    write = time.perf_counter() - started
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        while os.read(fd, CHUNK):
            pass
        read = time.perf_counter() - started
    finally:
        os.close(fd)
    path.unlink()
    return write, read


async def nats_s(url: str, nbytes: int) -> float:
    """The run's bytes through NATS as 4 MiB requests, serially (a transport ceiling: no codec, no store)."""
    piece = os.urandom(4 * MiB)
    sender, receiver = await nats.connect(url), await nats.connect(url)
    try:
        async def echo(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"ok")

        await receiver.subscribe("bench.ceiling", cb=echo)
        await receiver.flush()
        started = time.perf_counter()
        for at in range(0, nbytes, len(piece)):
            await sender.request("bench.ceiling", piece[: min(len(piece), nbytes - at)], timeout=30)
        return time.perf_counter() - started
    finally:
        await sender.close()
        await receiver.close()


# --- the store path ------------------------------------------------------------------------------------------------


async def store_path(kv: KvClient, url: str, layout: str, tokens: int, repeat: int, directory: Path, io: str,
                     device: torch.device, peers: bool = True) -> Row:
    block_tokens, make = LAYOUTS[layout]
    n = tokens // block_tokens
    src, dst = make(n, device), make(n, device)
    blocks = list(range(n))
    keys = [os.urandom(16) for _ in blocks]  # fresh keys: every put is new to the store
    nbytes = n * src.block_bytes
    exporting = [0.0]

    async def export(parts: list[tuple[int, int, memoryview]]) -> None:  # what the worker runs on the engine thread
        started = time.perf_counter()  # as Engine.export_parts: staged through device buffers on a GPU
        export_staged(src.export_run, [(blocks[lo:hi], out) for lo, hi, out in parts], src.block_bytes, device)
        exporting[0] += time.perf_counter() - started

    sync(device)
    started = time.perf_counter()
    if io == "run":
        stored = await kv.put_run(keys, export, src.block_bytes)
        export_s = exporting[0]
    else:
        blobs = src.read_blocks(blocks)
        export_s = time.perf_counter() - started
        stored = await kv.put_many(list(zip(keys, blobs)))
        del blobs
    put_s = time.perf_counter() - started
    failed = 0 if stored else await count_missing(kv, keys)

    # a worker's first get maps (on a GPU also page-locks) the store's heap: once in its life, not per turn
    started = time.perf_counter()
    first = await kv.get_run(keys[:1])
    del first  # its views go: the lease is released
    print(f"  first get (maps the store's heap once): {(time.perf_counter() - started) * 1e3:.1f} ms", file=sys.stderr)
    started = time.perf_counter()
    via_heap = kv.counts["blocks_via_heap"]
    await kv.lookup_run(keys)
    got = await kv.get_run(keys)
    via_heap = kv.counts["blocks_via_heap"] - via_heap
    imported = time.perf_counter()
    dst.write_blocks(blocks[: len(got)], got)
    sync(device)
    import_s = time.perf_counter() - imported
    get_s = time.perf_counter() - started
    got_back = len(got)
    del got  # views of the arena (their slots go back) or of the store's heap (its lease is released)
    if got_back == n:
        assert all(torch.equal(a, b) for a, b in zip(tensors(src), tensors(dst))), "a block came back different"

    one_put, one_get = [], []
    for _ in range(repeat):
        key = os.urandom(16)
        started = time.perf_counter()
        if io == "run":
            ok = await kv.put_run([key], export, src.block_bytes)
        else:
            ok = await kv.put_many([(key, src.read_blocks([0])[0])])
        one_put.append(time.perf_counter() - started)
        started = time.perf_counter()
        one = await kv.get_run([key])
        if ok and one:
            dst.write_blocks([0], one)
            sync(device)
        del one
        one_get.append(time.perf_counter() - started)
    del src, dst
    mem = memcpy_s(nbytes, repeat)
    h2d, d2h, d2h_pageable = device_copy_s(nbytes, device, repeat)
    write, read = disk_s(directory, nbytes)
    wire = await nats_s(url, nbytes)
    peer = await peer_path(url, layout, n, make, device, "nats") if peers else 0.0
    peer_shm = await peer_path(url, layout, n, make, device, "shm") if peers else 0.0
    on_gpu = device.type == "cuda"
    peer_cuda = await peer_path(url, layout, n, make, device, "cuda-ipc") if on_gpu and peers else 0.0
    d2d = d2d_s(nbytes, device, repeat) if on_gpu else 0.0
    return Row(layout, tokens, n, nbytes, mem, write, read, wire, export_s, import_s, via_heap, put_s, get_s,
               put_s + get_s,
               peer, peer_shm, statistics.median(one_put), statistics.median(one_get), failed, n - got_back, h2d, d2h,
               d2h_pageable, peer_cuda, d2d)


# --- the peer path (the hand-over straight from prefill to decode) -------------------------------------------------

PEER = "bench-prefill"
PEER_OPEN = "bench.peer.open"  # raw NATS: "hand over request <rid>" (in the mesh: the DecodeJob leaving prefill)


def peer_keys(rid: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{rid}:{i}".encode(), digest_size=16).digest() for i in range(n)]


async def peer_path(url: str, layout: str, n: int, make: Callable[[int, torch.device], Cache],
                    device: torch.device, transport: str) -> float:
    """Seconds from "hand over" to the run imported at decode, the prefill side in its own process, the bytes
    over `transport` (nats: in the replies; shm: through the child's peer arena, a descriptor in the reply)."""
    child = subprocess.Popen([sys.executable, __file__, "--peer-child", url, layout, str(n), str(device), transport],
                             stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    assert child.stdout is not None
    if child.stdout.readline().strip() != b"ready":
        raise RuntimeError("the peer child did not come up")
    dst = make(n, device)
    bus = await Bus.connect(url, "bench-decode")
    raw = await nats.connect(url)
    try:
        # long timeouts: a throughput measure on a loaded machine, not the fault behaviour (tests/ has that)
        puller = PeerPuller(bus, dst.block_bytes, message_bytes=min(4 * MiB, bus.max_payload - 64 * 1024),
                            via=[] if transport == "nats" else [transport], first_timeout=120.0, timeout=60.0,
                            device=str(device))
        best = float("inf")
        for attempt in range(3):
            rid = f"bench-{transport}-{attempt}"
            keys = peer_keys(rid, n)
            sync(device)
            started = time.perf_counter()
            await raw.request(PEER_OPEN, rid.encode(), timeout=30)
            pulled = await puller.pull(PEER, rid, keys, 0)
            got = len(pulled.blocks)
            dst.write_blocks(list(range(got)), pulled.blocks)
            sync(device)
            best = min(best, time.perf_counter() - started)
            del pulled  # views of the child's arena: its region comes back, `done` goes
            assert got == n, f"the peer gave {got} of {n} blocks"
            if transport == "shm":
                assert puller.counts["peer_blocks_shm"] == (attempt + 1) * n, "not through shared memory"
            if transport == "cuda-ipc":
                assert puller.counts["peer_blocks_cuda"] == (attempt + 1) * n, "not by CUDA IPC"
            await asyncio.sleep(0.5)  # untimed: the done reaches the child, its region is free for the next
        return best
    finally:
        await raw.close()
        await bus.drain()
        child.terminate()
        child.wait(30)


async def peer_child(url: str, layout: str, n: int, device: str, transport: str) -> None:
    """The prefill side: a cache of `n` blocks, exported into a hand-over each time it is told to (shm: into a
    region of a peer arena the size of the run, with export_run, as the worker's ShmExporter.export does)."""
    src = LAYOUTS[layout][1](n, torch.device(device))
    exporter = ShmExporter.open(f"{PEER}-{os.getpid()}", n * src.block_bytes + MiB) if transport == "shm" else None
    handovers = Handovers(exporter=exporter, cuda=CudaExporter() if transport == "cuda-ipc" else None)
    bus = await Bus.connect(url, PEER)
    raw = await nats.connect(url)

    def export_into(out: memoryview) -> None:
        src.export_run(list(range(n)), out)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    async def on_open(msg: nats.aio.msg.Msg) -> None:
        rid = msg.data.decode()
        handovers.open(rid, peer_keys(rid, n))
        await msg.respond(b"ok")  # the job has left: decode may pull now, and waits for the export
        if transport == "cuda-ipc":  # as CudaExporter.export does through the engine: one gather on the device
            buf = torch.empty(n * src.block_bytes, dtype=torch.uint8, device=device)
            src.export_run(list(range(n)), buf)
            handovers.fill_device(rid, DeviceRegion.of(buf, [src.block_bytes] * n, n, False))
            return
        if exporter is not None:
            lengths = [src.block_bytes] * n
            taken = exporter.take(lengths)
            assert taken is not None, "the peer arena has no room"
            await asyncio.to_thread(export_into, taken[1])  # prefill's engine thread
            handovers.fill_region(rid, exporter.lend(taken[0], lengths), n, False)
            return
        blobs = await asyncio.to_thread(src.read_blocks, list(range(n)))
        handovers.fill(rid, blobs, b"", b"", bus.max_payload - 64 * 1024)

    async def on_done(done: KvPeerDone, _: object) -> None:
        handovers.end(done.request_id, "done")

    await bus.serve(subjects.kv_peer(PEER), KvPeerPull, handovers.serve)
    await bus.subscribe(subjects.kv_peer_done(PEER), KvPeerDone, on_done)
    await raw.subscribe(PEER_OPEN, cb=on_open)
    await raw.flush()
    await bus._nc.flush()  # noqa: SLF001 - subscribed at the server before the parent is told "ready"
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()  # until terminated
    finally:
        if exporter is not None:
            exporter.close()


async def count_missing(kv: KvClient, keys: list[bytes]) -> int:
    """Blocks of `keys` the store does not hold (asked a few at a time: the store may be recovering)."""
    missing = 0
    for at in range(0, len(keys), 8):
        for blob in await kv.get_many(keys[at : at + 8]):
            missing += blob is None
    return missing


# --- the run -------------------------------------------------------------------------------------------------------


async def wait_ready(bus: Bus, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = await bus.request(health_subject("kvcache", INSTANCE), HealthRequest(), HealthReply, timeout=1.0)
            if reply.ready:
                return
        except BusTimeout:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("the kvcache service did not come up")


async def run(args: argparse.Namespace, work: Path) -> tuple[list[Row], int]:
    server = natsserver.start(work / "nats", log_file=work / "nats.log")
    kvcache = subprocess.Popen(
        [sys.executable, "-m", "services.kvcache", "--nats-url", server.url, "--state-dir", str(work),
         "--instance", INSTANCE, "--ram-bytes", str(args.ram_mib * MiB), "--ssd-bytes", str(4 * args.ram_mib * MiB),
         "--ram-heap", args.ram_heap],
        stdout=open(work / "kvcache.log", "wb"), stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[1],
    )
    bus = await Bus.connect(server.url, "bench")
    try:
        await wait_ready(bus)
        sizes = {k: int(v * MiB) for k, v in (("message_bytes", args.message_mib), ("window_bytes", args.window_mib))
                 if v is not None}  # only when asked: the client before batching took neither
        if args.transport != "nats":
            from shared.worker.kvclient import open_client

            arena = {"arena_bytes": args.arena_mib * MiB} if args.arena_mib else {}
            kv = open_client(bus, args.transport, "bench", **sizes, **arena)
        else:
            kv = KvClient(bus, **sizes)
        device = torch.device(args.device)
        if kv.arena is not None and args.pin_arena and device.type == "cuda":
            print(f"  cudaHostRegister of the arena: {pin_host(kv.arena)}", file=sys.stderr, flush=True)
            kv.on_heap = lambda heap: print(f"  cudaHostRegister of the store's heap (read-only): {pin_heap(heap)}",
                                            file=sys.stderr, flush=True)  # as a GPU worker does
        rows = []
        for layout, tokens in (("llama", args.llama_tokens), ("v4", args.v4_tokens),
                               ("llama8b", args.llama8b_tokens)):
            if tokens:
                rows.append(await store_path(kv, server.url, layout, tokens, args.repeat, work, args.io, device,
                                             not args.skip_peer))
                print(f"  {layout} {tokens} tokens done", file=sys.stderr, flush=True)
        if getattr(kv, "arena", None) is not None:
            kv.arena.close()
    finally:
        await bus.drain()
        kvcache.terminate()
        kvcache.wait(30)
        server.stop()
    slow = (work / "nats.log").read_text(errors="replace").count("Slow Consumer")
    return rows, slow


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:,.0f} MB/s" if seconds > 0 else "-"


def table(rows: list[Row], slow: int) -> str:
    gpu = any(r.h2d_s for r in rows)
    extra = "h2d pinned | d2h pinned | d2h pageable | d2d | " if gpu else ""
    cuda_head = "| (c) peer cuda | peer cuda / d2d | peer shm / peer cuda " if gpu else ""
    lines = [
        f"| layout | tokens | blocks | MB | memcpy | {extra}disk write | disk read | nats | export | import "
        "| (a) export+put | (b) get+import | (b) store | via heap "
        "| (c) hand-over | (c) / memcpy | (c) / nats | (c) peer | peer / memcpy | store / peer "
        "| (c) peer shm | peer shm / memcpy | peer / peer shm "
        f"{cuda_head}"
        "| 1 block put | 1 block get | failed puts | blocks not got back |",
        "|---" * (27 + 7 * gpu) + "|",
    ]
    for r in rows:
        copies = (f"{rate(r.nbytes, r.h2d_s)} | {rate(r.nbytes, r.d2h_s)} | {rate(r.nbytes, r.d2h_pageable_s)} | "
                  f"{rate(r.nbytes, r.d2d_s)} | " if gpu else "")
        cuda = (f"| {r.peer_cuda_s * 1e3:,.1f} ms ({rate(r.nbytes, r.peer_cuda_s)}) "
                f"| {r.peer_cuda_s / r.d2d_s:,.0f}x | {r.peer_shm_s / r.peer_cuda_s:,.1f}x "
                if gpu and r.peer_cuda_s and r.d2d_s else ("| - | - | - " if gpu else ""))
        lines.append(
            f"| {r.layout} | {r.tokens} | {r.blocks} | {r.nbytes / 1e6:,.0f} | {rate(r.nbytes, r.memcpy_s)} | {copies}"
            f"{rate(r.nbytes, r.disk_write_s)} | {rate(r.nbytes, r.disk_read_s)} | {rate(r.nbytes, r.nats_s)} "
            f"| {rate(r.nbytes, r.export_s)} | {rate(r.nbytes, r.import_s)} "
            f"| {r.put_s * 1e3:,.0f} ms ({rate(r.nbytes, r.put_s)}) "
            f"| {r.get_s * 1e3:,.0f} ms ({rate(r.nbytes, r.get_s)}) "
            f"| {(r.get_s - r.import_s) * 1e3:,.1f} ms | {r.via_heap} "
            f"| {r.handover_s * 1e3:,.0f} ms ({rate(r.nbytes, r.handover_s)}) | {r.handover_s / r.memcpy_s:,.0f}x "
            f"| {r.handover_s / r.nats_s:,.1f}x "
            f"{peer_cells(r)}"
            f"{cuda}"
            f"| {r.one_put_s * 1e3:.1f} ms | {r.one_get_s * 1e3:.1f} ms | {r.failed_puts} | {r.missing_gets} |"
        )
    lines.append(f"\nSlow-consumer disconnects in the nats-server log: {slow}")
    return "\n".join(lines)


def peer_cells(r: Row) -> str:
    if not r.peer_s or not r.peer_shm_s:
        return "| - | - | - | - | - | - "  # --skip-peer
    return (f"| {r.peer_s * 1e3:,.0f} ms ({rate(r.nbytes, r.peer_s)}) | {r.peer_s / r.memcpy_s:,.0f}x "
            f"| {r.handover_s / r.peer_s:,.1f}x "
            f"| {r.peer_shm_s * 1e3:,.1f} ms ({rate(r.nbytes, r.peer_shm_s)}) | {r.peer_shm_s / r.memcpy_s:,.1f}x "
            f"| {r.peer_s / r.peer_shm_s:,.1f}x ")


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def gpu_name(device: str) -> str:
    return f", {torch.cuda.get_device_name()}" if device.startswith("cuda") and torch.cuda.is_available() else ""


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--peer-child":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # its arena removed on the way out
        asyncio.run(peer_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-tokens", type=int, default=8192, help="prompt length, Llama layout (0: skip)")
    parser.add_argument("--v4-tokens", type=int, default=77824, help="prompt length, V4 layout (0: skip)")
    parser.add_argument("--llama8b-tokens", type=int, default=0, help="prompt length, Llama-3-8B layout (0: skip)")
    parser.add_argument("--repeat", type=int, default=5, help="one-block latencies: median of this many")
    parser.add_argument("--message-mib", type=float, default=None, help="KvClient: blobs per batch message, MiB")
    parser.add_argument("--window-mib", type=float, default=None, help="KvClient: batches in flight, MiB")
    parser.add_argument("--transport", default="nats", help="KV bytes over nats, or shm (shared memory)")
    parser.add_argument("--io", choices=("run", "blocks"), default="run",
                        help="run: put_run / views (one copy each way); blocks: read_blocks / put_many (before)")
    parser.add_argument("--arena-mib", type=int, default=0, help="shm: the worker's arena, MiB (0: the default)")
    parser.add_argument("--device", default="cpu", help="the caches' device: cpu, or cuda (adds h2d / d2h ceilings)")
    parser.add_argument("--pin-arena", action="store_true",
                        help="cuda: page-lock the arena (and the map of the store's heap), as a GPU worker does")
    parser.add_argument("--ram-mib", type=int, default=1536, help="the store's RAM tier, MiB")
    parser.add_argument("--ram-heap", choices=("auto", "off"), default="auto",
                        help="the store's RAM tier in a shared heap read by descriptor (auto), or private (off)")
    parser.add_argument("--skip-peer", action="store_true", help="leave out the peer hand-over rows (c) peer")
    parser.add_argument("--dir", type=Path, default=None, help="where the store and the disk probe write")
    parser.add_argument("--label", default="", help="a name for this run in the output (before / after)")
    parser.add_argument("--out", type=Path, default=None, help="append the table to this markdown file")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kv-path-", dir=args.dir))
    try:
        rows, slow = asyncio.run(run(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    flags = f"--transport {args.transport} --ram-heap {args.ram_heap} --io {args.io} --device {args.device}" + (
        f" --arena-mib {args.arena_mib}" if args.arena_mib else "") + (" --pin-arena" if args.pin_arena else "") + (
        " --skip-peer" if args.skip_peer else "")
    text = (f"## {args.label or 'kv path'} ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)\n\n"
            f"{hardware()}{gpu_name(args.device)}; `{flags}`\n\n{table(rows, slow)}\n")
    print(text)
    if args.out is not None:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
