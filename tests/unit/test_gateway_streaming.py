"""The event pump's ordering and endings, and the metrics text, without a broker."""

from __future__ import annotations

import asyncio

import pytest

from prometheus_client.parser import text_string_to_metric_families

from services.gateway.metrics import Metrics
from services.gateway.streaming import EventPump, PumpAborted, Reorder
from shared.bus import Envelope
from shared.schemas.gateway import ApiEvent, PrepareReply, Resume

ENV = Envelope(subject="events.r", trace=None)  # type: ignore[arg-type]


def ev(seq: int, done: bool = False) -> ApiEvent:
    return ApiEvent(request_id="r", seq=seq, frames=[f"data: {seq}\n\n".encode()], done=done)


def test_reorder_buffers_gaps_and_drops_duplicates() -> None:
    r = Reorder()
    assert r.push(ev(2)) == []
    assert r.push(ev(1)) == []
    assert r.held == 2
    assert [e.seq for e in r.push(ev(0))] == [0, 1, 2]
    assert r.push(ev(1)) == [] and r.push(ev(2)) == []  # duplicates
    assert r.push(ev(4)) == [] and r.push(ev(4)) == []
    assert [e.seq for e in r.push(ev(3))] == [3, 4]
    assert r.held == 0


async def test_pump_yields_in_order_times_out_and_aborts() -> None:
    pump = EventPump("r")
    for seq in (1, 0, 2):
        await pump._on_event(ev(seq, done=seq == 2), ENV)
    assert [(await pump.next(1.0)).seq for _ in range(3)] == [0, 1, 2]
    with pytest.raises(TimeoutError):
        await pump.next(0.05)

    waiting = asyncio.ensure_future(pump.next(10.0))
    await asyncio.sleep(0)
    pump.abort("gateway shutting down")
    with pytest.raises(PumpAborted, match="shutting down"):
        await asyncio.wait_for(waiting, 1.0)
    with pytest.raises(PumpAborted):  # and stays aborted
        await pump.next(10.0)


async def test_pump_holds_what_another_recipe_needs_and_drops_a_dead_recipes_events() -> None:
    """The tokens behind the events handed out (in seq order, not arrival order), the reply's seed and creation
    time, the latest migration: the Resume; after it only the new recipe's events (its epoch, seq from 0) count."""
    pump = EventPump("r")
    pump.accepted(PrepareReply(ok=True, recipe="boot-a", seed=5, created=9), now=1.0)
    await pump._on_event(ApiEvent("r", 1, token_ids=[3], migration=1, cached_tokens=16), ENV)
    await pump._on_event(ApiEvent("r", 3, token_ids=[99]), ENV)  # after a gap: not handed out, not counted
    await pump._on_event(ApiEvent("r", 0, token_ids=[1, 2]), ENV)
    assert [(await pump.next(1.0)).seq for _ in range(2)] == [0, 1]
    assert pump.resume() == Resume(seed=5, created=9, token_ids=[1, 2, 3], cached_tokens=16, migration=1, epoch=1)
    await pump._on_event(ApiEvent("r", 2, token_ids=[4]), ENV)  # the dead recipe's, late
    await pump._on_event(ApiEvent("r", 0, token_ids=[4], epoch=1), ENV)
    assert (await pump.next(1.0)).epoch == 1 and pump.token_ids == [1, 2, 3, 4]
    pump.accepted(PrepareReply(ok=True, recipe="boot-b", seed=0, created=0), now=2.0)
    assert (pump.recipe, pump.seed, pump.created, pump.accepted_at) == ("boot-b", 5, 9, 2.0)  # the first's stay


def test_metrics_text() -> None:
    m = Metrics()
    m.started()
    m.started()
    m.finished("chat", 200)
    m.cancelled('client "gone"')
    parsed = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in parsed.values() for s in f.samples}
    assert samples[("deepinfer_gateway_requests_total", (("api", "chat"), ("status", "200")))] == 1
    assert samples[("deepinfer_gateway_requests_in_flight", ())] == 1
    assert samples[("deepinfer_gateway_cancels_total", (("reason", 'client "gone"'),))] == 1
    assert parsed["deepinfer_gateway_requests_in_flight"].type == "gauge"
    assert all(f.documentation for f in parsed.values())
