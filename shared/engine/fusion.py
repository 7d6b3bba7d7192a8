"""Chains of small torch ops fused into one kernel each on CUDA: torch.compile (Inductor generates Triton).

A decode step at batch 1 is thousands of kernels of a few microseconds (norms in float32, RoPE on the trailing
channels, the mHC mix, the compressor's window softmax): at V4-Flash's 43 layers they were about 24 ms of a 32 ms
step, the weights' own bytes about 6 ms. `fused` compiles such a function, written as plain torch, for CUDA
tensors, and leaves it eager everywhere else (the CPU path, which is the reference the tests compare against).

Shapes are dynamic (one kernel serves every batch bucket); compiled functions run inside the decode step's CUDA
graph like any kernel, and the warm-up before each capture compiles them outside it. Only pure tensor functions
qualify: no Python objects that differ per layer (each would be a guard and a recompile).
DEEPINFER_FUSION=0 turns it off (everything eager, as on a CPU).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)

ENABLED = os.environ.get("DEEPINFER_FUSION", "1") not in ("0", "false", "no", "off")
# One function meets several dtypes, ranks and None-or-tensor arguments (each a compiled variant): Dynamo's
# default of 8 variants per function is too few; past this many the function runs eagerly from then on.
RECOMPILE_LIMIT = 64


def fused(fn: F) -> F:
    """fn compiled on its first call with a CUDA tensor as its first argument; eager otherwise, and eager for
    good if compiling it ever fails (logged once: slower, never wrong)."""
    compiled: Callable[..., Any] | None = None
    broken = False

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled, broken
        if torch.compiler.is_compiling():  # called from a function being compiled: traced into it, inline
            return fn(*args, **kwargs)
        if broken or not (ENABLED and args and isinstance(args[0], torch.Tensor) and args[0].is_cuda):
            return fn(*args, **kwargs)
        if compiled is None:
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
            dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 16 * RECOMPILE_LIMIT)
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(*args, **kwargs)
        except Exception:
            if torch.cuda.is_current_stream_capturing():
                raise  # a capture must not half-run eagerly; the warm-up before it compiles, so this is a bug
            log.exception("%s: torch.compile failed, running it eagerly from now on", fn.__qualname__)
            broken = True
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
