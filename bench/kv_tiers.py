"""Block write and read throughput of each kvcache tier against the raw disk, measured in one run on one filesystem.

    .venv/bin/python bench/kv_tiers.py [--dir DIR] [--total-mib 256] [--repeat 3] [--out results.md]

raw:    one large file written in 8 MiB writes and fsync'ed; read back in 8 MiB reads after its pages were dropped
        from the page cache (posix_fadvise DONTNEED): the disk's sequential bandwidth as Python sees it.
        Every read, raw or tier, starts with the pages dropped; each is done twice and the better one kept.
ram:    RamTier put / get: the tier's bookkeeping only (it keeps references, so no bytes move).
lmdb:   LmdbTier put (long-term blocks, one write transaction each) + env sync; get after dropping data.mdb's pages.
ssd:    SsdTier put + the sweep's fdatasync (sealed segments are synced when sealed); get after dropping every
        segment's pages, 16 blocks per get (a prefix run), checksums verified.
files:  the layout the SSD tier did not take, for the record: one file per block (write to a temp name, rename;
        one syncfs at the end), read back cold with open / read / checksum / close.

Writes count until the data is on disk (the sync is timed), like the raw figure; every measurement starts after an
os.sync(), so none pays for the write-back of another. Every tier figure is paired with a raw figure measured right
next to it (same round, order alternating), because a cloud VM's disk drifts by several times within a minute:
the table gives the best of `--repeat` rounds (the disk's capability with the least interference) and, beside it,
the median over rounds of tier / paired raw.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.kvcache.malloc import retain_freed_memory  # noqa: E402
from services.kvcache.tiers.lmdb import LmdbTier  # noqa: E402
from services.kvcache.tiers.ram import RamTier  # noqa: E402
from services.kvcache.tiers.ssd import SsdTier  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [("64 KiB", 64 * KiB), ("737 KiB", 737 * KiB), ("3.5 MiB", 3584 * KiB)]  # 737 KiB: a SmolLM2 fp32 block
RUN = 16  # blocks per get: a prefix run
CHUNK = 8 * MiB


@dataclass
class Case:
    """One layout loaded with one block size: `write` stores every block (and syncs), `read` reads them back."""

    write: Callable[[], None]
    read: Callable[[], None]
    drop: Callable[[], None]  # drop its pages from the page cache before a read
    nbytes: int
    blocks: int
    close: Callable[[], None] = lambda: None


def timed(fn: Callable[[], None]) -> float:
    os.sync()  # start clean: no write-back of an earlier measurement's data inside this one
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- raw disk ------------------------------------------------------------------------------------------------------


def raw(root: Path, total: int) -> Case:
    path = root / "raw.bin"
    data = os.urandom(CHUNK)
    n = total // CHUNK

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(n):
            os.write(fd, data)
        os.fsync(fd)
        os.close(fd)

    def read() -> None:
        buf = bytearray(CHUNK)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    return Case(write, read, lambda: drop_cache([path]), n * CHUNK, n)


# --- tiers ---------------------------------------------------------------------------------------------------------


def payloads(size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(4)]


def keys(n: int) -> list[bytes]:
    return [b"blk-%032x" % i for i in range(n)]


Tier = RamTier | LmdbTier | SsdTier


def tier_case(open_tier: Callable[[], Tier], size: int, n: int, files: Callable[[], list[Path]]) -> Case:
    blobs, ks = payloads(size), keys(n)
    now = time.time()
    tier = [open_tier()]

    def write() -> None:
        for i, k in enumerate(ks):
            assert tier[0].put(k, blobs[i % 4], 0.0, now)
        tier[0].sweep(now)  # LMDB: env sync; SSD: fdatasync of the active segment (sealed ones were synced on sealing)

    def read() -> None:
        for at in range(0, n, RUN):
            got = tier[0].get(ks[at : at + RUN], now)
            assert all(g is not None for g in got)

    def drop() -> None:
        # Reopened first: LMDB maps its file, and DONTNEED leaves mapped pages in the cache; the SSD tier's reopen
        # reads every record header, which must not leave pages cached either.
        if files():
            tier[0].close()
            tier[0] = open_tier()
            drop_cache(files())

    return Case(write, read, drop, n * size, n, lambda: tier[0].close())


def ram(root: Path, size: int, n: int) -> Case:
    tier = RamTier(capacity_bytes=2 * n * (size + 4096))
    return tier_case(lambda: tier, size, n, lambda: [])


def lmdb_tier(root: Path, size: int, n: int) -> Case:
    path = root / "lmdb"
    capacity = 2 * n * (size + 4096)
    return tier_case(
        lambda: LmdbTier(path, capacity_bytes=capacity, map_size=2 * capacity + (64 << 20)),
        size,
        n,
        lambda: [path / "data.mdb"],
    )


def ssd_tier(root: Path, size: int, n: int) -> Case:
    path = root / "ssd"
    capacity = 2 * n * (size + 4096)
    return tier_case(
        lambda: SsdTier(path, capacity_bytes=capacity, ttl_s=7 * 86400.0), size, n, lambda: sorted(path.glob("*.seg"))
    )


def file_per_block(root: Path, size: int, n: int) -> Case:
    path = root / "files"
    path.mkdir()
    blobs, ks = payloads(size), keys(n)
    names = [path / (k.decode() + ".blk") for k in ks]

    def write() -> None:
        for i, (k, name) in enumerate(zip(ks, names)):
            data = blobs[i % 4]
            tmp = name.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.writev(fd, [zlib.crc32(data, zlib.crc32(k)).to_bytes(4, "little"), data])
            os.close(fd)
            os.rename(tmp, name)
        dfd = os.open(path, os.O_RDONLY)
        ctypes.CDLL("libc.so.6", use_errno=True).syncfs(dfd)  # os.syncfs needs Python 3.12
        os.close(dfd)

    def read() -> None:
        for k, name in zip(ks, names):
            fd = os.open(name, os.O_RDONLY)
            raw_bytes = os.read(fd, size + 4)
            os.close(fd)
            assert zlib.crc32(memoryview(raw_bytes)[4:], zlib.crc32(k)) == int.from_bytes(raw_bytes[:4], "little")

    return Case(write, read, lambda: drop_cache(names), n * size, n)


LAYOUTS: dict[str, Callable[[Path, int, int], Case]] = {
    "ram": ram,
    "lmdb": lmdb_tier,
    "ssd": ssd_tier,
    "files (not used)": file_per_block,
}


@dataclass
class Pair:
    """One layout's write and read seconds next to raw's, measured back to back (order alternating by round)."""

    nbytes: int
    blocks: int
    write_s: float
    read_s: float
    raw_write_mbs: float
    raw_read_mbs: float

    @property
    def write_mbs(self) -> float:
        return self.nbytes / self.write_s / 1e6

    @property
    def read_mbs(self) -> float:
        return self.nbytes / self.read_s / 1e6


def measure(layout: Callable[[Path, int, int], Case], size: int, total: int, base: Path, raw_first: bool) -> Pair:
    root = Path(tempfile.mkdtemp(prefix="kv-tiers-", dir=base))
    try:
        cases = [raw(root, total), layout(root, size, max(RUN, total // size))]
        order = cases if raw_first else cases[::-1]
        write_s = {id(c): timed(c.write) for c in order}
        # Each read twice (raw, tier, tier, raw), the better one kept: the first read after a big write often meets
        # the virtual disk still writing back, whichever layout goes first.
        read_s: dict[int, float] = {}
        for c in order + order[::-1]:
            c.drop()
            read_s[id(c)] = min(read_s.get(id(c), float("inf")), timed(c.read))
        for c in cases:
            c.close()
        base_case, case = cases
        return Pair(
            case.nbytes,
            case.blocks,
            write_s[id(case)],
            read_s[id(case)],
            base_case.nbytes / write_s[id(base_case)] / 1e6,
            base_case.nbytes / read_s[id(base_case)] / 1e6,
        )
    finally:
        shutil.rmtree(root)


# --- report --------------------------------------------------------------------------------------------------------


def describe_disk(root: Path) -> str:
    try:
        df = subprocess.run(["df", "-T", str(root)], capture_output=True, text=True, check=True).stdout.split("\n")[1]
        device, fstype = df.split()[:2]
        name = Path(device).name
        rotational = Path(f"/sys/block/{name}/queue/rotational").read_text().strip()
        model = Path(f"/sys/block/{name}/device/model")
        kind = model.read_text().strip() if model.exists() else "virtual block device"
        return f"{device} ({fstype}; {kind}; rotational flag {rotational})"
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def describe_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(results: dict[tuple[str, str], list[Pair]], total_mib: int, rounds: int, malloc: str, base: Path) -> str:
    pairs = [pair for runs in results.values() for pair in runs]
    raw_w = [pair.raw_write_mbs for pair in pairs]
    raw_r = [pair.raw_read_mbs for pair in pairs]
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"machine: {os.cpu_count()} vCPUs ({describe_cpu()}), {ram_gib:.0f} GiB RAM, "
        f"Python {platform.python_version()}",
        f"disk: {describe_disk(base)}",
        f"rounds: {rounds}, {total_mib} MiB per measurement; malloc: {malloc}",
        "",
        f"raw sequential disk ({total_mib} MiB in 8 MiB I/O, measured next to every tier figure): "
        f"write+fsync {spread(raw_w)}; cold read {spread(raw_r)}",
        "",
        "MB/s and blocks/s: best of the rounds. % raw: best tier / best of its paired raw figures; in brackets the",
        "median over rounds of tier / the raw figure measured next to it.",
        "",
        "| tier | block | write MB/s | write blocks/s | write % raw | read MB/s | read blocks/s | read % raw |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, label), runs in results.items():
        w = max(r.write_mbs for r in runs)
        rd = max(r.read_mbs for r in runs)
        wb = max(r.blocks / r.write_s for r in runs)
        rb = max(r.blocks / r.read_s for r in runs)
        wp = rp = "-"
        if name != "ram":
            med_w = 100 * statistics.median(r.write_mbs / r.raw_write_mbs for r in runs)
            med_r = 100 * statistics.median(r.read_mbs / r.raw_read_mbs for r in runs)
            wp = f"{100 * w / max(r.raw_write_mbs for r in runs):.0f} % ({med_w:.0f} %)"
            rp = f"{100 * rd / max(r.raw_read_mbs for r in runs):.0f} % ({med_r:.0f} %)"
        lines.append(f"| {name} | {label} | {w:,.0f} | {wb:,.0f} | {wp} | {rd:,.0f} | {rb:,.0f} | {rp} |")
    return "\n".join(lines)


def spread(mbs: list[float]) -> str:
    return f"best {max(mbs):,.0f} MB/s, median {statistics.median(mbs):,.0f} (range {min(mbs):,.0f}-{max(mbs):,.0f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where to write (default: temp dirs under the current one)")
    p.add_argument("--total-mib", type=int, default=256, help="bytes written per measurement")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the report here (markdown)")
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's trim thresholds as they are")
    args = p.parse_args()
    malloc = "glibc defaults" if args.default_malloc else f"retain_freed_memory() = {retain_freed_memory()}"
    base = Path(args.dir or ".")
    results: dict[tuple[str, str], list[Pair]] = {}
    for round_ in range(args.repeat):
        for label, size in SIZES:
            for name, layout in LAYOUTS.items():
                pair = measure(layout, size, args.total_mib * MiB, base, raw_first=round_ % 2 == 0)
                results.setdefault((name, label), []).append(pair)
        print(f"round {round_ + 1}/{args.repeat} done", flush=True)
    text = report(results, args.total_mib, args.repeat, malloc, base)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
