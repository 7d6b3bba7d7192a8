"""The bus across a killed and restarted nats-server (a real one, SIGKILLed, on the port the launcher keeps): core
subscriptions, request/reply, work queues and KV buckets work again by themselves; `on_lost` fires once per
outage; the outage is two log lines per connection, not a traceback per attempt. A server that comes back
without its store (the consumer gone) gets a new consumer bound by the work queue itself.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.bus import Bus, Envelope
from shared.launch import natsserver
from tests.integration.buses import until


@dataclass(frozen=True)
class Job:
    n: int


@pytest.fixture
def server(tmp_path: Path) -> Iterator[natsserver.NatsServer]:
    state = tmp_path / "nats"
    server = natsserver.start(state, port=natsserver.persisted_port(state), log_file=tmp_path / "nats.log")
    yield server
    server.stop()


def kill(server: natsserver.NatsServer) -> None:
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()


async def test_everything_works_again_after_the_server_restarts(
    server: natsserver.NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="shared.bus")
    bus, other = await Bus.connect(server.url, "svc"), await Bus.connect(server.url, "peer")
    lost: list[int] = []
    bus.on_lost(lambda: lost.append(bus.losses))
    heard: list[int] = []
    done: list[int] = []

    async def on_note(job: Job, _: Envelope) -> None:
        heard.append(job.n)

    async def double(job: Job) -> Job:
        return Job(job.n * 2)

    async def work(job: Job, _: Envelope) -> None:
        done.append(job.n)

    try:
        await bus.subscribe("t.note", Job, on_note)
        await bus.serve("t.double", Job, double)
        queue = await bus.work_queue("work.t.jobs", "t-jobs", Job, work)
        bucket = await bus.key_value("t_kv", Job, ttl_s=60)
        await bucket.put("k", Job(1))
        await other.submit("work.t.jobs", Job(1), msg_id="j1")
        await until(lambda: done == [1], 10, "the first job")

        kill(server)
        await until(lambda: not bus.connected and not other.connected, 10, "both connections to notice")
        assert lost == [1]
        await asyncio.to_thread(server.restart)
        await until(lambda: bus.connected and other.connected, 15, "both connections to come back")

        for _ in range(50):  # JetStream answers a moment after the server does
            try:
                await other.submit("work.t.jobs", Job(2), msg_id="j2")
                break
            except Exception:
                await asyncio.sleep(0.2)
        await until(lambda: done == [1, 2], 15, "a job queued after the restart")
        assert await other.request("t.double", Job(21), Job, timeout=5) == Job(42)
        await other.publish("t.note", Job(7))
        await until(lambda: heard == [7], 5, "a core message after the restart")
        assert await bucket.get("k") == Job(1)  # the store was kept
        await bucket.put("k", Job(3))
        assert await bucket.get("k") == Job(3)
        await queue.stop()
    finally:
        await bus.drain()
        await other.drain()
    assert lost == [1]
    mine = [r for r in caplog.records if r.getMessage().startswith("svc:") and r.levelno >= logging.WARNING]
    said = [r.getMessage() for r in mine]
    assert said[0].startswith("svc: lost the NATS connection") and said[-1].startswith("svc: reconnected to NATS")
    assert len(said) <= 3, said  # lost, (unreachable: once), reconnected
    assert not any(r.exc_info for r in caplog.records if r.name == "shared.bus")


async def test_a_server_that_lost_its_store_gets_a_new_consumer(
    server: natsserver.NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    bus = await Bus.connect(server.url, "svc")
    done: list[int] = []

    async def work(job: Job, _: Envelope) -> None:
        done.append(job.n)

    try:
        queue = await bus.work_queue("work.t.wiped", "t-wiped", Job, work)
        await bus.submit("work.t.wiped", Job(1), msg_id="w1")
        await until(lambda: done == [1], 10, "the first job")
        kill(server)
        shutil.rmtree(server.store_dir)  # the stream and its consumer are gone with it
        await asyncio.to_thread(server.restart)
        await until(lambda: bus.connected, 15, "the connection to come back")
        for _ in range(50):
            try:
                await bus.ensure_work_stream()  # a submitting service makes the stream again (the recipe does)
                await bus.submit("work.t.wiped", Job(2), msg_id="w2")
                break
            except Exception:
                await asyncio.sleep(0.2)
        await until(lambda: done == [1, 2], 20, "a job through a consumer bound again")
        await queue.stop()
    finally:
        await bus.drain()
    assert any("bound the work queue to a new consumer" in r.getMessage() for r in caplog.records)


async def test_a_list_of_servers_connects_past_one_that_is_down(server: natsserver.NatsServer) -> None:
    dead = f"nats://127.0.0.1:{natsserver.persisted_port(server.store_dir.parent / 'other')}"  # a free port
    bus = await Bus.connect(f"{dead},{server.url}", "svc")
    try:
        assert bus.connected and bus.replicas == 1  # two servers known, not a cluster of three
        assert await bus.key_value("t_list", Job, ttl_s=60) is not None
    finally:
        await bus.drain()


async def test_a_handler_failing_for_the_bus_is_one_line_a_bug_keeps_its_traceback(
    server: natsserver.NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    import nats.errors

    bus = await Bus.connect(server.url, "svc")
    seen: list[int] = []

    async def work(job: Job, _: Envelope) -> None:
        seen.append(job.n)
        raise nats.errors.OutboundBufferLimitError if job.n == 1 else ValueError("a bug")

    try:
        queue = await bus.work_queue("work.t.fail", "t-fail", Job, work, max_deliver=1)
        await bus.submit("work.t.fail", Job(1), msg_id="f1")
        await bus.submit("work.t.fail", Job(2), msg_id="f2")
        await until(lambda: len([r for r in caplog.records if "work handler" in r.getMessage()]) == 2, 10, "both")
        await queue.stop()
    finally:
        await bus.drain()
    records = [r for r in caplog.records if "work handler" in r.getMessage()]
    (bus_down,) = [r for r in records if "while the bus was down" in r.getMessage()]
    assert bus_down.exc_info is None and "outbound buffer limit" in bus_down.getMessage()
    (bug,) = [r for r in records if "while the bus was down" not in r.getMessage()]
    assert bug.exc_info is not None and bug.levelname == "ERROR"


async def test_a_service_started_before_its_server_waits_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "late"
    port = natsserver.persisted_port(state)
    connecting = asyncio.create_task(Bus.connect(f"nats://127.0.0.1:{port}", "early"))
    await until(lambda: any("NATS unreachable" in r.getMessage() for r in caplog.records), 20, "the first attempt")
    assert not connecting.done()
    server = await asyncio.to_thread(natsserver.start, state, port=port)
    try:
        bus = await asyncio.wait_for(connecting, 30)
        assert bus.connected
        await bus.drain()
    finally:
        server.stop()
    said = [r for r in caplog.records if r.getMessage().startswith("early:") and r.levelno >= logging.WARNING]
    assert len(said) == 1 and not said[0].exc_info  # once, however many attempts it took


async def test_stream_messages_sent_around_an_outage_are_replayed(server: natsserver.NatsServer) -> None:
    receiver, sender = await Bus.connect(server.url, "recipe"), await Bus.connect(server.url, "worker")
    heard: list[int] = []

    async def on_token(job: Job, _: Envelope) -> None:
        heard.append(job.n)

    try:
        await receiver.subscribe("tokens.r1", Job, on_token)
        for _ in range(200):  # until the subscription has reached the server (another connection's)
            await sender.publish("tokens.r1", Job(0))
            await asyncio.sleep(0.05)
            if heard:
                break
        assert heard and set(heard) == {0}
        kill(server)
        await until(lambda: not sender.connected, 10, "the sender to notice")
        for n in range(1, 6):  # sent while the server is down: whoever is subscribed when they go out misses them
            await sender.publish("tokens.r1", Job(n))
        await asyncio.to_thread(server.restart)
        await until(lambda: set(heard) >= set(range(6)), 20, "every token, replayed")
    finally:
        await receiver.drain()
        await sender.drain()
    assert heard[0] == 0  # the receiver drops duplicates by index (the recipe does); the bus only resends
