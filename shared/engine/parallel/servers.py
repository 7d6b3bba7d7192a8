"""The engine over several ranks, expert parallelism alone: rank 0 is the engine (scheduler, attention, KV cache,
sampler: every sequence), ranks 1..N-1 are processes it spawns that hold their slots' routed experts and take
their part in every MoE exchange of rank 0's forwards.

    rank 0 (Engine)                            ranks 1..N-1 (serve())
      forward: announce(GO)  ---------------->   GO: every layer's exchange with no rows of their own (idle)
      a plan between steps: announce(PLAN)   ->   PLAN: the placement's bytes, then apply (weights move)
      close: announce(STOP)  ---------------->   STOP: leave

The worker thus stays one bus worker with one cache and one block layout: only the routed experts are spread.
Data-parallel attention (dp.py: each rank its own sequences) is the next step for serving; it needs rank 0's
scheduler to place sequences on ranks and the KV export to read a rank's blocks.

The followers load the checkpoint themselves (from its path: no weights cross the pipe; dummy weights are drawn
alike by name, so every rank has the same numbers) and bring only their
share of the routed experts to their device (rank_model); they are daemonic (gone with rank 0's exit) and leave when rank 0's process does (a watchdog thread),
since a rank blocked in a collective would otherwise outlive a killed worker.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.codec import decode, encode
from shared.engine.loader import LoadedModel
from shared.engine.models.deepseek_v4 import DeepseekV4
from shared.engine.ops import Ops
from shared.engine.parallel.dp import PlacementPlan
from shared.engine.parallel.ep_moe import ExpertParallel
from shared.engine.parallel.group import Group, GroupConfig
from shared.engine.parallel.placement import Placement
from shared.models import ModelFiles

GO, PLAN, STOP = 1, 2, 0
EXPERT_MODELS = ("deepseek_v4",)  # architectures whose MoE layers parallel/ep_moe.py runs
# a follower waits for rank 0's next forward however long the worker idles (on NCCL that wait is a broadcast
# kernel left running on the follower's GPU: harmless, but it keeps the GPU busy-looking)
IDLE_TIMEOUT = datetime.timedelta(days=365)


def free_port() -> int:
    """A loopback port free now, for the group's rendezvous (rank 0 binds it as the ranks join)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_device(leader: torch.device, rank: int) -> torch.device:
    """Rank r on the CPU, or on the GPU r places after rank 0's."""
    return leader if leader.type == "cpu" else torch.device("cuda", (leader.index or 0) + rank)


class ExpertServers:
    """Rank 0's side: the group, the follower processes, the announcements."""

    def __init__(self, model, files: ModelFiles, world: int, device: torch.device, dtype: torch.dtype,
                 keep_quantized: bool, port: int, load_format: str = "auto") -> None:
        ctx = mp.get_context("spawn")  # rank 0 may be a service with threads: never fork it
        ready = ctx.Queue()
        self.procs = [ctx.Process(target=serve, args=(r, world, port, files, str(rank_device(device, r)),
                                                      str(dtype).removeprefix("torch."), keep_quantized, load_format,
                                                      os.getpid(), ready), daemon=True, name=f"experts-rank-{r}")
                      for r in range(1, world)]
        for p in self.procs:
            p.start()
        _await_loaded(self.procs, ready)
        # "cuda" names no GPU; NCCL binds each rank to one (rank r: rank_device)
        self.group = Group(GroupConfig(0, world, "127.0.0.1", port, rank_device(device, 0)), timeout=IDLE_TIMEOUT)
        self.ep = expert_parallel(model, self.group)
        self.ep.announce = self._go
        self._code = torch.zeros(1, dtype=torch.int64, device=self.group.device)

    def _send(self, code: int) -> None:
        self._code.fill_(code)
        dist.broadcast(self._code, 0)

    def _go(self) -> None:
        self._send(GO)

    def apply(self, placement: Placement) -> int:
        """Between two steps (the engine thread): every rank switches to `placement`; bytes rank 0 received."""
        self.ep.check(placement)
        self._send(PLAN)
        self.group.broadcast_bytes(encode(PlacementPlan(placement.version, placement.slots_per_rank,
                                                        [list(row) for row in placement.physical])))
        return self.ep.apply(placement)

    def close(self) -> None:
        self._send(STOP)
        for p in self.procs:
            p.join(timeout=30)
        self.group.close()


def rank_model(loaded: LoadedModel, world: int, rank: int, device: torch.device, dtype: torch.dtype,
               ops: Ops | None) -> DeepseekV4:
    """A rank's model: everything but the routed experts of other ranks' slots under the even split, which never
    reach its device (ValueError for a model without routed experts, or experts that do not split evenly)."""
    if loaded.config.arch not in EXPERT_MODELS:
        raise ValueError(f"expert_parallel {world}: {loaded.config.arch} has no routed experts to spread")
    num_experts = loaded.config.spec.num_experts
    if num_experts % world:
        raise ValueError(f"expert_parallel {world}: the model's {num_experts} routed experts must split evenly "
                         "over the ranks")
    per = num_experts // world
    return DeepseekV4(loaded.config, loaded.weights, device, dtype, ops,
                      held_experts=range(rank * per, (rank + 1) * per))


def expert_parallel(model: DeepseekV4, group: Group) -> ExpertParallel:
    """The model's main layers on the even split, attached."""
    s = model.spec
    ep = ExpertParallel(group, Placement.even(s.num_layers, s.num_experts, group.world),
                        [layer.experts for layer in model.layers], s.swiglu_limit, model.dtype, model.triton,
                        loaded=model.held_experts)
    ep.attach(model)
    return ep


def _await_loaded(procs: list, ready) -> None:
    """Until every follower has loaded its model: a follower that fails (or dies) fails rank 0 here, before
    the group forms, rather than leaving it waiting in a rendezvous."""
    waiting = len(procs)
    while waiting:
        try:
            rank, error = ready.get(timeout=1.0)
        except queue.Empty:
            dead = [p.name for p in procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"expert-parallel ranks {dead} exited while loading") from None
            continue
        if error is not None:
            raise RuntimeError(f"expert-parallel rank {rank} could not load the model: {error}")
        waiting -= 1


def serve(rank: int, world: int, port: int, files: ModelFiles, device: str, dtype: str, keep_quantized: bool,
          load_format: str, parent: int, ready) -> None:
    """A follower's life: load, say so, join, then rank 0's announcements until STOP."""
    from shared.engine.loader import load
    from shared.engine.ops import select_ops

    _leave_with(parent)
    dev = torch.device(device)
    try:
        loaded = load(files, keep_quantized=keep_quantized, load_format=load_format, device=dev)  # dummy: drawn there
        model = rank_model(loaded, world, rank, dev, getattr(torch, dtype), select_ops(dev, "auto"))
    except Exception as exc:  # told to rank 0, which fails its engine's construction with it
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        return
    del loaded
    ready.put((rank, None))
    group = Group(GroupConfig(rank, world, "127.0.0.1", port, dev), timeout=IDLE_TIMEOUT)
    ep = expert_parallel(model, group)
    code = torch.zeros(1, dtype=torch.int64, device=dev)
    while True:
        dist.broadcast(code, 0)
        if int(code) == GO:
            ep.idle(model.spec)
        elif int(code) == PLAN:
            p = decode(PlacementPlan, group.broadcast_bytes(None))
            ep.apply(Placement(ep.placement.experts, world, p.slots_per_rank,
                               tuple(tuple(row) for row in p.physical), p.version))
        else:
            break
    group.close()


def _leave_with(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="leave-with-rank-0").start()
