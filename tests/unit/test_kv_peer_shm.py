"""The same-host hand-over's pieces without a broker (shared/worker/kv_peer_transport.py): regions of a peer
arena, the byte-range locks between a prefill and a decode process, descriptors, what decode refuses to read,
and when a region is free again (after decode's views are gone; never while a live reader holds it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.kv_arena import Arena, PeerMap, arena_path
from shared.schemas.kv_peer import KvPeerPull, KvPeerReply, KvPeerShm
from shared.worker.kv_peer import PREFERRED, Handovers, PeerPuller, checksum
from shared.worker.kv_peer_transport import REGION_SLOT_BYTES, ShmExporter, ShmImporter

BLOCK = 64 * 1024
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exporter() -> ShmExporter:
    made = ShmExporter(Arena(arena_path(f"test-peer-{os.getpid()}"), 8, REGION_SLOT_BYTES))
    yield made
    made.close()


def region_of(exporter: ShmExporter, items: list[bytes]):
    taken = exporter.take([len(i) for i in items])
    assert taken is not None
    offset, out = taken
    out[:] = b"".join(items)
    return exporter.lend(offset, [len(i) for i in items])


def test_take_run_finds_slots_back_to_back() -> None:
    arena = Arena(arena_path(f"test-run-{os.getpid()}"), 6, 100)
    try:
        first = arena.take_run(250)  # 3 slots
        assert first is not None and arena.free_slots == 3
        assert arena.take_run(301) is None  # 4 slots: not there
        second = arena.take_run(100)
        assert second is not None and second >= first + 300
        arena.give_run(first, 250)
        assert arena.free_slots == 5 and arena.take_run(500) is None  # free, but not 5 in a row
        assert arena.take_run(300) == first
    finally:
        arena.close()


HOLDER = """
import sys
from shared.kv_arena import PeerMap
peer = PeerMap.open(sys.argv[1], bytes.fromhex(sys.argv[2]))
assert peer is not None and peer.hold(int(sys.argv[3]), int(sys.argv[4]))
print("held", flush=True)
sys.stdin.read()
"""


def hold_in_another_process(arena: Arena, offset: int, nbytes: int) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(arena.path), arena.token.hex(), str(offset),
                              str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout is not None and child.stdout.readline() == b"held\n"
    return child


def test_a_region_a_live_reader_holds_is_not_lent_again_and_a_dead_readers_is(exporter: ShmExporter) -> None:
    region = region_of(exporter, [os.urandom(BLOCK)] * 3)
    all_free = exporter.free_bytes + REGION_SLOT_BYTES
    reader = hold_in_another_process(exporter.arena, region.offset, sum(region.lengths))
    try:
        del region  # prefill is done with it (done, lease, cancel) ...
        assert exporter.free_bytes < all_free and exporter.held == 1  # ... but decode reads it still
        assert exporter.counts["reader_held"] == 1
    finally:
        reader.kill()  # a decode worker that died mid-import: the kernel drops its lock
        reader.wait()
    assert exporter.free_bytes == all_free and exporter.held == 0


def test_a_region_is_free_once_its_last_view_is_gone(exporter: ShmExporter) -> None:
    all_free = exporter.free_bytes
    region = region_of(exporter, [b"a" * BLOCK, b"b" * 10])
    kept = region.items[1]
    del region
    assert exporter.free_bytes < all_free  # one view lives on (the store's put, say)
    del kept
    assert exporter.free_bytes == all_free


async def test_a_pull_naming_shm_gets_a_descriptor_and_one_without_gets_the_bytes(exporter: ShmExporter) -> None:
    handovers = Handovers(exporter=exporter)
    keys = [b"k0", b"k1", b"k2"]
    data, tail, state = [os.urandom(BLOCK) for _ in keys], os.urandom(BLOCK), os.urandom(100)
    handovers.open("r", keys)
    assert handovers.fill_region("r", region_of(exporter, [*data, tail, state[:60], state[60:]]), 3, True)
    shm = await handovers.serve(KvPeerPull("r", 1, keys[1:], 1 << 20, 0, PREFERRED, ["shm"]))
    assert shm.found and shm.items == [] and shm.shm is not None
    assert (shm.blocks, shm.tail, shm.state_parts) == (3, True, 2)
    assert shm.shm.lengths == [BLOCK, BLOCK, BLOCK, 60, 40]
    assert shm.checksums == [checksum(i, PREFERRED) for i in [*data[1:], tail, state[:60], state[60:]]]
    plain = await handovers.serve(KvPeerPull("r", 1, keys[1:], 2 * BLOCK))
    assert plain.shm is None and [bytes(i) for i in plain.items] == data[1:]  # served from the same region
    assert not (await handovers.serve(KvPeerPull("r", 0, [b"x"], 1 << 20, via=["shm"]))).found  # other hashes


async def test_decode_reads_the_region_checks_it_and_lets_go_when_its_views_are_gone(exporter: ShmExporter) -> None:
    handovers = Handovers(exporter=exporter)
    keys = [b"k0", b"k1"]
    data, state = [os.urandom(BLOCK) for _ in keys], os.urandom(100)
    handovers.open("r", keys)
    handovers.fill_region("r", region_of(exporter, [*data, state]), 2, False)
    reply = await handovers.serve(KvPeerPull("r", 0, keys, 1 << 20, 0, PREFERRED, ["shm"]))
    puller = PeerPuller(None, BLOCK, message_bytes=1 << 20, via=["shm"])  # type: ignore[arg-type]  (no bus)
    pulled = await puller._read_shm("p", "r", reply, 0)  # noqa: SLF001
    assert pulled is not None and pulled.held
    assert [bytes(b) for b in pulled.blocks] == data and pulled.snapshot == (b"", state)
    handovers.end("r", "done")  # prefill lets go (decode's done would come with the views' end) ...
    assert exporter.held == 1 and exporter.free_bytes < 8 * REGION_SLOT_BYTES  # ... but decode holds the region
    del pulled
    assert puller.counts["shm_released"] == 1 and exporter.free_bytes == 8 * REGION_SLOT_BYTES


async def test_a_corrupt_or_unreadable_region_is_never_imported(exporter: ShmExporter) -> None:
    handovers = Handovers(exporter=exporter)
    data = [os.urandom(BLOCK)]
    handovers.open("r", [b"k"])
    region = region_of(exporter, data)
    handovers.fill_region("r", region, 1, False)
    reply = await handovers.serve(KvPeerPull("r", 0, [b"k"], 1 << 20, 0, PREFERRED, ["shm"]))
    puller = PeerPuller(None, BLOCK, message_bytes=1 << 20, via=["shm"])  # type: ignore[arg-type]
    exporter.arena.region(region.offset, 1)[:] = bytes([data[0][0] ^ 1])  # a flipped byte after the checksum
    corrupt = await puller._read_shm("p", "r", reply, 0)  # noqa: SLF001
    assert corrupt is not None and corrupt.blocks == [] and corrupt.snapshot is None  # the store takes over
    assert puller.counts["peer_corrupt"] == 1
    assert reply.shm is not None
    wrong_token = KvPeerReply(True, [], reply.checksums, 1, shm=KvPeerShm(reply.shm.arena, b"x" * 16,
                                                                          reply.shm.offset, reply.shm.lengths))
    assert await puller._read_shm("p", "r", wrong_token, 0) is None  # noqa: SLF001  (not the same arena: NATS)
    elsewhere = KvPeerShm("/etc/passwd", reply.shm.token, reply.shm.offset, reply.shm.lengths)
    assert ShmImporter().read(KvPeerReply(True, [], reply.checksums, 1, shm=elsewhere), lambda: None) is None
    assert exporter.arena.lock_range(region.offset, BLOCK)  # being written (prefill's write lock): not readable
    assert ShmImporter().read(reply, lambda: None) is None
    exporter.arena.unlock_range(region.offset, BLOCK)
    assert puller.counts["shm_refused"] == 1


OWNER = """
import sys
from shared.kv_arena import Arena, arena_path
arena = Arena(arena_path(sys.argv[1]), 2, 4096)
print(arena.path, arena.token.hex(), flush=True)
sys.stdin.read()
"""


def test_a_dead_owners_arena_is_not_read() -> None:
    """A prefill worker killed (its arena file left in /dev/shm, its owner's flock gone with it): decode does not
    map it, and takes the rest from the store; a closed one is gone altogether."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, f"test-owner-{os.getpid()}"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert owner.stdout is not None
    path, token = owner.stdout.readline().decode().split()
    try:
        assert PeerMap.open(path, bytes.fromhex(token)) is not None
        owner.kill()
        owner.wait()
        assert Path(path).exists() and PeerMap.open(path, bytes.fromhex(token)) is None
    finally:
        owner.kill()
        Path(path).unlink(missing_ok=True)
    closed = Arena(arena_path(f"test-closed-{os.getpid()}"), 2, 4096)
    closed.close()
    assert PeerMap.open(str(closed.path), closed.token) is None


def test_transports_by_name_and_cuda_ipc_runs_as_auto_until_it_is_built() -> None:
    from shared.worker import kv_cuda_ipc  # the mechanism imports without CUDA (its test is in tests/gpu)
    from shared.worker.config import WorkerConfig
    from shared.worker.kv_peer_transport import PEER_TRANSPORTS, peer_transport

    assert peer_transport("nats").reads == () and peer_transport("nats").exporter is None
    assert peer_transport("shm").reads == ("shm",) and peer_transport("auto") == PEER_TRANSPORTS["auto"]
    assert peer_transport("cuda-ipc") == PEER_TRANSPORTS["auto"] and callable(kv_cuda_ipc.open_shared)
    assert WorkerConfig("cpu", None, None, 1, kv_peer_transport="cuda-ipc", kv_arena_mib=640).kv_arena_mib == 640
    for bad in ({"kv_peer_transport": "carrier-pigeon"}, {"kv_arena_mib": 0}):
        with pytest.raises(ValueError, match="--kv-"):
            WorkerConfig("cpu", None, None, 1, **bad)  # type: ignore[arg-type]
