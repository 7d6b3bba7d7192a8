"""What every benchmark measures the same way: a median time per call, and the device's two ceilings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def cuda_time(fn: Callable[[], Any], reps: int = 10, warm: int = 3) -> float:
    """Median seconds of fn(): between CUDA events on a GPU, by the host clock on the CPU."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def ceilings(device: torch.device | str = "cuda") -> tuple[float, float]:
    """(copy bytes/s counting read + write, matmul FLOP/s: bf16 on a GPU, fp32 on the CPU), measured."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    n = (2 << 30) if gpu else (64 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    bw = 2 * n / cuda_time(lambda: y.copy_(x))
    del x, y
    k = 8192 if gpu else 512
    dtype = torch.bfloat16 if gpu else torch.float32
    a, b = torch.randn(k, k, device=device, dtype=dtype), torch.randn(k, k, device=device, dtype=dtype)
    return bw, 2 * k**3 / cuda_time(lambda: a @ b)


def kernel_rows(prof: Any, steps: int, width: int = 70) -> list[tuple[str, float, int]]:
    """A torch profiler's CUDA kernels, slowest first: (name cut to `width`, us per step, launches per step)."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU:
            continue  # a torch op (profiled with CPU activity too): its kernels have rows of their own
        if t > 0 and e.count:
            rows.append((e.key[:width], t / steps, e.count // steps))
    return sorted(rows, key=lambda r: -r[1])
