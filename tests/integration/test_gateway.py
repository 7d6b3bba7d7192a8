"""The gateway over real HTTP and a real nats-server; the test plays the recipe.

The fake recipe answers `recipe.prepare` and publishes ApiEvents on `events.<rid>` out of order, some before its
reply (the gateway must have subscribed first and buffer them) and the rest after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import anthropic
import openai
import orjson
import pytest
from opentelemetry import trace

from services.gateway.config import GatewayConfig
from services.gateway.routes import generate as generate_routes
from services.gateway.service import GatewayService
from shared import subjects
from shared.bus import Bus
from shared.schemas.gateway import ApiEvent, PrepareReply, PrepareRequest, Resume
from shared.schemas.generate import Cancel
from shared.schemas.health import HealthReply, HealthRequest, Presence

MODEL = "test-model"
CONFIG = GatewayConfig(port=0, request_timeout_s=1.0, event_timeout_s=1.0, max_body_bytes=64 * 1024)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}

Script = Callable[[str], list[ApiEvent]]  # request id -> the events to publish, in publishing order


async def roundtrip(bus: Bus) -> None:
    """Once a request on this connection is answered, the server has every subscription made before it."""

    async def pong(_: HealthRequest) -> HealthReply:
        return HealthReply(service="t", instance="t", ready=True)

    subject = f"test.sync.{id(bus)}.{time.monotonic_ns()}"
    sub = await bus.serve(subject, HealthRequest, pong)
    await bus.request(subject, HealthRequest(), HealthReply)
    await sub.unsubscribe()


@dataclass
class FakeRecipe:
    bus: Bus
    reply: PrepareReply
    script: Script = lambda rid: []
    early: int = 1  # events published before the reply
    prepared: list[PrepareRequest] = field(default_factory=list)
    trace_ids: list[int] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> FakeRecipe:
        await self.bus.serve(subjects.RECIPE_PREPARE, PrepareRequest, self._prepare, queue=subjects.RECIPE_GROUP)
        await roundtrip(self.bus)
        return self

    async def _prepare(self, request: PrepareRequest) -> PrepareReply:
        self.prepared.append(request)
        self.trace_ids.append(trace.get_current_span().get_span_context().trace_id)
        events = self.script(request.request_id)
        for event in events[: self.early]:
            await self.bus.publish(subjects.events(request.request_id), event)
        task = asyncio.create_task(self._later(events[self.early :]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return self.reply

    async def _later(self, events: list[ApiEvent]) -> None:
        for event in events:
            await asyncio.sleep(0.02)
            await self.bus.publish(subjects.events(event.request_id), event)


@dataclass
class Mesh:
    gateway: GatewayService
    recipe_bus: Bus
    cancels: asyncio.Queue[Cancel]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    async def recipe(self, reply: PrepareReply, script: Script = lambda rid: [], early: int = 1) -> FakeRecipe:
        return await FakeRecipe(self.recipe_bus, reply, script, early).start()

    async def next_cancel(self) -> Cancel:
        return await asyncio.wait_for(self.cancels.get(), 3.0)


@pytest.fixture
async def mesh(nats_url: str) -> AsyncIterator[Mesh]:
    gateway_bus = await Bus.connect(nats_url, "gateway-test")
    recipe_bus = await Bus.connect(nats_url, "recipe-test")
    cancels: asyncio.Queue[Cancel] = asyncio.Queue()

    async def on_cancel(cancel: Cancel, _: object) -> None:
        cancels.put_nowait(cancel)

    await recipe_bus.subscribe(subjects.CANCEL, Cancel, on_cancel)
    await roundtrip(recipe_bus)
    gateway = GatewayService(CONFIG, [MODEL])
    await gateway.start(gateway_bus)
    try:
        yield Mesh(gateway, recipe_bus, cancels)
    finally:
        await gateway.stop()
        await gateway_bus.drain()
        await recipe_bus.drain()


def scrambled(events: list[ApiEvent]) -> list[ApiEvent]:
    """Swap neighbours: 1, 0, 3, 2, ... so nothing arrives in order."""
    out = list(events)
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


def sse_script(frames: list[bytes], *, done: bool = True) -> Script:
    def script(rid: str) -> list[ApiEvent]:
        last = len(frames) - 1
        events = [ApiEvent(rid, seq, [f], done=done and seq == last) for seq, f in enumerate(frames)]
        return scrambled(events)

    return script


def unary_script(body: dict[str, object], status: int = 200) -> Script:
    def script(rid: str) -> list[ApiEvent]:  # a progress event, then the answer: arriving done-first
        return [ApiEvent(rid, 1, done=True, status=status, body=orjson.dumps(body)), ApiEvent(rid, 0)]

    return script


def chat_chunk(text: str, finish: str | None = None) -> bytes:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def anthropic_frame(kind: str, data: dict[str, object]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **data}) + b"\n\n"


def openai_client(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="sk-test", max_retries=0)


# --- the SDKs, streaming and not --------------------------------------------------------------------------------


async def test_openai_sdk_unary_and_stream(mesh: Mesh) -> None:
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    recipe = await mesh.recipe(PrepareReply(ok=True, prompt_tokens=3), unary_script(completion))
    client = openai_client(mesh)
    try:
        result = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        assert result.choices[0].message.content == "Hello" and result.usage.total_tokens == 4

        sent = recipe.prepared[0]
        assert sent.api == "chat" and orjson.loads(sent.body)["messages"][0]["content"] == "Hi"
        assert sent.tenant and "sk-test" not in sent.tenant  # hashed, never the raw key
        assert len(sent.request_id) == 32 and sent.request_id.isalnum()

        words = ["The ", "quick ", "brown ", "fox"]
        frames = [chat_chunk(w) for w in words] + [chat_chunk("", "stop"), b"data: [DONE]\n\n"]
        recipe.reply = PrepareReply(ok=True, stream=True)
        recipe.script = sse_script(frames)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        texts = [chunk.choices[0].delta.content async for chunk in stream]
        assert "".join(t or "" for t in texts) == "The quick brown fox"
        assert texts[:4] == words  # in seq order although published scrambled
    finally:
        await client.close()


async def test_anthropic_sdk_unary_and_stream(mesh: Mesh) -> None:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "Hi there"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }
    recipe = await mesh.recipe(PrepareReply(ok=True), unary_script(message))
    client = anthropic.AsyncAnthropic(base_url=mesh.url, api_key="ak-test", max_retries=0)
    try:
        result = await client.messages.create(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}]
        )
        assert result.content[0].text == "Hi there"
        assert recipe.prepared[0].api == "messages"

        start = {**message, "content": [], "stop_reason": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
        frames = [
            anthropic_frame("message_start", {"message": start}),
            anthropic_frame("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            anthropic_frame("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hi "}}),
            anthropic_frame("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "there"}}),
            anthropic_frame("content_block_stop", {"index": 0}),
            anthropic_frame(
                "message_delta",
                {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 2}},
            ),
            anthropic_frame("message_stop", {}),
        ]
        recipe.reply = PrepareReply(ok=True, stream=True)
        recipe.script = sse_script(frames)
        async with client.messages.stream(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            pieces = [text async for text in stream.text_stream]
        assert pieces == ["Hi ", "there"]
    finally:
        await client.close()


# --- errors ------------------------------------------------------------------------------------------------------


async def test_bad_bodies_get_400_in_each_api_format(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as http:
        for body in (b"{not json", b"[1, 2]", b""):
            async with http.post(f"{mesh.url}/v1/chat/completions", data=body) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "invalid_request_error"
            async with http.post(f"{mesh.url}/v1/messages", data=body) as resp:
                assert resp.status == 400
                payload = await resp.json()
                assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"

        big = orjson.dumps({"prompt": "x" * (CONFIG.max_body_bytes + 1)})
        async with http.post(f"{mesh.url}/v1/messages", data=big) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["type"] == "request_too_large"
        async with http.get(f"{mesh.url}/v1/nowhere") as resp:
            assert resp.status == 404
            assert "message" in (await resp.json())["error"]


async def test_recipe_refusal_passes_through(mesh: Mesh) -> None:
    refusal = {"error": {"message": "max_tokens too large", "type": "invalid_request_error", "param": None, "code": None}}
    await mesh.recipe(PrepareReply(ok=False, status=400, error_body=orjson.dumps(refusal)))
    client = openai_client(mesh)
    try:
        with pytest.raises(openai.BadRequestError, match="max_tokens too large"):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    finally:
        await client.close()
    assert mesh.cancels.empty()  # refused means never started: nothing to cancel


async def test_no_recipe_is_a_quick_503(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.post(f"{mesh.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "server_error"
        async with http.post(f"{mesh.url}/v1/messages", json=CHAT) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["type"] == "overloaded_error"
        assert time.monotonic() - started < 2 * CONFIG.request_timeout_s


async def test_streamed_error_before_first_frame_is_a_plain_http_error(mesh: Mesh) -> None:
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt too long"}}

    def script(rid: str) -> list[ApiEvent]:
        frame = anthropic_frame("error", {"error": error["error"]})  # unused: no frame went out yet
        return [ApiEvent(rid, 0, [frame], done=True, status=400, body=orjson.dumps(error))]

    await mesh.recipe(PrepareReply(ok=True, stream=True), script)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh.url}/v1/messages", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 400
            assert await resp.json() == error


# --- every request ends ------------------------------------------------------------------------------------------


async def test_client_disconnect_mid_stream_sends_cancel(mesh: Mesh) -> None:
    recipe = await mesh.recipe(PrepareReply(ok=True, stream=True), sse_script([chat_chunk("a")], done=False))
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{mesh.url}/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.headers["Cache-Control"] == "no-cache"
        assert await resp.content.readuntil(b"\n\n") == chat_chunk("a")
        resp.close()  # hang up mid-stream
    cancel = await mesh.next_cancel()
    assert cancel == Cancel(recipe.prepared[0].request_id, reason="client disconnected")


async def test_client_giving_up_on_a_unary_request_sends_cancel(mesh: Mesh) -> None:
    recipe = await mesh.recipe(PrepareReply(ok=True), lambda rid: [])  # never answers
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as http:
        with pytest.raises(asyncio.TimeoutError):
            await http.post(f"{mesh.url}/v1/chat/completions", json=CHAT)
    cancel = await mesh.next_cancel()  # before the gateway's own 1 s silence timeout
    assert cancel == Cancel(recipe.prepared[0].request_id, reason="client disconnected")


async def test_silence_times_out_with_cancel(mesh: Mesh) -> None:
    recipe = await mesh.recipe(PrepareReply(ok=True), lambda rid: [])
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh.url}/v1/messages", json=CHAT) as resp:  # unary: a 504
            assert resp.status == 504
            assert (await resp.json())["error"]["type"] == "timeout_error"
        assert await mesh.next_cancel() == Cancel(recipe.prepared[0].request_id, reason="timed out")

        recipe.reply = PrepareReply(ok=True, stream=True)  # streaming: a last error frame
        recipe.script = sse_script([chat_chunk("a")], done=False)
        async with http.post(f"{mesh.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200
            text = await resp.read()
        assert text.startswith(chat_chunk("a"))
        last = orjson.loads(text.split(b"\n\n")[-2].removeprefix(b"data: "))
        assert last["error"]["type"] == "server_error"
        assert await mesh.next_cancel() == Cancel(recipe.prepared[1].request_id, reason="timed out")


async def test_stop_ends_streams_in_flight(mesh: Mesh) -> None:
    recipe = await mesh.recipe(PrepareReply(ok=True, stream=True), sse_script([chat_chunk("a")], done=False))
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            await resp.content.readuntil(b"\n\n")
            await mesh.gateway.stop()
            rest = await resp.read()
    assert b"shutting down" in rest
    assert await mesh.next_cancel() == Cancel(recipe.prepared[0].request_id, reason="gateway shutting down")
    assert mesh.gateway.health() == (False, "not listening")


# --- the rest of the surface -------------------------------------------------------------------------------------


async def test_models_health_metrics(mesh: Mesh) -> None:
    client = openai_client(mesh)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "deepinfer"
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("nope")
    finally:
        await client.close()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{mesh.url}/live") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
        async with http.get(f"{mesh.url}/health") as resp:  # readiness: only a fake recipe, which never heartbeats
            assert resp.status == 503 and "a decode worker for test-model" in (await resp.json())["missing"]
        async with http.post(f"{mesh.url}/v1/chat/completions", data=b"nope") as resp:
            assert resp.status == 400
        async with http.get(f"{mesh.url}/metrics") as resp:
            text = await resp.text()
    assert 'deepinfer_gateway_requests_total{api="chat",status="400"} 1.0' in text
    assert "deepinfer_gateway_requests_in_flight 0.0" in text
    ready, detail = mesh.gateway.health()
    assert not ready and "waiting for a balancer, a recipe for test-model" in detail


async def test_trace_continues_from_client_to_recipe(mesh: Mesh) -> None:
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    recipe = await mesh.recipe(PrepareReply(ok=True), unary_script({"ok": True}))
    headers = {"traceparent": f"00-{trace_id:032x}-00f067aa0ba902b7-01"}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh.url}/v1/chat/completions", json=CHAT, headers=headers) as resp:
            assert resp.status == 200 and await resp.json() == {"ok": True}
            assert resp.headers["X-Request-Id"] == recipe.prepared[0].request_id
    assert recipe.trace_ids == [trace_id]


# --- a recipe that dies mid-request --------------------------------------------------------------------------------


@dataclass
class MortalRecipe:
    """A recipe process with a presence (boot `boot`) that answers prepare with `answer`; `die()` stops both."""

    bus: Bus
    boot: str
    answer: Callable[[PrepareRequest], list[ApiEvent]]
    prepared: list[PrepareRequest] = field(default_factory=list)
    _subs: list[object] = field(default_factory=list)
    _beat: asyncio.Task[None] | None = None

    async def start(self) -> MortalRecipe:
        async def prepare(request: PrepareRequest) -> PrepareReply:
            self.prepared.append(request)
            for event in self.answer(request):
                await self.bus.publish(subjects.events(request.request_id), event)
            return PrepareReply(ok=True, stream=True, recipe=self.boot, seed=42, created=7)

        async def beat() -> None:
            while True:
                await self.bus.publish(subjects.PRESENCE, Presence("recipe", "recipe-0", [MODEL], boot=self.boot))
                await asyncio.sleep(0.1)

        self._subs.append(await self.bus.serve(subjects.RECIPE_PREPARE, PrepareRequest, prepare,
                                               queue=subjects.RECIPE_GROUP))
        self._beat = asyncio.create_task(beat())
        await roundtrip(self.bus)
        return self

    async def die(self) -> None:
        assert self._beat is not None
        self._beat.cancel()
        for sub in self._subs:
            await sub.unsubscribe()  # type: ignore[attr-defined]
        await roundtrip(self.bus)


async def test_a_request_whose_recipe_dies_is_handed_to_the_next_recipe_with_what_the_client_has(
        nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe that took a stream falls silent (its presence stops) after two events: the gateway asks the
    next recipe to take the request over, with the engine tokens behind the frames relayed, the lost recipe's
    seed and creation time; that recipe's events (epoch 1, from seq 0) continue the stream, and a late event of
    the dead one (epoch 0) is not relayed. With no recipe to take over, the stream ends with an error frame and
    every hop gets a Cancel."""
    monkeypatch.setattr(generate_routes, "PRESENCE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(generate_routes, "RECIPE_TAKEOVER_WAIT_S", 1.0)
    gateway_bus = await Bus.connect(nats_url, "gateway-test")
    recipe_bus = await Bus.connect(nats_url, "recipe-test")
    cancels: asyncio.Queue[Cancel] = asyncio.Queue()

    async def on_cancel(cancel: Cancel, _: object) -> None:
        cancels.put_nowait(cancel)

    await recipe_bus.subscribe(subjects.CANCEL, Cancel, on_cancel)
    gateway = GatewayService(GatewayConfig(port=0, request_timeout_s=1.0, event_timeout_s=30.0), [MODEL])
    await gateway.start(gateway_bus)
    url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"
    try:
        first = await MortalRecipe(recipe_bus, "boot-a", lambda r: [
            ApiEvent(r.request_id, 0, [chat_chunk("one")], token_ids=[1, 2]),
            ApiEvent(r.request_id, 1, [chat_chunk(" two")], token_ids=[3], migration=1, cached_tokens=16),
        ]).start()
        second: MortalRecipe | None = None
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={**CHAT, "stream": True}) as resp:
                assert resp.status == 200
                assert await resp.content.readuntil(b"\n\n") == chat_chunk("one")
                assert await resp.content.readuntil(b"\n\n") == chat_chunk(" two")
                await first.die()
                second = await MortalRecipe(recipe_bus, "boot-b", lambda r: [
                    ApiEvent(r.request_id, 0, [chat_chunk("zombie")], token_ids=[9], epoch=0),  # the dead one's
                    ApiEvent(r.request_id, 0, [chat_chunk(" three")], token_ids=[4], epoch=1),
                    ApiEvent(r.request_id, 1, [chat_chunk("", "stop"), b"data: [DONE]\n\n"], done=True, epoch=1),
                ] if r.resume is not None else [ApiEvent(r.request_id, 0, [chat_chunk("one")], token_ids=[1])]).start()
                rest = await resp.read()
            assert rest == chat_chunk(" three") + chat_chunk("", "stop") + b"data: [DONE]\n\n"
            (taken,) = second.prepared
            assert taken.request_id == first.prepared[0].request_id and taken.body == first.prepared[0].body
            assert taken.resume == Resume(seed=42, created=7, token_ids=[1, 2, 3], cached_tokens=16, migration=1,
                                          epoch=1)
            assert cancels.empty()  # the request went on: nothing was cancelled

            async with http.post(url, json={**CHAT, "stream": True}) as resp:  # and now nobody comes back
                assert await resp.content.readuntil(b"\n\n") == chat_chunk("one")
                await second.die()
                text = await resp.read()
            last = orjson.loads(text.split(b"\n\n")[-2].removeprefix(b"data: "))
            assert last["error"] == {"message": generate_routes.RECIPE_LOST, "type": "server_error", "param": None, "code": None}
            assert await asyncio.wait_for(cancels.get(), 5.0) == Cancel(second.prepared[-1].request_id,
                                                                        reason="recipe lost")
    finally:
        await gateway.stop()
        await gateway_bus.drain()
        await recipe_bus.drain()
