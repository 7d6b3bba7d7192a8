"""The bus against a real nats-server: typed messages, request/reply, work queues, trace propagation."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import pytest

from shared import codec, tracing
from shared.bus import KEEPALIVE_FAILURES, Bus, BusError, BusTimeout, Envelope, Reject, Retry


@dataclass(frozen=True)
class Ping:
    n: int
    note: str = ""


@dataclass(frozen=True)
class Pong:
    n: int


async def test_request_reply_and_bad_request(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "t")
    try:
        async def double(p: Ping) -> Pong:
            return Pong(p.n * 2)

        await bus.serve("t.double", Ping, double)
        assert await bus.request("t.double", Ping(21), Pong) == Pong(42)
        with pytest.raises(BusTimeout):  # a payload that fails the schema gets no reply
            await bus.request("t.double", {"n": "x"}, Pong, timeout=0.5)
    finally:
        await bus.drain()


async def test_a_failing_handler_is_an_error_reply_at_once(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "t")
    try:
        async def lookup(p: Ping) -> Pong:
            if p.n < 0:
                raise ValueError(f"no entry {p.n}\nsecond line")
            return Pong(p.n)

        await bus.serve("t.lookup", Ping, lookup)
        # a long timeout: an error reply ends these at once; without one they would raise BusTimeout, not BusError
        with pytest.raises(BusError, match=r"t\.lookup: ValueError: no entry -1$"):
            await bus.request("t.lookup", Ping(-1), Pong, timeout=60)
        with pytest.raises(BusError, match="bad request"):
            await bus.request("t.lookup", {"n": "x"}, Pong, timeout=60)
        assert await bus.request("t.lookup", Ping(5), Pong) == Pong(5)  # the responder still serves
    finally:
        await bus.drain()


async def test_a_job_whose_keepalive_keeps_failing_is_ended(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    bus = await Bus.connect(nats_url, "t")
    started, ended = asyncio.Event(), asyncio.Event()

    async def long_job(p: Ping, env: Envelope) -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # runs until something ends it
        except asyncio.CancelledError:
            ended.set()
            raise

    q = await bus.work_queue("work.test.long", "test-long", Ping, long_job, ack_wait=0.6)
    await bus.submit("work.test.long", Ping(1), msg_id="long-1")
    await asyncio.wait_for(started.wait(), 10)
    await q.stop()
    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        # the connection closes under the running job: every in_progress() fails from now on
        await bus.drain()
        await asyncio.wait_for(ended.wait(), 10)
    failures = [r for r in caplog.records if "keepalive" in r.getMessage() and "failed" in r.getMessage()]
    assert len(failures) >= KEEPALIVE_FAILURES  # each failed beat is logged, then the job is ended
    assert any("ending work on work.test.long" in r.getMessage() for r in caplog.records)


def test_codec_validates_types() -> None:
    assert codec.decode(Ping, codec.encode(Ping(3, "x"))) == Ping(3, "x")
    with pytest.raises(codec.SchemaError):
        codec.decode(Ping, codec.encode({"n": "three"}))
    with pytest.raises(codec.SchemaError):
        codec.decode(Ping, codec.encode({"note": "no n"}))
    with pytest.raises(codec.SchemaError):
        codec.decode(Ping, b"\xc1")


async def test_work_queue_ack_retry_reject(nats_url: str) -> None:
    tracing.setup("test", "t")
    bus = await Bus.connect(nats_url, "t")
    seen: list[int] = []
    attempts: dict[int, int] = {}
    done = asyncio.Event()
    parents: list[str] = []

    async def handle(p: Ping, env: Envelope) -> None:
        attempts[p.n] = attempts.get(p.n, 0) + 1
        parents.append(tracing.inject(env.trace).get("traceparent", ""))
        if p.n == 2 and attempts[p.n] == 1:
            raise Retry("try again", delay=0.1)
        if p.n == 3:
            raise Reject("never")
        seen.append(p.n)
        if sorted(seen) == [1, 2]:
            done.set()

    q = await bus.work_queue("work.test.q", "test-q", Ping, handle, concurrency=2)
    with tracing.tracer().start_as_current_span("root") as root:
        for n in (1, 2, 3):
            await bus.submit("work.test.q", Ping(n), msg_id=f"ping-{n}")
        await bus.submit("work.test.q", Ping(1), msg_id="ping-1")  # duplicate: dropped
    await asyncio.wait_for(done.wait(), 10)
    await asyncio.sleep(0.3)
    await q.stop()
    await bus.drain()
    assert sorted(seen) == [1, 2]
    assert attempts == {1: 1, 2: 2, 3: 1}
    trace_id = format(root.get_span_context().trace_id, "032x")
    assert all(trace_id in p for p in parents)


async def test_a_job_handed_on_is_never_redelivered_whatever_happens_after(nats_url: str) -> None:
    """Prefill hands its request to decode, then stores the prompt's KV: a failure or the worker's death during
    the store must not have the server redeliver the job (it would run again for a request that moved on)."""
    bus = await Bus.connect(nats_url, "t")
    runs: dict[int, int] = {}
    handed = asyncio.Event()

    async def handle(p: Ping, env: Envelope) -> None:
        runs[p.n] = runs.get(p.n, 0) + 1
        await env.handed_on()
        await env.handed_on()  # a second call is a no-op
        if p.n == 1:
            raise RuntimeError("the store failed after the hand-over")
        handed.set()
        await asyncio.sleep(3600)  # n == 2: the worker "dies" here, its queue stopped under it

    q = await bus.work_queue("work.test.handed", "test-handed", Ping, handle, ack_wait=1.0)
    for n in (1, 2):
        await bus.submit("work.test.handed", Ping(n), msg_id=f"handed-{n}")
    await asyncio.wait_for(handed.wait(), 10)
    await q.stop()
    again = await bus.work_queue("work.test.handed", "test-handed", Ping, handle, ack_wait=1.0)
    await asyncio.sleep(2.5)  # past the ack wait: an unacknowledged job would be back by now
    await again.stop()
    await bus.drain()
    assert runs == {1: 1, 2: 1}


async def test_key_value_bucket_typed_shared_and_retimed(nats_url: str) -> None:
    first, second = await Bus.connect(nats_url, "a"), await Bus.connect(nats_url, "b")
    try:
        mine = await first.key_value("t_kv", Ping, ttl_s=60)
        await mine.put("k-1", Ping(7, "x"))
        theirs = await second.key_value("t_kv", Ping, ttl_s=90)  # another instance, another TTL: the newest wins
        assert await theirs.get("k-1") == Ping(7, "x")  # the entries survive the change
        assert await mine.ttl_s() == 90
        await theirs.delete("k-1")
        assert await mine.get("k-1") is None and await mine.get("never") is None
        other = await first.key_value("t_kv", str, ttl_s=90)  # the same bucket read as another type
        await other.put("bad", "not a Ping")  # read as absent, never raised
        assert await mine.get("bad") is None
        assert mine.valid_key("resp_abc-1") and not mine.valid_key("a b") and not mine.valid_key("x.>")
    finally:
        await first.drain()
        await second.drain()


async def test_a_sibling_is_a_connection_of_its_own(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "t-main")
    sibling = await bus.sibling("kv")
    try:
        async def double(p: Ping) -> Pong:
            return Pong(p.n * 2)

        await bus.serve("t.sibling", Ping, double)
        assert await bus.request("t.sibling", Ping(3), Pong) == Pong(6)  # a round trip: the server has the SUB
        assert await sibling.request("t.sibling", Ping(4), Pong) == Pong(8)  # same server, same subjects
        await sibling.drain()
        assert not sibling.connected and bus.connected  # closing one leaves the other up
        assert await bus.request("t.sibling", Ping(5), Pong) == Pong(10)
    finally:
        await sibling.drain()
        await bus.drain()
