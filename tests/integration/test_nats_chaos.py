"""Chaos on a `deepinfer up` stack (one stack for the module): the nats-server SIGKILLed mid-stream, and a service
that keeps dying.

- NATS: the launcher starts it again on the port it keeps in the state dir, with its JetStream store; the
  services reconnect and replay their stream messages, so every stream in flight completes with the fault-free
  text (a stream that could not would end with a 503 naming the bus); new requests are served by themselves.
- A crash loop (the kvcache killed each time it comes back): the launcher backs it off instead of stopping the
  stack, says so, shows it on the gateway's /metrics, and the rest of the mesh serves on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.launch.backoff import CRASH_LOOP_EXITS
from tests.integration.mesh import Mesh, pids_mentioning, start_mesh
from tests.integration.nats_chaos import cmdline, nats_restart_scenario, nats_server_pid

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = start_mesh(tmp_path_factory.mktemp("chaos"))
    yield mesh
    mesh.stop()


def ask(mesh: Mesh) -> str:
    client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    return reply.choices[0].finish_reason


def test_nats_killed_mid_stream_streams_complete_and_the_stack_serves_again(mesh: Mesh) -> None:
    url_before = mesh.nats_url
    result = asyncio.run(nats_restart_scenario(mesh.base_url, mesh.state_dir, model=MODEL, streams=3,
                                               max_tokens=120))
    assert len(result.reference) > 200
    for outcome in result.streams:  # (a stream that hung would end as "still running ... after the kill")
        assert outcome.ended_after_kill_s > 0, outcome  # it was streaming when the server died
        assert outcome.error == "" and outcome.finish_reason == "length", outcome
        assert outcome.text == result.reference  # no token lost, duplicated or changed
    assert result.recovered_after_s < 90, result
    said = "".join(mesh.output)
    assert f"nats-server exited with code -9; restarting it on {url_before}" in said
    assert f"nats-server is back on {url_before}" in said
    assert nats_server_pid(mesh.state_dir) != result.killed_pid
    for log in (mesh.state_dir / "logs").glob("*.log"):  # one line per change, not a traceback per attempt
        text = log.read_text()
        changes = [line.split("shared.bus: ", 1)[1] for line in text.splitlines()
                   if "shared.bus: " in line and "NATS" in line]
        connections = {change.split(":", 1)[0] for change in changes}  # a worker has a second one, for KV bytes
        assert log.stem in connections, log.stem
        for name in connections:
            assert sum(c.startswith(f"{name}: lost the NATS connection") for c in changes) == 1, changes
            assert sum(c.startswith(f"{name}: reconnected to NATS") for c in changes) == 1, changes
            assert sum(c.startswith(f"{name}: ") for c in changes) <= 3, changes
        assert "Traceback" not in text, (log.stem, text[-3000:])
    assert ask(mesh) in ("length", "stop")


def test_a_crash_looping_service_is_backed_off_and_the_rest_serves_on(mesh: Mesh) -> None:
    kills = 0
    deadline = time.monotonic() + 120
    while kills < CRASH_LOOP_EXITS and time.monotonic() < deadline:  # kill it each time it is back
        pids = [p for p in pids_mentioning(str(mesh.state_dir)) if "services.kvcache" in cmdline(p)]
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            kills += 1
            while pids[0] in pids_mentioning(str(mesh.state_dir)):
                time.sleep(0.05)
        time.sleep(0.1)
    assert kills == CRASH_LOOP_EXITS
    until_said = time.monotonic() + 30
    while "kvcache-0 exited with code -9; crash loop" not in "".join(mesh.output):
        assert time.monotonic() < until_said, "".join(mesh.output[-20:])
        time.sleep(0.1)
    assert mesh.process.poll() is None  # the stack did not stop
    metrics = scrape(mesh)
    assert metrics[("deepinfer_process_crash_looping", "kvcache-0")] == 1
    assert metrics[("deepinfer_process_restarts_total", "kvcache-0")] >= CRASH_LOOP_EXITS
    assert metrics[("deepinfer_process_crash_looping", "decode-0")] == 0
    assert ask(mesh) in ("length", "stop")  # a dead store reads as misses: the mesh serves on


def scrape(mesh: Mesh) -> dict[tuple[str, str], float]:
    import urllib.request

    with urllib.request.urlopen(f"{mesh.base_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, s.labels.get("instance", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("deepinfer_process_")}
