"""CUDA IPC between two processes (shared/worker/kv_cuda_ipc.py): a producer (prefill) shares a device buffer as
plain data (JSON here, msgpack on the bus; never pickle), a consumer (decode) opens it and copies device to
device; the bytes are the producer's, and the producer's buffer is untouched by the consumer's copy."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from shared.worker.kv_cuda_ipc import CudaHandle, open_shared

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
NBYTES = 64 << 20  # a Llama-8B-shape 512-token run, about

PRODUCER = """
import json, sys, torch
from dataclasses import asdict
from shared.worker.kv_cuda_ipc import share
g = torch.Generator(device="cuda").manual_seed(11)
buf = torch.randint(0, 256, (int(sys.argv[1]),), dtype=torch.uint8, device="cuda", generator=g)
torch.cuda.synchronize()
h = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in asdict(share(buf)).items()}
print(json.dumps(h), flush=True)
sys.stdin.readline()  # the consumer is done: only now may the buffer go
print(int(buf.to(torch.int64).sum()), flush=True)
"""


def test_a_device_buffer_crosses_processes_by_handle_and_copies_device_to_device() -> None:
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, str(NBYTES)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert producer.stdout is not None and producer.stdin is not None
        fields = json.loads(producer.stdout.readline())
        handle = CudaHandle(**{k: (bytes.fromhex(v) if k.endswith("handle") else v) for k, v in fields.items()})
        shared = open_shared(handle)
        mine = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
        mine.copy_(shared)  # device to device
        torch.cuda.synchronize()
        del shared
        g = torch.Generator(device="cuda").manual_seed(11)
        want = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda", generator=g)
        assert torch.equal(mine, want)
        producer.stdin.write("done\n")
        producer.stdin.flush()
        assert int(producer.stdout.readline()) == int(want.to(torch.int64).sum())  # the producer's, unchanged
        assert asdict(handle)["nbytes"] == NBYTES
    finally:
        producer.kill()
        producer.wait()


HANDOVER_PRODUCER = """
import asyncio, sys, torch
from shared import subjects
from shared.bus import Bus
from shared.schemas.kv_peer import KvPeerDone, KvPeerPull
from shared.worker.kv_cuda_ipc import CudaExporter, DeviceRegion
from shared.worker.kv_peer import Handovers
sys.path.insert(0, "tests/gpu")
from test_kv_cuda_ipc_gpu import KEYS, llama_cache

async def main():
    src = llama_cache(seed=5)
    handovers = Handovers(cuda=CudaExporter())
    bus = await Bus.connect(sys.argv[1], "gpu-prefill")
    await bus.serve(subjects.kv_peer("gpu-prefill"), KvPeerPull, handovers.serve)
    async def on_done(done, _):
        handovers.end(done.request_id, "done")
    await bus.subscribe(subjects.kv_peer_done("gpu-prefill"), KvPeerDone, on_done)
    handovers.open("r", KEYS)
    buf = torch.empty(len(KEYS) * src.block_bytes, dtype=torch.uint8, device="cuda")
    src.export_run(list(range(len(KEYS))), buf)
    handovers.fill_device("r", DeviceRegion.of(buf, [src.block_bytes] * len(KEYS), len(KEYS), False))
    del buf  # the hand-over holds it now
    print("ready", flush=True)
    while handovers.counts["ended_done"] == 0:
        await asyncio.sleep(0.05)
    print("ended", dict(handovers.counts), flush=True)
    await bus.drain()

asyncio.run(main())
"""

KEYS = [b"key%d" % i for i in range(24)]


def llama_cache(seed: int):  # noqa: ANN201 - a KVCache, imported lazily by the producer too
    from shared.engine.kv_cache import CacheSpec, KVCache, PagedSpec

    spec = CacheSpec(PagedSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype=torch.bfloat16), 0)
    kv = KVCache(spec, len(KEYS), torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=g, device="cuda"))
    return kv


async def test_a_hand_over_by_cuda_ipc_lands_the_producers_blocks_and_ends_it(tmp_path: Path) -> None:
    from shared.bus import Bus
    from shared.launch import natsserver
    from shared.worker.kv_peer import PeerPuller

    server = natsserver.start(tmp_path / "nats")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    producer = subprocess.Popen([sys.executable, "-c", HANDOVER_PRODUCER, server.url], stdout=subprocess.PIPE,
                                text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    try:
        assert producer.stdout is not None
        out = producer.stdout

        async def line() -> str:  # bounded: a stuck producer fails the test here, not the whole run
            return await asyncio.wait_for(asyncio.to_thread(out.readline), 60)

        assert (await line()).strip() == "ready"
        bus = await Bus.connect(server.url, "gpu-decode")
        dst = llama_cache(seed=9)
        puller = PeerPuller(bus, dst.block_bytes, message_bytes=4 << 20, via=["cuda-ipc", "shm"], device="cuda")
        pulled = await asyncio.wait_for(puller.pull("gpu-prefill", "r", KEYS, 2), 60)  # decode holds 0 and 1
        assert puller.counts["peer_blocks_cuda"] == len(KEYS) - 2 and pulled.snapshot is not None
        dst.write_blocks(list(range(2, len(KEYS))), pulled.blocks)
        want = llama_cache(seed=5)
        assert torch.equal(dst.kv[:, :, 2:], want.kv[:, :, 2:])
        assert not torch.equal(dst.kv[:, :, :2], want.kv[:, :, :2])  # not pulled: decode's own
        assert (await line()).startswith("ended")  # decode said done once its copy was in
        await asyncio.wait_for(bus.drain(), 30)
    finally:
        producer.kill()
        producer.wait()
        server.stop()
