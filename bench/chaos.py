"""What a fault costs the streams under a steady load: streams completed, tokens lost or duplicated, added latency.

One mesh (`deepinfer up`, two prefill and two decode workers, SmolLM2 on whatever device it finds). A load is
`--requests` streaming chat requests (greedy and seeded, `ignore_eos`: each has one right answer of exactly
`--max-tokens` tokens) sent by `--concurrency` clients back to back. The load runs once fault-free (the
reference), then once per scenario with the fault struck a third of the way in; every stream is compared with
the reference answer of the same request:

    completed   streams that ended well (no error), of all
    identical   completed streams whose text is the reference's exactly
    lost / dup  tokens of the reference missing from the answer / tokens in the answer not in the reference
                (the texts re-encoded with the model's tokenizer and aligned; 0 / 0 exactly when identical)
    stall       the longest silence between two tokens, worst stream: reference -> under the fault
    ttft        the longest time to first token, worst stream: reference -> under the fault
    added       extra wall time of the streams the fault touched (in flight when it struck) over their reference
                run, median and worst (on a shared machine the load differs between runs: read it with the
                stall and TTFT columns, which are measured within each run)

A scenario is an async function in SCENARIOS: it gets the mesh and the load's live streams, strikes once when
it chooses, and returns a line saying what it did. After each, the bench waits until the mesh has every worker
back and serves (/health), so scenarios do not overlap (nats-kill: a NATS restart; recipe-kill: the recipe's).
Add one by writing the function and naming it there.

    .venv/bin/python bench/chaos.py [--requests 24] [--concurrency 6] [--max-tokens 32] [--scenarios decode-kill]
        [--deterministic]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.models import resolve  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402
from tests.integration.chaos import (  # noqa: E402
    MODEL,
    Streamed,
    busiest,
    instance_pid,
    stream_one,
    token_diff,
    until_workers,
    workload,
)
from tests.integration.mesh import Mesh, start_mesh  # noqa: E402
from tests.integration.nats_chaos import nats_server_pid  # noqa: E402

PREFILL = ("prefill-0", "prefill-1")
DECODE = ("decode-0", "decode-1")

Scenario = Callable[[Mesh, Sequence[Streamed]], Awaitable[str]]


async def _kill_busiest(mesh: Mesh, role: str, instances: Sequence[str]) -> str:
    """SIGKILL the worker of `role` holding the most requests, once one holds any."""
    deadline = time.monotonic() + 60
    while True:
        instance, active = await busiest(mesh.nats_url, role, instances)
        if active or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    os.kill(instance_pid(str(mesh.state_dir), instance), signal.SIGKILL)
    return f"SIGKILL {instance} ({active} requests active on it)"


async def decode_kill(mesh: Mesh, streams: Sequence[Streamed]) -> str:
    return await _kill_busiest(mesh, "decode", DECODE)


async def prefill_kill(mesh: Mesh, streams: Sequence[Streamed]) -> str:
    return await _kill_busiest(mesh, "prefill", PREFILL)


async def nats_kill(mesh: Mesh, streams: Sequence[Streamed]) -> str:
    """SIGKILL the stack's nats-server once every stream in flight has sent text: the launcher restarts it on its
    kept port, the services reconnect, and the streams resume from the replayed token messages. (`streams` holds
    every request of the load, those not sent yet too: only the ones in flight count.)"""
    deadline = time.monotonic() + 60
    flying: list[Streamed] = []
    while time.monotonic() < deadline:
        flying = [s for s in streams if s.started and not s.ended]
        if flying and all(s.chunks for s in flying):
            break
        await asyncio.sleep(0.05)
    pid = nats_server_pid(Path(mesh.state_dir))
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL nats-server (pid {pid}, {len(flying)} streams in flight)"


async def recipe_kill(mesh: Mesh, streams: Sequence[Streamed]) -> str:
    """SIGKILL the recipe once every stream in flight has sent text: the launcher restarts it and the gateway
    hands it each request with what its client has (PrepareRequest.resume); the streams go on from there."""
    deadline = time.monotonic() + 60
    flying: list[Streamed] = []
    while time.monotonic() < deadline:
        flying = [s for s in streams if s.started and not s.ended]
        if flying and all(s.chunks for s in flying):
            break
        await asyncio.sleep(0.05)
    os.kill(instance_pid(str(mesh.state_dir), "recipe-0"), signal.SIGKILL)
    return f"SIGKILL recipe-0 ({len(flying)} streams in flight)"


SCENARIOS: dict[str, Scenario] = {"decode-kill": decode_kill, "prefill-kill": prefill_kill, "nats-kill": nats_kill,
                                  "recipe-kill": recipe_kill}


@dataclass
class Run:
    streams: list[Streamed]  # by request index
    struck_at: float = 0.0  # monotonic time of the fault (0: none)
    what: str = ""


async def run_load(mesh: Mesh, bodies: Sequence[dict[str, Any]], concurrency: int,
                   scenario: Scenario | None = None) -> Run:
    """Every body once, `concurrency` at a time back to back; `scenario` strikes once a third have been sent."""
    run = Run([Streamed() for _ in bodies])
    next_index = 0
    third = asyncio.Event()

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < len(bodies):
            i, next_index = next_index, next_index + 1
            if i >= len(bodies) // 3:
                third.set()
            await stream_one(session, mesh.base_url, bodies[i], run.streams[i])

    async def strike() -> None:
        assert scenario is not None
        await third.wait()
        run.what = await scenario(mesh, run.streams)
        run.struck_at = time.monotonic()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        fault = asyncio.create_task(strike()) if scenario is not None else None
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        if fault is not None:
            await fault
    return run


@dataclass
class Row:
    scenario: str
    what: str
    streams: int
    completed: int
    identical: int
    lost: int
    duplicated: int
    stall_ref: float
    stall: float
    ttft_ref: float
    ttft: float
    added_median: float
    added_max: float
    touched: int


def compare(name: str, reference: Run, faulted: Run, encode: Callable[[str], list[int]]) -> Row:
    ref, got = reference.streams, faulted.streams
    completed = [i for i, s in enumerate(got) if s.ok]
    identical = [i for i in completed if got[i].text == ref[i].text]
    lost = dup = 0
    for i, s in enumerate(got):
        a, b = token_diff(encode(ref[i].text), encode(s.text))
        lost, dup = lost + a, dup + b
    t = faulted.struck_at
    touched = [i for i, s in enumerate(got) if t and s.started <= t <= s.ended]
    added = [(got[i].ended - got[i].started) - (ref[i].ended - ref[i].started) for i in touched]
    return Row(name, faulted.what, len(got), len(completed), len(identical), lost, dup,
               max(s.max_gap for s in ref), max(s.max_gap for s in got),
               max(s.ttft for s in ref), max(s.ttft for s in got),
               statistics.median(added) if added else 0.0, max(added, default=0.0), len(touched))


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| scenario | fault | completed | identical | lost / dup tokens | worst stall (ref -> fault) | "
        "worst TTFT (ref -> fault) | added latency, touched streams (median / max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.scenario} | {r.what} | {r.completed}/{r.streams} | {r.identical}/{r.streams} | "
            f"{r.lost} / {r.duplicated} | {r.stall_ref:.2f} s -> {r.stall:.2f} s | "
            f"{r.ttft_ref:.2f} s -> {r.ttft:.2f} s | "
            f"{r.added_median:+.2f} s / {r.added_max:+.2f} s ({r.touched} streams) |"
        )
    return "\n".join(lines)


async def bench(args: argparse.Namespace, mesh: Mesh) -> list[Row]:
    encode = load_tokenizer(resolve(MODEL)).encode
    bodies = workload(args.requests, args.max_tokens, prompt_lines=args.prompt_lines, tag="bench")
    await until_workers(mesh.nats_url, "prefill", 2)
    await until_workers(mesh.nats_url, "decode", 2)
    await run_load(mesh, bodies[: args.concurrency], args.concurrency)  # warm-up: first steps, caches
    reference = await run_load(mesh, bodies, args.concurrency)
    bad = [s.error for s in reference.streams if not s.ok]
    if bad:
        raise SystemExit(f"the fault-free run failed: {bad[:3]}")
    rows = []
    for name in args.scenarios:
        faulted = await run_load(mesh, bodies, args.concurrency, SCENARIOS[name])
        rows.append(compare(name, reference, faulted, encode))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        await until_workers(mesh.nats_url, "prefill", 2)  # the launcher restarts the victim
        await until_workers(mesh.nats_url, "decode", 2)
        await until_ready(mesh.base_url)  # (a restarted recipe too)
    return rows


async def until_ready(base_url: str, timeout_s: float = 180.0) -> None:
    """Wait until the gateway's /health says the mesh can serve (a recipe, a balancer, every worker role)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{base_url}/health") as r:
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the mesh is not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-lines", type=int, default=12, help="prompt length: ~15 tokens a line")
    p.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--out", type=Path, default=None, help="also write the results here (markdown)")
    p.add_argument("--deterministic", action="store_true",
                   help="workers with batch-invariant kernels (on a GPU: every stream identical across kills in bf16)")
    args = p.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="chaos-") as state:
        mesh = start_mesh(Path(state), "--prefill-workers", "2", "--decode-workers", "2",
                          *(["--deterministic"] if args.deterministic else []))
        try:
            rows = asyncio.run(bench(args, mesh))
        finally:
            mesh.stop()
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    header = (f"{time.strftime('%Y-%m-%d', time.gmtime(started))}, {platform.machine()}, {os.cpu_count()} CPUs "
              f"(load average at the end {load}), {MODEL}, {args.requests} requests x {args.max_tokens} tokens, "
              f"{args.concurrency} at a time, {args.prompt_lines * 15} or so prompt tokens"
              f"{', --deterministic' if args.deterministic else ''}")
    report = f"{header}\n\n{table(rows)}\n"
    print("\n" + report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
