"""Streams under faults, shared by the chaos tests (test_mesh_chaos.py) and bench/chaos.py.

A workload is a list of streaming chat requests that each have one right answer: greedy or seeded, with
`ignore_eos` so every answer is exactly `max_tokens` long. `stream_all` runs them concurrently through the
gateway and records, per stream, its text, its chunks' arrival times and how it ended; a fault is a coroutine
run alongside (`during`) that watches the streams' progress and strikes when it chooses. Comparing the texts
with those of a fault-free run of the same workload says whether a fault cost any stream anything.
"""

from __future__ import annotations

import asyncio
import difflib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.schemas.balancer import BalancerStats, BalancerStatsReply
from shared.schemas.health import HealthReply, HealthRequest
from shared.service import health_subject
from tests.integration.mesh import pids_mentioning

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Streamed:
    """One stream as the client saw it."""

    chunks: list[str] = field(default_factory=list)  # content deltas, in order
    times: list[float] = field(default_factory=list)  # monotonic arrival of each
    started: float = 0.0
    ended: float = 0.0
    status: int = 0
    error: str = ""  # the error frame's (or response's) message; "" = completed
    completion_tokens: int = 0  # the usage the mesh reported

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def ttft(self) -> float:
        return self.times[0] - self.started if self.times else 0.0

    @property
    def max_gap(self) -> float:
        """The longest silence between two chunks: the stall a fault caused mid-stream."""
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


def workload(n: int, max_tokens: int, *, prompt_lines: int = 6, tag: str = "") -> list[dict[str, Any]]:
    """`n` requests, half greedy, half seeded sampling, each with a prompt of its own."""
    bodies = []
    for i in range(n):
        story = " ".join(f"Line {j}: keeper {i} of the {tag} light counted {i + j} ships." for j in range(prompt_lines))
        sampling: dict[str, Any] = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i}
        bodies.append({
            "model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"{story} Now tell story {i} of the keeper."}], **sampling,
        })
    return bodies


async def stream_one(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], out: Streamed) -> Streamed:
    out.started = time.monotonic()
    try:
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as r:
            out.status = r.status
            if r.status != 200:
                out.error = (await r.text())[:300]
                return out
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))
                    continue
                if chunk.get("usage"):
                    out.completion_tokens = chunk["usage"]["completion_tokens"]
                content = "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
                if content:
                    out.chunks.append(content)
                    out.times.append(time.monotonic())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out.error = f"client: {exc!r}"
    finally:
        out.ended = time.monotonic()
    return out


Fault = Callable[[Sequence[Streamed]], Awaitable[None]]


async def stream_all(base_url: str, bodies: Sequence[dict[str, Any]], during: Fault | None = None,
                     timeout_s: float = 180.0) -> list[Streamed]:
    """Every body streamed at once; `during` runs meanwhile, watching the streams as they fill in."""
    streams = [Streamed() for _ in bodies]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        tasks = [asyncio.create_task(stream_one(session, base_url, b, s)) for b, s in zip(bodies, streams)]
        fault = asyncio.create_task(during(streams)) if during is not None else None
        await asyncio.gather(*tasks)
        if fault is not None:
            await fault  # (raises what the fault raised)
    return streams


async def until_started(streams: Sequence[Streamed], chunks: int, timeout_s: float = 120.0) -> None:
    """Wait until every stream that has not ended has at least `chunks` chunks (a bound on a failure only)."""
    deadline = time.monotonic() + timeout_s
    while not all(len(s.chunks) >= chunks or s.ended for s in streams):
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not reach {chunks} chunks")
        await asyncio.sleep(0.02)


def instance_pid(state_dir: str, instance: str) -> int:
    """The live process of one service instance (`--instance decode-1`) of the mesh under `state_dir`."""
    mark = f"--instance {instance} "
    found = [p for p in pids_mentioning(state_dir)
             if mark in open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace") + " "]
    (pid,) = found
    return pid


async def worker_health(nats_url: str, role: str, instance: str, bus: Bus | None = None) -> dict[str, Any]:
    """A worker's health report ({} while it is not ready, or not there: killed, restarting); on `bus` when given
    (a fault polling it often)."""
    own = bus is None
    bus = bus or await Bus.connect(nats_url, "chaos-health")
    try:
        reply = await bus.request(health_subject(role, instance), HealthRequest(), HealthReply, timeout=10)
        return orjson.loads(reply.detail) if reply.ready else {}
    except BusTimeout:
        return {}
    finally:
        if own:
            await bus.drain()


async def busiest(nats_url: str, role: str, instances: Sequence[str], bus: Bus | None = None) -> tuple[str, int]:
    """The instance of `role` with the most requests active, and how many."""
    active = {i: (await worker_health(nats_url, role, i, bus)).get("active", 0) for i in instances}
    instance = max(active, key=lambda i: active[i])
    return instance, active[instance]


async def until_idle(nats_url: str, workers: Sequence[tuple[str, str]], timeout_s: float = 60.0
                     ) -> dict[str, dict[str, Any]]:
    """Wait until every (role, instance) in `workers` that is up holds nothing: no request active, every KV block
    free (its prefix cache counts as free), nothing held for export or hand-over; their last reports ({} for one
    not up: a worker still loading holds nothing), idle or not (the wait bounds a failure only)."""
    bus = await Bus.connect(nats_url, "chaos-idle")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            reports = {i: await worker_health(nats_url, role, i, bus) for role, i in workers}
            if all(not r or (r["active"] == 0 and r["free_blocks"] == r["total_blocks"] and r["held"] == 0
                             and r["handover"].get("leases", 0) == 0) for r in reports.values()):
                return reports
            if time.monotonic() > deadline:
                return reports
            await asyncio.sleep(0.2)
    finally:
        await bus.drain()


async def balancer_stats(nats_url: str) -> BalancerStatsReply:
    bus = await Bus.connect(nats_url, "chaos-stats")
    try:
        return await bus.request(subjects.BALANCER_STATS, BalancerStats(), BalancerStatsReply, timeout=10)
    finally:
        await bus.drain()


async def until_workers(nats_url: str, role: str, count: int, timeout_s: float = 180.0) -> None:
    """Wait until the balancer has `count` workers of `role` in its pool (a restarted one is back)."""
    deadline = time.monotonic() + timeout_s
    while (await balancer_stats(nats_url)).workers.get(role, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} {role} workers after {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


def token_diff(expected: list[int], got: list[int]) -> tuple[int, int]:
    """(lost, extra) tokens between a fault-free answer and one under a fault: tokens of `expected` missing from
    `got`, and tokens of `got` not in `expected` (repeated or different). (0, 0) exactly when they are equal."""
    lost = extra = 0
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(a=expected, b=got, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost += a1 - a0
        if op in ("insert", "replace"):
            extra += b1 - b0
    return lost, extra
