"""The CUDA IPC hand-over's pieces that run without a GPU: device blobs imported a run at a time, a pull offering
cuda-ipc answered from the device buffer before the host copy exists, and a CPU worker never offering it.
Two GPU processes handing over for real: tests/gpu/test_kv_cuda_ipc_gpu.py."""

from __future__ import annotations

import asyncio
import os

import torch

from shared.engine.kv_cache import CacheSpec, DeviceBlob, KVCache, PagedSpec, runs_of
from shared.codec import decode, encode
from shared.schemas.kv_peer import CudaHandle, KvPeerCuda, KvPeerPull, KvPeerReply
from shared.worker.kv_cuda_ipc import DeviceRegion, digest, padded
from shared.worker.kv_peer import Handovers, PeerPuller


def cache(blocks: int, seed: int) -> KVCache:
    spec = CacheSpec(paged=PagedSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_tokens=4, dtype=torch.float32),
                     per_request_state_bytes=0)
    kv = KVCache(spec, blocks, torch.device("cpu"))
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def test_device_blobs_of_one_run_import_as_one_and_land_where_asked() -> None:
    src, dst = cache(6, 1), cache(6, 2)
    run = torch.empty(4 * src.block_bytes, dtype=torch.uint8)
    src.export_run([5, 1, 2, 3], run)
    bb = src.block_bytes
    blobs = [DeviceBlob(run, i * bb, bb) for i in range(4)]
    loose = src.read_blocks([4])[0]
    mixed = [blobs[0], blobs[1], loose, blobs[3]]
    spans = [(lo, hi) for lo, hi, _ in runs_of(mixed, False)]
    assert spans == [(0, 2), (2, 3), (3, 4)]  # the two adjacent device blobs as one run; the gap breaks it
    dst.write_blocks([0, 1, 2, 3], mixed)
    for mine, theirs in zip([0, 1, 2, 3], [5, 1, 4, 3]):
        assert torch.equal(dst.kv[:, :, mine], src.kv[:, :, theirs])


def region(nblocks: int, state: bytes) -> DeviceRegion:
    """A filled device region as CudaExporter makes one, its buffer in host memory (no GPU here)."""
    lengths = [16] * nblocks + ([len(state)] if state else [])
    buf = torch.zeros(padded(sum(lengths)), dtype=torch.uint8)
    buf[: 16 * nblocks] = torch.frombuffer(bytearray(os.urandom(16 * nblocks)), dtype=torch.uint8)
    buf[16 * nblocks : 16 * nblocks + len(state)] = torch.frombuffer(bytearray(state), dtype=torch.uint8)
    handle = CudaHandle(0, b"h", buf.numel(), 0, b"r", 0, b"e", False, buf.numel())
    return DeviceRegion(buf, lengths, nblocks, False, KvPeerCuda("boot", "GPU-0", handle, lengths, digest(buf)))


async def test_a_cuda_pull_is_answered_from_the_device_buffer_before_the_host_copy() -> None:
    handovers = Handovers(cuda=object())  # type: ignore[arg-type]  (an exporter's presence is all serve reads)
    keys = [b"a", b"b", b"c"]
    handovers.open("r", keys)
    cuda = asyncio.ensure_future(handovers.serve(KvPeerPull("r", 1, keys[1:], 1 << 20, via=["cuda-ipc", "shm"])))
    host = asyncio.ensure_future(handovers.serve(KvPeerPull("r", 0, keys, 1 << 20)))
    await asyncio.sleep(0)
    assert not cuda.done() and not host.done()  # nothing exported yet
    dev = region(3, b"state!")
    assert handovers.fill_device("r", dev)
    got = await cuda
    assert got.found and got.cuda == dev.descriptor and not got.items
    assert (got.blocks, got.tail, got.state_parts) == (3, False, 1)
    await asyncio.sleep(0)
    assert not host.done()  # a pull that cannot open handles waits for the host copy
    handovers.fill("r", [b"x" * 16] * 3, b"", b"state!", part_bytes=4)
    assert (await host).items[0] == b"x" * 16
    assert handovers.counts["blocks_served_cuda"] == 2
    handovers.end("r", "done")
    assert not (await handovers.serve(KvPeerPull("r", 0, keys, 1 << 20, via=["cuda-ipc"]))).found


async def test_a_cuda_pull_of_a_hand_over_with_no_device_buffer_gets_the_host_items() -> None:
    handovers = Handovers(cuda=object())  # type: ignore[arg-type]
    handovers.open("r", [b"a"])
    handovers.fill("r", [b"y" * 16], b"", b"", part_bytes=4)  # the GPU had no room: the host path alone
    got = await handovers.serve(KvPeerPull("r", 0, [b"a"], 1 << 20, via=["cuda-ipc"]))
    assert got.found and got.cuda is None and got.items == [b"y" * 16]


def test_a_cuda_reply_crosses_the_codec_whole_and_the_puller_takes_it_as_a_descriptor() -> None:
    reply = KvPeerReply(True, [], [], 3, False, 1, "xxh3", cuda=region(3, b"state!").descriptor)
    back = decode(KvPeerReply, encode(reply))
    assert back == reply and isinstance(back.cuda.handle, CudaHandle)
    puller = PeerPuller(None, 16, message_bytes=1 << 20)  # type: ignore[arg-type]
    assert puller.intact(back, 0)  # no items: they lie in the peer's GPU memory (checked by digest after the copy)


def test_a_worker_whose_kv_is_on_the_cpu_never_offers_cuda_ipc() -> None:
    puller = PeerPuller(None, 16, message_bytes=1 << 20, via=["cuda-ipc", "shm"], device="cpu")  # type: ignore[arg-type]
    assert puller.via == ["shm"]


def test_the_digest_is_the_wrapping_sum_of_words_and_sees_one_flipped_bit() -> None:
    buf = torch.frombuffer(bytearray(os.urandom(4096)), dtype=torch.uint8)
    words = [int.from_bytes(bytes(buf[i : i + 8].tolist()), "little", signed=True) for i in range(0, 4096, 8)]
    total = sum(words) % (1 << 64)
    assert digest(buf) == (total - (1 << 64) if total >= 1 << 63 else total)
    flipped = buf.clone()
    flipped[100] ^= 4
    assert digest(flipped) != digest(buf)
