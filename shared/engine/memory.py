"""How big the KV pool may be: a worker's GPU memory budget, as vLLM's --gpu-memory-utilization means it.

    device total x utilization  =  weights and buffers   (what the process holds once the model is built)
                                 + activation peak       (measured: one step of max_batch_tokens, less the pool)
                                 + request state         (per-request short-term state, max_running of them)
                                 + KV pool               (what is left)

Workers that share a device each get their own share (the launcher splits one between them: launcher.py), so
the pools fit side by side whichever worker loads first. Without a share the old rule holds: the pool takes
GPU_KV_FRACTION of the memory free after the weights (one worker per device). On a CPU the pool is CPU_KV_BYTES.

The arithmetic is pure (DeviceMemory in, bytes out) so it is tested without a GPU; `probe` reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass, is_dataclass

import torch

CPU_KV_BYTES = 1 << 30  # default KV budget on the CPU: 1 GiB
GPU_KV_FRACTION = 0.8  # default KV budget on a GPU without a share: this share of the memory free after weights
GiB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device when the pool is sized."""

    total: int  # the device's memory
    free: int  # free now, for every process on it
    held: int  # held by this process now: weights, buffers, the allocator's cache
    activation_peak: int = 0  # the largest step's transient memory above `held`


def kv_pool_bytes(mem: DeviceMemory, utilization: float | None, request_state: int = 0) -> int:
    """The KV pool's bytes; ValueError when the share leaves nothing for it or more than is free."""
    if utilization is None:
        return int(mem.free * GPU_KV_FRACTION)
    pool = int(mem.total * utilization) - mem.held - mem.activation_peak - request_state
    room = mem.free - mem.activation_peak - request_state  # what the pool may take of the device now
    if pool <= 0 or pool > room:
        raise ValueError(
            f"gpu_memory_utilization {utilization} of {mem.total / GiB:.1f} GiB: weights {mem.held / GiB:.1f} GiB "
            f"+ activations {mem.activation_peak / GiB:.1f} GiB + request state {request_state / GiB:.1f} GiB "
            f"leave {pool / GiB:.1f} GiB for the KV pool, {max(room, 0) / GiB:.1f} GiB free on the device"
        )
    return pool


def probe(device: torch.device, activation_peak: int = 0) -> DeviceMemory:
    """The device's memory now, as this process sees it (CUDA only)."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free, torch.cuda.memory_reserved(device), activation_peak)


@dataclass(frozen=True)
class MemoryReport:
    """What an engine holds, for the one log line a worker writes at load: weights, KV pool, and how many tokens
    of context that pool holds (all requests together; one request is capped at `context_cap`)."""

    weight_bytes: int  # the model's weights as held (FP8 / FP4 ones at their quantized size, scales included)
    kv_bytes: int  # the KV pool: kv_blocks x block bytes
    kv_blocks: int
    block_tokens: int
    state_bytes: int  # per-request short-term state (V4's sliding rings), all slots together
    context_cap: int  # tokens one sequence may reach
    kv_dtype: str = ""  # how the pool stores KV ("float8_e4m3fn": --kv-cache-dtype fp8); "" = not said

    @property
    def tokens(self) -> int:
        return self.kv_blocks * self.block_tokens

    def line(self) -> str:
        full = self.tokens // self.context_cap if self.context_cap else 0
        dtype = f" of {self.kv_dtype}" if self.kv_dtype else ""
        return (f"memory: weights {self.weight_bytes / GiB:.2f} GiB, KV pool {self.kv_bytes / GiB:.2f} GiB{dtype} "
                f"({self.kv_blocks} blocks of {self.block_tokens} tokens) + request state "
                f"{self.state_bytes / GiB:.2f} GiB: {self.tokens} tokens of context fit "
                f"({full} sequences at the full {self.context_cap})")


def held_bytes(root: object) -> int:
    """Bytes of the tensors reachable from `root` through attributes, dataclass fields, lists, tuples and dicts,
    each storage counted once (a tied head is the embedding). Objects of other classes (caches, kernels' state)
    are not entered, so a model's weights are counted and its KV pool is not."""
    seen: set[int] = set()
    total = 0
    stack = [root]
    visited: set[int] = set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            key = obj.untyped_storage().data_ptr() if obj.device.type != "meta" else id(obj)
            if key not in seen:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
            continue
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif obj is root or is_dataclass(obj):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
    return total
