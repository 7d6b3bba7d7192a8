"""A worker's settings beyond the service's (shared/config.py): the engine's device and sizes, and how KV bytes
move. One definition: the frozen record validates, argparse fills it."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from shared.config import DEFAULT_MAX_RUNNING
from shared.engine.device import default_device
from shared.worker.kv_peer_transport import PEER_TRANSPORTS, PLANNED
from shared.worker.kvclient import ARENA_MIB, TRANSPORTS

HANDOVERS = ("peer", "store")  # --kv-handover


@dataclass(frozen=True)
class WorkerConfig:
    device: str
    kv_blocks: int | None
    max_batch_tokens: int | None  # None: by role and device (shared/config.py default_batch_tokens)
    max_running: int
    speculative_tokens: int = 0
    gpu_memory_utilization: float | None = None  # share of the GPU this worker may fill; None = the engine's rule
    kv_transport: str = "nats"  # how KV bytes reach the kvcache service: shared/worker/kvclient.py TRANSPORTS
    kv_handover: str = "peer"  # prefill -> decode: "peer" (decode pulls from prefill: kv_peer.py) | "store"
    kv_peer_transport: str = "auto"  # how a peer hand-over's bytes go: shared/worker/kv_peer_transport.py
    kv_arena_mib: int = ARENA_MIB  # each shared-memory arena's size (the store's, the peer hand-overs')

    def __post_init__(self) -> None:
        if (self.max_batch_tokens is not None and self.max_batch_tokens < 1) or self.max_running < 1:
            raise ValueError("--max-batch-tokens and --max-running must be positive")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError("--kv-blocks must be positive")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {sorted(TRANSPORTS)}")
        if self.kv_handover not in HANDOVERS:
            raise ValueError(f"--kv-handover must be one of {list(HANDOVERS)}")
        if self.kv_peer_transport not in (*PEER_TRANSPORTS, *PLANNED):
            raise ValueError(f"--kv-peer-transport must be one of {[*PEER_TRANSPORTS, *PLANNED]}")
        if self.kv_arena_mib < 1:
            raise ValueError("--kv-arena-mib must be positive")
        if self.speculative_tokens < 0:
            raise ValueError("--speculative-tokens must be >= 0")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=default_device(), help="engine device (default: cuda if available)")
    parser.add_argument("--kv-blocks", type=int, default=None, help="KV cache size in blocks (default: from memory)")
    # the second spellings are vLLM's
    parser.add_argument("--max-batch-tokens", "--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step (chunked prefill); default: 512 on a CPU, on a GPU 16384 for "
                             "a prefill worker and 2048 for a decode worker")
    parser.add_argument("--max-running", "--max-num-seqs", type=int, default=DEFAULT_MAX_RUNNING,
                        help="requests held at once")
    parser.add_argument("--speculative-tokens", type=int, default=0,
                        help="MTP drafts per decode step (DeepSeek-V4 with an MTP layer; 0 = off)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of the GPU's total memory this worker may fill: weights, activations "
                             "(measured) and KV pool (as vLLM's; `deepinfer up` splits one GPU between its "
                             "workers); default: the KV pool takes 80%% of what is free after loading the weights")
    parser.add_argument("--kv-transport", default=os.environ.get("DEEPINFER_KV_TRANSPORT", "nats"),
                        help=f"how KV bytes reach the kvcache service: {' | '.join(TRANSPORTS)} (shm: shared "
                             "memory, worker and kvcache on one host; falls back to nats when the store cannot map it)")
    parser.add_argument("--kv-handover", default=os.environ.get("DEEPINFER_KV_HANDOVER", "peer"),
                        help="how a prompt's KV reaches decode: peer (decode pulls it from the prefill worker, the "
                             "store still gets it for later turns; the store when the peer cannot give it) | store "
                             "(through the kvcache service only)")
    parser.add_argument("--kv-peer-transport", default=os.environ.get("DEEPINFER_KV_PEER_TRANSPORT", "auto"),
                        help="how a peer hand-over's bytes reach decode: auto (shared memory when decode can map "
                             "prefill's arena, i.e. one host; else nats) | shm | nats | cuda-ipc (not built yet: "
                             "runs as auto)")
    parser.add_argument("--kv-arena-mib", type=int, default=os.environ.get("DEEPINFER_KV_ARENA_MIB", str(ARENA_MIB)),
                        help="MiB of shared memory (/dev/shm) per arena: the store's (--kv-transport shm) and a "
                             "prefill worker's peer hand-overs' (a prompt's KV that does not fit goes over NATS)")


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(args.device, args.kv_blocks, args.max_batch_tokens, args.max_running,
                        args.speculative_tokens, args.gpu_memory_utilization, args.kv_transport, args.kv_handover,
                        args.kv_peer_transport, args.kv_arena_mib)
