"""Hostile HTTP at the gateway, over a stand-in bus (no broker): compressed and broken bodies, JSON nested past
every walk, and requests aiohttp's parser rejects, each a 4xx in the API's own error JSON."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any

import orjson
from aiohttp import test_utils, web

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.protocol import ApiRunner
from shared.json_depth import MAX_JSON_DEPTH
from shared.schemas.gateway import PrepareReply

RECIPE_SAYS = b'{"error": {"message": "the recipe read it"}}'


class RecordingBus:
    """Just enough of `Bus`: every request is answered by a recipe that refuses it, and recorded."""

    connected = True
    losses = 0  # the bus's outage state, as shared.bus.Bus reports it: never lost
    back_at = 0.0

    def down_for(self) -> float:
        return 0.0

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def request(self, subject: str, message: Any, *args: Any, **kwargs: Any) -> Any:
        self.requests.append(message)
        return PrepareReply(ok=False, status=422, error_body=RECIPE_SAYS)

    async def publish(self, subject: str, message: Any) -> None:
        return None


def nested(levels: int) -> bytes:
    """A JSON object whose "a" holds `levels` - 1 arrays, one inside the other: `levels` containers deep."""
    return b'{"model": "m", "a": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"


async def post(body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions",
               max_body: int = 10_000) -> tuple[int, dict[str, Any], RecordingBus]:
    """One request on a fresh connection (after a broken body aiohttp closes the connection)."""
    bus = RecordingBus()
    app = build_app(bus, GatewayConfig(max_body_bytes=max_body), ["m"])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post(path, data=body, headers=headers or {})
        assert resp.content_type == "application/json"
        return resp.status, orjson.loads(await resp.read()), bus


async def test_a_gzipped_body_reaches_the_recipe_decompressed() -> None:
    status, body, bus = await post(gzip.compress(b'{"model": "m"}'), {"Content-Encoding": "gzip"})
    assert (status, body) == (422, orjson.loads(RECIPE_SAYS))
    assert bus.requests[0].body == b'{"model": "m"}'


async def test_gzip_on_a_plain_or_broken_body_is_a_400() -> None:
    for data in (b'{"model": "m"}', b"\x1f\x8b\x08garbage"):
        status, body, bus = await post(data, {"Content-Encoding": "gzip"})
        assert status == 400, data
        assert "not valid gzip" in body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error"
        assert bus.requests == []
    # Cut short, a gzip stream is only shorter (zlib does not insist on its end): the JSON is what breaks.
    status, body, bus = await post(gzip.compress(b'{"model": "m"}')[:12], {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid JSON" in body["error"]["message"] and bus.requests == []
    status, body, _ = await post(b'{"model": "m"}', {"Content-Encoding": "gzip"}, path="/v1/messages")
    assert (status, body["type"], body["error"]["type"]) == (400, "error", "invalid_request_error")


async def test_a_zip_bomb_stops_at_the_body_limit() -> None:
    bomb = gzip.compress(b'{"model": "m", "a": "' + b"x" * 1_000_000 + b'"}')
    assert len(bomb) < 10_000  # small on the wire, a megabyte inflated
    status, body, bus = await post(bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "larger than 10000 bytes" in body["error"]["message"]
    assert bus.requests == []


async def test_json_nested_past_the_limit_is_a_400_before_the_recipe() -> None:
    status, _, bus = await post(nested(MAX_JSON_DEPTH))
    assert status == 422 and len(bus.requests) == 1  # at the limit: the recipe reads it
    for body in (nested(MAX_JSON_DEPTH + 1), nested(1_000), b"[" * 10_000 + b"]" * 10_000):
        status, error, bus = await post(body, max_body=100_000)
        assert status == 400 and bus.requests == []
        assert "levels deep" in error["error"]["message"] or "depth limit" in error["error"]["message"]


async def raw_exchange(port: int, request: bytes) -> tuple[int, bytes, bytes]:
    """Send raw bytes, read the whole answer: (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    answer = await reader.read()  # aiohttp closes the connection after a parse error
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


async def test_parser_errors_are_answered_in_openai_error_json() -> None:
    app = build_app(RecordingBus(), GatewayConfig(), ["m"])  # type: ignore[arg-type]
    runner = ApiRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    host = b"Host: x\r\n"
    cases = {
        "bad Content-Length": b"POST /v1/chat/completions HTTP/1.1\r\n" + host + b"Content-Length: abc\r\n\r\n{}",
        "two Content-Lengths": b"POST /v1/messages HTTP/1.1\r\n" + host
        + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        "oversized header": b"POST /v1/chat/completions HTTP/1.1\r\n" + host + b"X-Big: " + b"a" * 20_000
        + b"\r\nContent-Length: 2\r\n\r\n{}",
        "bad request line": b"GARBAGE\r\n\r\n",
        "bad method": b"P\x01ST / HTTP/1.1\r\n" + host + b"\r\n",
    }
    try:
        for name, request in cases.items():
            status, head, body = await raw_exchange(port, request)
            assert 400 <= status < 500, name
            assert b"application/json" in head.lower(), (name, head)
            error = orjson.loads(body)["error"]
            assert error["type"] == "invalid_request_error", name
            assert error["message"].startswith("the HTTP request is malformed: "), name
        # brotli and zstd need packages the gateway does not install: refused with the headers, before the body
        status, head, body = await raw_exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\n" + host
                                                + b"Content-Encoding: br\r\nContent-Length: 2\r\n\r\n{}")
        assert status == 415 and "Content-Encoding is not supported" in orjson.loads(body)["error"]["message"]
    finally:
        await runner.cleanup()
