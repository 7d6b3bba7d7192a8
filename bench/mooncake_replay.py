"""Replay a Mooncake production trace through our kvcache store and prefill balancing policies.

    python bench/mooncake_replay.py --out bench/results/2026-11-30-mooncake-replay.md [--trace conversation]
        [--limit 4000] [--workers 4] [--rate 12000] [--speedup 1]

What is real and what is modelled:
  real      the chained block hash (shared/hashing.py) over prompts synthesised from the trace's `hash_ids`
            (equal hash ids = equal 512-token blocks, so equal prefixes hash equal; 128-token blocks as
            DeepSeek-V4's), the kvcache store (services/kvcache: RAM + LMDB + SSD tiers in a temp dir, small
            payloads, capacity in blocks), the balancer's prefill policies and their cost formula
            (services/balancer/policies: cache-aware least cost, round-robin, random)
  modelled  each prefill worker (a cost model, not the engine): one prompt at a time, FIFO, computing
            `--rate` tokens/s, loading store blocks at `--ram-rate` / `--ssd-rate` tokens/s, and a local prefix
            cache (an LRU of `--local-blocks` blocks: the engine's own GPU-resident prefix cache); time is
            virtual (the trace's timestamps / `--speedup`), so the run takes seconds, not the trace's hour

Per policy: TTFT (queueing + load + compute) mean / p50 / p90 / p99, where prompt blocks came from (the worker's
own cache, the store's RAM and SSD tiers, or compute), and the store's hit rate against two references over the
same sequence of lookups and writes: an infinite cache (every block ever written) and an LRU of the store's
capacity. Decode is not modelled (TTFT only).
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import platform
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.balancer.policies import POLICIES, Demand, PolicySettings  # noqa: E402
from services.balancer.registry import WorkerLoad  # noqa: E402
from services.kvcache.store import KvStore, Run  # noqa: E402
from services.kvcache.tiers.lmdb import LmdbTier  # noqa: E402
from services.kvcache.tiers.ram import RamTier  # noqa: E402
from services.kvcache.tiers.ssd import SsdTier  # noqa: E402
from shared import hashing  # noqa: E402
from shared.schemas.events import TIER_RAM, TIER_SSD  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake"
TRACE_BLOCK = 512  # tokens per trace hash id
BLOCK = 128  # our long-term block (DeepSeek-V4's)
PAYLOAD = b"\x00" * 64  # stand-in block payload: the store's bookkeeping is real, its bytes need not be
VOCAB = 129_280
DAY = 86_400.0


@dataclass
class Request:
    at: float  # arrival, s (virtual)
    tokens: int
    hashes: list[bytes]  # our chained block keys of its full 128-token blocks


def load_trace(name: str, limit: int, speedup: float) -> list[Request]:
    """Requests with our block keys: trace block h -> 512 tokens drawn from a generator seeded by h, so two
    requests share a prefix exactly when their hash ids do; keys continue the chain from block to block."""
    ns = hashing.namespace("mooncake-replay")
    memo: dict[tuple[int, int], list[bytes]] = {}  # (hash id, tokens used of it) -> our keys in that block
    out = []
    with (TRACES / f"{name}_trace.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            n, ids = row["input_length"], row["hash_ids"]
            keys: list[bytes] = []
            for i, h in enumerate(ids):
                used = min(TRACE_BLOCK, n - i * TRACE_BLOCK)
                if used < BLOCK:
                    break
                if (h, used) not in memo:  # a hash id stands for the whole prefix up to it (chained)
                    tokens = np.random.default_rng(h).integers(0, VOCAB, TRACE_BLOCK)[:used]
                    memo[(h, used)] = hashing.block_hashes(tokens, keys[-1] if keys else ns, BLOCK)
                keys += memo[(h, used)]
            out.append(Request(row["timestamp"] / 1e3 / speedup, n, keys))
            if len(out) == limit:
                break
    return out


class Lru:
    """A reference cache of `capacity` blocks (None: infinite), fed the same lookups and writes as the store."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def run(self, hashes: list[bytes]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.keys:
            self.keys.move_to_end(hashes[n])
            n += 1
        return n

    def put(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.keys[h] = None
            self.keys.move_to_end(h)
        while self.capacity is not None and len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


@dataclass
class Worker:
    worker_id: str
    local: Lru
    free_at: float = 0.0  # when its queue drains (virtual s)
    pending: list[tuple[float, int]] = field(default_factory=list)  # (finish, tokens) of queued prompts

    def queued_tokens(self, now: float, rate: float) -> int:
        return int(max(0.0, self.free_at - now) * rate)

    def load(self, now: float, rate: float) -> WorkerLoad:
        return WorkerLoad(self.worker_id, "prefill", "replay", self.queued_tokens(now, rate), 0, 1 << 30, 1 << 30,
                          block_tokens=BLOCK)


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    blocks: dict[str, int] = field(default_factory=lambda: {"local": 0, TIER_RAM: 0, TIER_SSD: 0, "computed": 0})
    store_hits: int = 0
    infinite_hits: int = 0
    lru_hits: int = 0
    looked_up: int = 0


def open_store(root: Path, args: argparse.Namespace, clock) -> KvStore:
    record = len(PAYLOAD) + 128  # payload + a tier's per-record header and key, generously
    return KvStore(
        ram=RamTier(capacity_bytes=args.ram_blocks * record),
        short_term=LmdbTier(root / "lmdb", capacity_bytes=64 << 20, map_size=256 << 20),
        # eviction drops a whole segment: 1/256 of the capacity, as the defaults have it (64 MiB of 16 GiB)
        long_term=SsdTier(root / "ssd", capacity_bytes=args.store_blocks * record, ttl_s=7 * DAY,
                          segment_bytes=max(64 << 10, args.store_blocks * record // 256)),
        max_ttl_s=180.0,
        clock=clock,
    )


def replay(requests: list[Request], policy_name: str, args: argparse.Namespace) -> Outcome:
    settings = PolicySettings(seed=args.seed)
    policy = POLICIES[policy_name](settings)
    workers = [Worker(f"prefill-{i}", Lru(args.local_blocks)) for i in range(args.workers)]
    rate = args.rate
    load_rate = {TIER_RAM: args.ram_rate, TIER_SSD: args.ssd_rate}
    now = [0.0]
    out = Outcome()
    infinite, lru = Lru(None), Lru(args.store_blocks)
    writes: list[tuple[float, int, list[bytes]]] = []  # (finish, seq, keys): the prefill stores its new blocks
    with tempfile.TemporaryDirectory(prefix="mooncake-replay-") as tmp:
        store = open_store(Path(tmp), args, lambda: now[0])
        try:
            for seq, req in enumerate(requests):
                while writes and writes[0][0] <= req.at:  # blocks written by prefills finished before it arrives
                    now[0], _, keys = heapq.heappop(writes)
                    for key in keys:
                        store.put(key, PAYLOAD)
                    infinite.put(keys)
                    lru.put(keys)
                now[0] = req.at
                usable = (req.tokens - 1) // BLOCK  # the last token is always computed
                hashes = req.hashes[:usable]
                run = store.lookup(hashes) if args.store else Run(0)
                out.looked_up += len(hashes)
                out.store_hits += run.hits
                out.infinite_hits += infinite.run(hashes)
                out.lru_hits += lru.run(hashes)
                local = {w.worker_id: w.local.run(hashes) for w in workers}
                # the store run past each worker's own, split over tiers as the whole run is (fastest first)
                tiers = [(t, n) for t in (TIER_RAM, TIER_SSD) for n in [run.by_tier.get(t, 0)] if n]
                store_tokens = {}
                for w in workers:
                    beyond = max(0, run.hits - local[w.worker_id])
                    split = {t: n * beyond // max(run.hits, 1) for t, n in tiers}
                    store_tokens[w.worker_id] = {t: n * BLOCK for t, n in split.items()}
                demand = Demand(req.tokens, cached_tokens={k: v * BLOCK for k, v in local.items()},
                                store_tokens=store_tokens)
                chosen = policy.choose([w.load(req.at, rate) for w in workers], demand)
                assert chosen is not None
                w = next(x for x in workers if x.worker_id == chosen.worker_id)
                mine = local[w.worker_id]
                loaded = store_tokens[w.worker_id]
                computed = req.tokens - mine * BLOCK - sum(loaded.values())
                service = computed / rate + sum(n / load_rate[t] for t, n in loaded.items())
                start = max(req.at, w.free_at)
                w.free_at = start + service
                out.ttft.append(w.free_at - req.at)
                out.blocks["local"] += mine
                for t, n in loaded.items():
                    out.blocks[t] += n // BLOCK
                out.blocks["computed"] += usable - mine - sum(n // BLOCK for n in loaded.values())
                w.local.put(req.hashes)  # the engine's prefix cache keeps the prompt's blocks
                heapq.heappush(writes, (w.free_at, seq, req.hashes))
        finally:
            store.close()
    return out


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else 0.0


def table(results: dict[str, Outcome], args: argparse.Namespace, n: int, elapsed: float) -> str:
    base = results.get("random")
    lines = [
        f"# Mooncake {args.trace} trace replay ({datetime.date.today()}, {platform.machine()}, "
        f"{len(results)} policies in {elapsed:.0f} s)",
        "",
        f"{n} requests (the first {n} of the trace), arrivals x{args.speedup:g}; {args.workers} prefill workers, "
        f"cost model: {args.rate:,.0f} computed tokens/s, loads at {args.ram_rate:,.0f} (RAM) / "
        f"{args.ssd_rate:,.0f} (SSD) tokens/s, local prefix cache {args.local_blocks:,} blocks each; "
        + (f"store: real tiers, RAM {args.ram_blocks:,} + SSD {args.store_blocks:,} blocks of {BLOCK} tokens."
           if args.store else "no shared store: each worker has only its own prefix cache."),
        "",
        "| policy | TTFT mean s | p50 | p90 | p99 | vs random (mean) | local blocks | RAM | SSD | computed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, o in results.items():
        total = sum(o.blocks.values()) or 1
        mean = float(np.mean(o.ttft))
        ratio = f"{float(np.mean(base.ttft)) / mean:.1f}x better" if base and name != "random" else "-"
        lines.append(
            f"| {name} | {mean:.2f} | {percentile(o.ttft, 50):.2f} | {percentile(o.ttft, 90):.2f} | "
            f"{percentile(o.ttft, 99):.2f} | {ratio} | {o.blocks['local'] / total:.1%} | "
            f"{o.blocks[TIER_RAM] / total:.1%} | {o.blocks[TIER_SSD] / total:.1%} | {o.blocks['computed'] / total:.1%} |"
        )
    o = next(iter(results.values()))  # the store sees the same lookups and writes whatever the policy
    lines += [
        "",
        "Store hit rate over the same lookups and writes (prompt blocks found / looked up):",
        "",
        "| store (RAM + SSD tiers) | infinite cache | LRU of the store's capacity | store / LRU |",
        "|---|---|---|---|",
        f"| {o.store_hits / o.looked_up:.2%} | {o.infinite_hits / o.looked_up:.2%} | "
        f"{o.lru_hits / o.looked_up:.2%} | {o.store_hits / max(o.lru_hits, 1):.1%} |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--trace", choices=("conversation", "synthetic"), default="conversation")
    ap.add_argument("--limit", type=int, default=0, help="first N requests (0 = all)")
    ap.add_argument("--speedup", type=float, default=1.0, help="arrivals this many times faster than the trace")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=12_000.0, help="prefill tokens/s per worker")
    ap.add_argument("--ram-rate", type=float, default=400_000.0, help="tokens/s loaded from the RAM tier")
    ap.add_argument("--ssd-rate", type=float, default=150_000.0, help="tokens/s loaded from the SSD tier")
    ap.add_argument("--local-blocks", type=int, default=4_000, help="each worker's own prefix cache")
    ap.add_argument("--ram-blocks", type=int, default=20_000)
    ap.add_argument("--store-blocks", type=int, default=200_000, help="the SSD tier's capacity")
    ap.add_argument("--no-store", dest="store", action="store_false",
                    help="workers' own prefix caches only (Mooncake's paper setting: no shared store to read)")
    ap.add_argument("--policies", default="random,round-robin,least-cost")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    started = time.perf_counter()
    requests = load_trace(args.trace, args.limit or 1 << 30, args.speedup)
    print(f"{len(requests)} requests, keys ready in {time.perf_counter() - started:.1f} s", flush=True)
    results = {}
    for name in args.policies.split(","):
        t = time.perf_counter()
        results[name] = replay(requests, name, args)
        print(f"{name}: mean TTFT {np.mean(results[name].ttft):.2f} s ({time.perf_counter() - t:.1f} s)", flush=True)
    out = table(results, args, len(requests), time.perf_counter() - started)
    print(out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(out)


if __name__ == "__main__":
    main()
