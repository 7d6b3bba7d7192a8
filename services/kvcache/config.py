"""kvcache settings, built once from CLI flags (the fields are the flags: shared/config.py `option`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shared.config import ServiceConfig, add_flags, option
from shared.config import from_args as flags_record

MiB = 1 << 20
GiB = 1 << 30
DAY_S = 86400.0


@dataclass(frozen=True)
class KvCacheConfig:
    root: Path  # <state_dir>/kvcache: the LMDB environment, and the SSD tier's segments under ssd/
    # LMDB: short-term entries (and warm blocks) beyond this evict warm blocks
    capacity_bytes: int = option(4 * GiB, help="LMDB bytes stored before eviction")
    # LMDB's address-space reservation: sparse on disk, must exceed the capacity
    map_size: int = option(16 * GiB, help="LMDB map size in bytes (sparse)")
    # longest life of a short-term entry; a put asking for more is clamped
    tail_ttl_s: float = option(180.0, help="longest TTL of a short-term entry, s")
    sweep_interval_s: float = 2.0  # expired entries go, the SSD tier syncs and access times persist this often
    ram_bytes: int = option(1 * GiB, help="RAM tier size in bytes (0: off)")  # hot copies
    # auto: the RAM tier's payloads in a /dev/shm heap same-host workers read by descriptor, where /dev/shm has
    # room for all of it; off: in process memory (same-host gets then copy into the worker's arena)
    ram_heap: str = option("auto", choices=("auto", "off"), env=True, help="RAM tier in shared memory: auto | off")
    # long-term blocks, on disk; 0 = long-term blocks live in LMDB
    ssd_bytes: int = option(32 * GiB, help="SSD tier size in bytes (0: off)")
    # a long-term block's life on the SSD tier, from when it was written
    ssd_ttl_days: float = option(7.0, help="life of a long-term block on SSD, days")
    # target size of one SSD segment file (the unit of eviction)
    ssd_segment_bytes: int = option(64 * MiB, help="SSD segment file size")
    max_lease_s: float = option(30.0, help="longest lease kv.lookup grants, s")
    instance: str = "kvcache"

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError("--capacity-bytes must be positive")
        # Deleted pages are reused, not returned, and big values need contiguous runs of free pages: leave
        # LMDB room beyond the capacity so fragmentation does not fill the map first.
        if self.map_size < self.capacity_bytes + self.capacity_bytes // 4:
            raise ValueError("--map-size must be at least 1.25 x --capacity-bytes")
        if self.tail_ttl_s <= 0 or self.sweep_interval_s <= 0:
            raise ValueError("--tail-ttl and the sweep interval must be positive")
        if self.ram_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError("--ram-bytes and --ssd-bytes must be 0 (off) or positive")
        if self.ssd_ttl_days <= 0 or self.ssd_segment_bytes <= 0:
            raise ValueError("--ssd-ttl-days and --ssd-segment-bytes must be positive")
        if self.max_lease_s < 0:
            raise ValueError("--max-lease must not be negative")
        if self.ram_heap not in ("auto", "off"):
            raise ValueError("--ram-heap must be auto or off")

    @property
    def segment_bytes(self) -> int:
        """The segment size used: at most an eighth of the SSD capacity, so eviction has segments to choose."""
        return max(1, min(self.ssd_segment_bytes, self.ssd_bytes // 8))


def add_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, KvCacheConfig)


def from_args(common: ServiceConfig, args: argparse.Namespace) -> KvCacheConfig:
    return flags_record(KvCacheConfig, args, root=common.state_dir / "kvcache", instance=common.instance)
