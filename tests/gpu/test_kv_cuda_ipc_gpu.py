"""CUDA IPC between two processes (shared/worker/kv_cuda_ipc.py): a producer (prefill) shares a device buffer as
plain data (JSON here, msgpack on the bus; never pickle), a consumer (decode) opens it and copies device to
device; the bytes are the producer's, and the producer's buffer is untouched by the consumer's copy."""

from __future__ import annotations

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
