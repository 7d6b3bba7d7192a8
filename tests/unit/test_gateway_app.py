"""The aiohttp app over a stand-in bus (no broker): authentication, unexpected failures and errors mid-stream, in
API format."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import orjson
import pytest
from aiohttp import test_utils

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from shared.bus import BusTimeout
from shared.schemas.gateway import ApiEvent, PrepareReply
from shared.schemas.generate import Cancel


def no_recipe() -> Any:
    raise BusTimeout("no responders")


class FakeBus:
    """Just enough of `Bus`: `request` runs `answer`, publishes are recorded."""

    connected = True
    losses = 0  # the bus's outage state, as shared.bus.Bus reports it: never lost
    back_at = 0.0

    def down_for(self) -> float:
        return 0.0

    def __init__(self, answer: Callable[[], Any] = no_recipe) -> None:
        self.answer = answer
        self.published: list[Any] = []

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        return self.answer()

    async def publish(self, subject: str, message: Any) -> None:
        self.published.append(message)


async def test_api_key_required_in_each_api_format() -> None:
    bus = FakeBus()
    app = build_app(bus, GatewayConfig(api_key="k"), ["m"])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post("/v1/chat/completions", data=b"{}")
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_api_key"

        resp = await client.post("/v1/messages", data=b"{}", headers={"x-api-key": "wrong"})
        assert resp.status == 401
        assert orjson.loads(await resp.read())["error"]["type"] == "authentication_error"

        assert (await client.get("/v1/models")).status == 401
        assert (await client.get("/metrics")).status == 200  # health and metrics stay open

        # The right key gets through to the mesh (which has no recipe here: 503, and a Cancel to be safe).
        resp = await client.post("/v1/messages", data=b"{}", headers={"x-api-key": "k"})
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "overloaded_error"
        resp = await client.post("/v1/chat/completions", data=b"{}", headers={"Authorization": "Bearer k"})
        assert resp.status == 503
    assert [type(m) for m in bus.published] == [Cancel, Cancel]


async def test_unexpected_failure_is_a_500_in_api_format_and_cancels() -> None:
    def broken() -> Any:
        raise RuntimeError("a bug")

    bus = FakeBus(broken)
    app = build_app(bus, GatewayConfig(), ["m"])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post("/v1/messages", data=b'{"model": "m"}')
        assert resp.status == 500
        assert (await resp.json())["error"]["type"] == "api_error"
        resp = await client.post("/v1/responses", data=b'{"model": "m"}')
        assert resp.status == 500
        assert (await resp.json())["error"]["type"] == "server_error"
    assert [m.reason for m in bus.published] == ["gateway error", "gateway error"]


CREATED = (b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1","object":"response",'
           b'"created_at":0,"status":"in_progress","model":"m","output":[]},"sequence_number":0}\n\n')


class SilentStreamBus(FakeBus):
    """Accepts every request as a stream, sends `CREATED` as its first event, then falls silent."""

    def __init__(self) -> None:
        super().__init__(lambda: PrepareReply(ok=True, stream=True))
        self._on_event: Callable[..., Any] | None = None

    async def subscribe(self, subject: str, message_type: Any, handler: Callable[..., Any], **kwargs: Any) -> None:
        self._on_event = handler

    async def request(self, subject: str, message: Any, *args: Any, **kwargs: Any) -> Any:
        assert self._on_event is not None
        await self._on_event(ApiEvent(message.request_id, 0, [CREATED]), None)
        return self.answer()


async def test_gateway_error_mid_responses_stream_is_an_error_event_the_sdk_raises() -> None:
    bus = SilentStreamBus()
    app = build_app(bus, GatewayConfig(event_timeout_s=0.2), ["m"])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
        assert resp.status == 200  # the stream started: the timeout can only be its last frame
        raw = await resp.read()
        assert raw.startswith(CREATED)
        error = (b'{"error":{"message":"the model sent nothing for 0.2 s","type":"server_error","param":null,'
                 b'"code":null}}')
        assert raw[len(CREATED):] == b"event: error\ndata: " + error + b"\n\n"

        seen = []
        async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0) as sdk:
            stream = await sdk.responses.create(model="m", input="hi", stream=True)
            with pytest.raises(openai.APIError, match="^the model sent nothing for 0.2 s$") as raised:
                async for event in stream:
                    seen.append(event.type)
        assert seen == ["response.created"]
        assert raised.value.body == orjson.loads(error)["error"]
    assert [m.reason for m in bus.published] == ["timed out", "timed out"]


async def test_auxiliary_routes_without_a_recipe() -> None:
    app = build_app(FakeBus(), GatewayConfig(), ["m"])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post("/v1/chat/completions", data=b"{}", headers={"X-Request-Id": "bad id"})
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_request_id"
        assert (await (await client.get("/version")).json())["version"]
        # /ping is vLLM's alias of /health: readiness, so 503 with no workers registered
        health = (await client.get("/health")).status
        assert health == 503 and (await client.get("/ping")).status == health == (await client.post("/ping")).status
        (card,) = (await (await client.get("/v1/models")).json())["data"]
        assert card["id"] == "m" and "max_model_len" not in card  # no recipe to say it: listed without one
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/responses/resp_1"),
                             ("DELETE", "/v1/responses/resp_1")):
            resp = await client.request(method, path, data=b"{}")
            assert resp.status == 503 and (await resp.json())["error"]["type"] == "server_error"
        assert (await client.post("/tokenize", data=b"[1]")).status == 400


class DownBus(FakeBus):
    connected = False


async def test_a_request_while_the_bus_is_down_is_a_503_at_once_in_api_format() -> None:
    bus = DownBus(lambda: pytest.fail("nothing may be asked while the bus is down"))
    app = build_app(bus, GatewayConfig(request_timeout_s=600), ["m"])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": []})
        assert resp.status == 503 and resp.headers["Retry-After"] == "2"
        body = await resp.json()
        assert body["type"] == "error" and "no connection to the message bus" in body["error"]["message"]
        resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert resp.status == 503 and "message bus" in (await resp.json())["error"]["message"]
        assert (await client.post("/v1/messages/count_tokens", json={"model": "m"})).status == 503
        assert (await client.post("/tokenize", json={"prompt": "x"})).status == 503
        assert (await client.get("/health")).status == 503  # and readiness says why
    assert bus.published == []  # nothing was launched, so there is nothing to cancel


class OutageBus(SilentStreamBus):
    """A stream that starts, then the bus goes down (or comes back) as the test says."""

    def __init__(self) -> None:
        super().__init__()
        self.down = 0.0

    def down_for(self) -> float:
        return self.down


@pytest.mark.parametrize("outage", ["down past the grace", "back but the stream stays silent"])
async def test_a_stream_the_bus_cannot_bring_ends_with_a_last_error_frame(outage: str) -> None:
    import asyncio
    import time

    from shared.bus_state import OUTAGE_GRACE_S, RESUME_S

    bus = OutageBus()
    app = build_app(bus, GatewayConfig(event_timeout_s=600), ["m"])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
        assert resp.status == 200
        assert await resp.content.readexactly(len(CREATED)) == CREATED  # the stream runs, then falls silent
        if outage == "down past the grace":
            bus.down = OUTAGE_GRACE_S + 1
        else:  # lost, and back long enough ago that its replays would have come
            bus.losses, bus.back_at = 1, time.monotonic() - RESUME_S - 1
        rest = await asyncio.wait_for(resp.content.read(), 30)  # (a bound on a hang, not a timing assertion)
        error = orjson.loads(rest.split(b"data: ", 1)[1])
        assert rest.startswith(b"event: error\n") and "message bus was lost" in error["error"]["message"]
    assert [m.reason for m in bus.published] == ["bus lost"]


async def test_a_stream_that_resumes_after_an_outage_goes_on() -> None:
    import asyncio
    import time

    bus = OutageBus()
    app = build_app(bus, GatewayConfig(event_timeout_s=600), ["m"])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
        assert await resp.content.readexactly(len(CREATED)) == CREATED
        bus.losses, bus.back_at = 1, time.monotonic()  # an outage just ended: its replays are on their way
        await asyncio.sleep(0.6)  # a poll of the pump passes
        assert bus._on_event is not None
        done = ApiEvent("", 1, [b"data: [DONE]\n\n"], done=True)
        await bus._on_event(done, None)  # the replayed end arrives
        rest = await asyncio.wait_for(resp.content.read(), 30)
        assert rest == b"data: [DONE]\n\n"
    assert bus.published == []  # it finished: nothing to cancel
