"""kvcache settings, built once from CLI flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shared.config import ServiceConfig

GiB = 1 << 30


@dataclass(frozen=True)
class KvCacheConfig:
    root: Path  # the LMDB environment directory
    capacity_bytes: int = 4 * GiB  # stored records (header + payload) beyond this evict long-term blocks
    map_size: int = 16 * GiB  # LMDB's address-space reservation: sparse on disk, must exceed the capacity
    tail_ttl_s: float = 180.0  # longest life of a short-term entry; a put asking for more is clamped
    sweep_interval_s: float = 2.0  # expired entries go and access times are persisted this often

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("--capacity-bytes must be positive")
        # Deleted pages are reused, not returned, and big values need contiguous runs of free pages: leave
        # LMDB room beyond the capacity so fragmentation does not fill the map first.
        if self.map_size < self.capacity_bytes + self.capacity_bytes // 4:
            raise ValueError("--map-size must be at least 1.25 x --capacity-bytes")
        if self.tail_ttl_s <= 0 or self.sweep_interval_s <= 0:
            raise ValueError("--tail-ttl and the sweep interval must be positive")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity-bytes", type=int, default=4 * GiB, help="bytes stored before eviction")
    parser.add_argument("--map-size", type=int, default=16 * GiB, help="LMDB map size in bytes (sparse)")
    parser.add_argument("--tail-ttl", type=float, default=180.0, help="longest TTL of a short-term entry, s")


def from_args(common: ServiceConfig, args: argparse.Namespace) -> KvCacheConfig:
    return KvCacheConfig(
        root=common.state_dir / "kvcache",
        capacity_bytes=args.capacity_bytes,
        map_size=args.map_size,
        tail_ttl_s=args.tail_ttl,
    )
