"""A worker's settings beyond the service's (shared/config.py): the engine's device and sizes, and how KV bytes
move. One definition: the frozen record validates, its fields are the flags (shared/config.py `option`), and
`deepinfer up` takes its defaults from here. Torch-free at import, so `deepinfer up --help` answers at once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.config import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_RUNNING, GPU_BATCH_TOKENS, add_flags, from_args, option
from shared.kv_arena import ARENA_MIB

HANDOVERS = ("peer", "store")  # --kv-handover
SPECULATIVE_METHODS = ("mtp", "ngram")  # --speculative-method: shared/engine/drafters METHODS (a test checks them)
SPECULATIVE_POLICIES = ("fixed", "adaptive")  # --speculative-policy: shared/engine/verify_policy.py POLICIES
QUANTIZATIONS = ("auto", "bf16")  # --quantization: shared/engine/engine.py QUANTIZATIONS (a test checks them)
LOAD_FORMATS = ("auto", "dummy")  # --load-format: shared/engine/loader LOAD_FORMATS (a test checks them)
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")  # --kv-cache-dtype: shared/engine/kv_quant.py's (a test checks them)
KV_TRANSPORTS = "nats | shm"  # the names in shared/worker/kvclient.py TRANSPORTS, for --help (a test checks them)


def _default_device() -> str:
    from shared.engine.device import default_device  # torch: only when a worker parses its flags

    return default_device()


@dataclass(frozen=True)
class WorkerConfig:
    device: str = option(default_factory=_default_device, help="engine device (default: cuda if available)")
    kv_blocks: int | None = option(None, help="KV cache size in blocks (default: from memory)")
    # None: by role and device (shared/config.py default_batch_tokens)
    max_batch_tokens: int | None = option(
        None, aliases=("--max-num-batched-tokens",),  # the second spellings are vLLM's
        help=f"tokens per engine step (chunked prefill); default: {DEFAULT_MAX_BATCH_TOKENS} on a CPU, on a GPU "
             f"{GPU_BATCH_TOKENS['prefill']} for a prefill worker and {GPU_BATCH_TOKENS['decode']} for a decode worker")
    max_running: int = option(DEFAULT_MAX_RUNNING, aliases=("--max-num-seqs",), help="requests held at once")
    speculative_tokens: int = option(0, help="most drafts verified per decode step (0 = off)")
    speculative_method: str = option(
        "mtp", help="who drafts: mtp (the model's MTP layer, DeepSeek-V4) | ngram (prompt lookup: any model, no "
                    "weights; pays where the output quotes its context)")
    speculative_policy: str = option(
        "fixed", help="drafts verified per request and step: fixed (always --speculative-tokens) | adaptive (fewer "
                      "after short n-gram matches or rejections, none on large batches)")
    quantization: str = option(
        "auto", help="weights of a quantized checkpoint: auto (as shipped on a GPU: DeepSeek-V4's FP8 linears and "
                     "FP4 experts stay quantized, read by the kernels; dequantized on a CPU) | bf16 (dequantized)")
    load_format: str = option(
        "auto", env=True, help="where the weights come from: auto (the checkpoint's files) | dummy (random weights "
                               "drawn on the device from config.json alone, the same in every worker; for "
                               "benchmarks of models whose checkpoint is not on disk: DeepSeek-V4 and Llama "
                               "checkpoint directories; the KV cache id says dummy, so its blocks never mix with "
                               "the real weights')")
    kv_cache_dtype: str = option(
        "auto", env=True, help="how the KV cache stores keys: auto (the model's dtype) | bf16 | fp8 (e4m3 with a "
                               "float32 scale per 64 channels, RoPE channels bf16: about half the bytes per block "
                               "and twice the tokens of context; DeepSeek-V4, and Llama-family models on the torch "
                               "kernels only)")
    enforce_eager: bool = option(
        False, env=True, help="never replay decode steps from CUDA graphs (vLLM's spelling); slower, for debugging")
    deterministic: bool = option(
        False, env=True, help="batch-invariant kernels on a GPU: a request's logits are the same bits whatever its "
                              "batch, so a migrated request continues token-identically in bf16 (Llama-family "
                              "models; slower: bench/deterministic.py)")
    # share of the GPU this worker may fill; None = the engine's rule
    gpu_memory_utilization: float | None = option(
        None, help="share of the GPU's total memory this worker may fill: weights, activations (measured) and KV "
                   "pool (as vLLM's; `deepinfer up` splits one GPU between its workers); default: the KV pool "
                   "takes 80%% of what is free after loading the weights")
    # how KV bytes reach the kvcache service: shared/worker/kvclient.py TRANSPORTS
    kv_transport: str = option(
        "nats", env=True, help=f"how KV bytes reach the kvcache service: {KV_TRANSPORTS} (shm: shared memory, worker "
                               "and kvcache on one host; falls back to nats when the store cannot map it)")
    # prefill -> decode: "peer" (decode pulls from prefill: kv_peer.py) | "store"
    kv_handover: str = option(
        "peer", env=True, help="how a prompt's KV reaches decode: peer (decode pulls it from the prefill worker, the "
                               "store still gets it for later turns; the store when the peer cannot give it) | store "
                               "(through the kvcache service only)")
    # how a peer hand-over's bytes go: shared/worker/kv_peer_transport.py PEER_TRANSPORTS
    kv_peer_transport: str = option(
        "auto", env=True, help="how a peer hand-over's bytes reach decode: auto (GPU to GPU by CUDA IPC when both "
                               "engines are on GPUs of one host, else shared memory when decode can map prefill's "
                               "arena, else nats) | cuda-ipc (the same) | shm | nats")
    expert_counts_interval_s: float = option(
        5.0, help="s between two reports of the per-expert routing counts on the bus (experts.load, for the "
                  "balancer's experts role); models with routed experts only; 0 = off")
    expert_parallel: int = option(
        1, aliases=("--expert-parallel-size",),  # the second spelling is vLLM's
        help="ranks a DeepSeek-V4 worker spreads its routed experts over (this process is rank 0 and runs the rest "
             "of the model; the others are processes it spawns, gloo on a CPU, one GPU each on CUDA); the worker "
             "applies the experts balancer's plans between two steps; 1 = off")
    kv_arena_mib: int = option(
        ARENA_MIB, env=True, help="MiB of shared memory (/dev/shm) per arena: the store's (--kv-transport shm) and a "
                                  "prefill worker's peer hand-overs' (a prompt's KV that does not fit goes over NATS)")

    def __post_init__(self) -> None:
        from shared.worker.kv_peer_transport import PEER_TRANSPORTS
        from shared.worker.kvclient import TRANSPORTS  # the bus: not for `deepinfer up --help`

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
        if self.kv_peer_transport not in PEER_TRANSPORTS:
            raise ValueError(f"--kv-peer-transport must be one of {list(PEER_TRANSPORTS)}")
        if self.expert_counts_interval_s < 0:
            raise ValueError("--expert-counts-interval must be >= 0")
        if self.expert_parallel < 1:
            raise ValueError("--expert-parallel must be >= 1")
        if self.kv_arena_mib < 1:
            raise ValueError("--kv-arena-mib must be positive")
        if self.speculative_tokens < 0:
            raise ValueError("--speculative-tokens must be >= 0")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-method must be one of {list(SPECULATIVE_METHODS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {list(QUANTIZATIONS)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {list(LOAD_FORMATS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {list(KV_CACHE_DTYPES)}")
        if self.speculative_policy not in SPECULATIVE_POLICIES:
            raise ValueError(f"--speculative-policy must be one of {list(SPECULATIVE_POLICIES)}")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, WorkerConfig)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return from_args(WorkerConfig, args)
