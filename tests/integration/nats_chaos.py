"""The NATS-restart fault against a running `deepinfer up` stack, for the chaos test and bench/chaos.py: a
fault-free stream for reference, then the same stream several times at once, the launcher's nats-server
SIGKILLed mid-stream, then how each stream ended (and whether its text is the reference's) and how long until the
stack served a new request by itself. Measures; asserts nothing (the caller judges).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

from tests.integration.mesh import pids_mentioning

PROMPT = "Tell me a long story about a lighthouse keeper and the ships she counted, one ship at a time."


@dataclass
class StreamOutcome:
    text: str = ""
    finish_reason: str = ""  # set when the stream ended normally
    error: str = ""  # what the client was told when it did not ("" if it finished)
    ended_after_kill_s: float = math.nan  # < 0: it had ended before the kill


@dataclass
class NatsRestartResult:
    reference: str = ""  # the same request's text without a fault (greedy: every stream's text should be it)
    streams: list[StreamOutcome] = field(default_factory=list)
    killed_pid: int = 0
    recovered_after_s: float = math.inf  # kill -> the first new request that succeeded (inf: none in time)
    refused_while_down: int = 0  # new requests answered with an error before the recovery (503s)


def nats_server_pid(state_dir: Path) -> int:
    """The pid of the nats-server `deepinfer up --state-dir state_dir` runs (its config lives in the state dir)."""
    pids = [pid for pid in pids_mentioning(str(state_dir)) if "nats-server" in cmdline(pid)]
    assert len(pids) == 1, f"expected one nats-server under {state_dir}, found {pids}"
    return pids[0]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def nats_restart_scenario(
    base_url: str,
    state_dir: Path,
    *,
    model: str,
    streams: int = 4,
    max_tokens: int = 400,
    api_key: str = "none",
    end_within_s: float = 120.0,
    recover_within_s: float = 90.0,
) -> NatsRestartResult:
    """Start `streams` chat streams (`max_tokens` each, EOS ignored so they run long), SIGKILL the stack's
    nats-server once every stream has sent text, wait (at most `end_within_s`) for each stream to end, then send a
    small request every half second until one succeeds (at most `recover_within_s`)."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=end_within_s)
    result = NatsRestartResult(streams=[StreamOutcome() for _ in range(streams)])
    started = [asyncio.Event() for _ in range(streams)]
    killed_at = math.nan

    async def stream(outcome: StreamOutcome, started: asyncio.Event) -> None:
        try:
            chunks = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens, stream=True,
                temperature=0.0, extra_body={"ignore_eos": True},
            )
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    outcome.text += chunk.choices[0].delta.content
                    started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcome.finish_reason = chunk.choices[0].finish_reason
        except openai.APIError as exc:
            outcome.error = f"{type(exc).__name__}: {exc.message}"
        except Exception as exc:  # a connection cut, a client timeout: still an outcome to report
            outcome.error = f"{type(exc).__name__}: {exc}"
        finally:
            started.set()
            outcome.ended_after_kill_s = time.monotonic() - killed_at if not math.isnan(killed_at) else -1.0

    try:
        reference = StreamOutcome()
        await stream(reference, asyncio.Event())
        result.reference = reference.text
        tasks = [asyncio.create_task(stream(result.streams[i], started[i])) for i in range(streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), end_within_s)
        result.killed_pid = nats_server_pid(state_dir)
        killed_at = time.monotonic()
        os.kill(result.killed_pid, signal.SIGKILL)
        done, hung = await asyncio.wait(tasks, timeout=end_within_s)
        for task in hung:
            task.cancel()
        for i, task in enumerate(tasks):
            if task in hung:
                result.streams[i].error = f"still running {end_within_s:g} s after the kill"
        deadline = killed_at + recover_within_s
        while time.monotonic() < deadline:
            try:
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, timeout=30)
                result.recovered_after_s = time.monotonic() - killed_at
                break
            except openai.APIError:
                result.refused_while_down += 1
                await asyncio.sleep(0.5)
    finally:
        await client.close()
    return result
