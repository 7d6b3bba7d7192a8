"""The ranks of one worker as a torch.distributed process group, and the collectives the engine uses.

The same code runs gloo on CPU processes (the tests) and NCCL on GPUs: the backend follows the device. Every
collective is called by every rank in the same order (an MoE layer's exchange included, with zero rows when a
rank has none); a rank that skipped one would deadlock the group, not corrupt it."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupConfig:
    rank: int
    world: int
    address: str  # rank 0's rendezvous host, e.g. 127.0.0.1
    port: int
    device: torch.device

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside a world of {self.world}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port}")

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


class Group:
    """This process's place in the worker's ranks (the default process group: one worker per process tree)."""

    def __init__(self, config: GroupConfig, timeout: datetime.timedelta | None = None) -> None:
        """timeout: how long a collective may wait for the others (torch's default: 10 min on gloo)."""
        self.rank, self.world, self.device, self.backend = config.rank, config.world, config.device, config.backend
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)
        dist.init_process_group(config.backend, init_method=f"tcp://{config.address}:{config.port}",
                                rank=config.rank, world_size=config.world, timeout=timeout)

    def close(self) -> None:
        dist.destroy_process_group()

    def exchange_counts(self, send: torch.Tensor) -> list[int]:
        """send (world,) int64: rows this rank sends to each rank -> rows it receives from each (on the host:
        the all-to-all's split sizes; one small read-back per exchange)."""
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return recv.tolist()

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """x (sum(send), ...) rows grouped by destination rank -> (sum(recv), ...) grouped by source rank."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank src's bytes to every rank (length first, then the payload as a uint8 tensor)."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if self.rank == src and data
               else torch.empty(int(size), dtype=torch.uint8, device=self.device))
        if int(size):
            dist.broadcast(buf, src)
        return buf.cpu().numpy().tobytes()

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]
                 ) -> None:
        """Point-to-point transfers in one batch: (tensor, peer rank, tag) each; every rank passes the same
        transfers in the same order (a plan's, computed alike everywhere), so the pairs match."""
        ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
