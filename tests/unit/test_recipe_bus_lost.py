"""A recipe whose bus stays down past the grace ends every request that was in flight: a 503 naming the bus to the
gateway, a Cancel to the workers, its admission place freed (nothing could reach them, so waiting could only end
in the 600 s reaper's 504). A shorter outage ends nothing: the token streams are replayed. The real SmolLM2
tokenizer; a recording stand-in for the bus."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from services.recipe.admission import AdmissionLimits
from services.recipe.model import ServedModel
from services.recipe.service import BUS_LOST, RecipeService
from shared import subjects
from shared.schemas.gateway import ApiEvent, PrepareRequest
from shared.schemas.generate import Cancel

MODEL = "SmolLM2-135M-Instruct"


class RecordingBus:
    name = "recipe-t"
    connected = True

    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []
        self.submitted: list[str] = []

    async def subscribe(self, *args: Any, **kwargs: Any) -> object:
        return object()

    async def submit(self, subject: str, message: Any, *, msg_id: str) -> None:
        self.submitted.append(msg_id)

    async def publish(self, subject: str, message: Any, **kwargs: Any) -> None:
        self.published.append((subject, message))


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return ServedModel.load(MODEL)


async def test_a_lost_bus_ends_every_request_in_flight(model: ServedModel) -> None:
    recipe = RecipeService([MODEL], admission=AdmissionLimits(max_requests=2))
    recipe._models = {model.name: model}
    recipe._options = recipe._options.__class__(models={model.name: model.encoding})
    bus = RecordingBus()
    recipe._bus = bus  # type: ignore[assignment]
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True})
    for rid in ("a", "b"):
        assert (await recipe.prepare(PrepareRequest(rid, "chat", body, "tenant"))).ok
    assert bus.submitted == ["a", "b"]
    assert not (await recipe.prepare(PrepareRequest("c", "chat", body, "tenant"))).ok  # the bound is full

    recipe.outage_grace_s = 0.0
    recipe._on_bus_lost()  # the bus came back within the grace: nothing ends
    await asyncio.gather(*recipe._tasks)
    assert bus.published == [] and sorted(recipe._flights) == ["a", "b"]

    bus.connected = False
    recipe._on_bus_lost()  # and now it stays down
    await asyncio.gather(*recipe._tasks)
    await asyncio.gather(*recipe._tasks)  # (the ending tasks the first one spawned)
    events = {s: m for s, m in bus.published if isinstance(m, ApiEvent)}
    for rid in ("a", "b"):
        event = events[subjects.events(rid)]
        assert event.done and event.status == 503
        assert orjson.loads(event.body)["error"]["message"] == BUS_LOST
    assert sorted(m.request_id for _, m in bus.published if isinstance(m, Cancel)) == ["a", "b"]
    assert {m.reason for _, m in bus.published if isinstance(m, Cancel)} == {"bus lost"}
    assert (await recipe.prepare(PrepareRequest("d", "chat", body, "tenant"))).ok  # the places are free again
