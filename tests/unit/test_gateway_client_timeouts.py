"""Client connections at the gateway are bounded in time, over a stand-in bus (no broker): a silent connection,
one that trickles its request head, and one that trickles its body (408 in the API's error JSON)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp import web

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.protocol import ApiRunner
from shared.schemas.gateway import PrepareReply

SHORT = 0.2  # each bound under test; the others stay long, so only the one under test can close the connection
LONG = 60.0
BOUND = 20.0  # how long a test waits for what must happen (a safeguard against a hang, not a timing check)
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


class RefusingBus:
    """Just enough of `Bus`: the recipe refuses every request (so a request that got through is a 422)."""

    connected = True
    losses = 0  # the bus's outage state, as shared.bus.Bus reports it: never lost
    back_at = 0.0

    def down_for(self) -> float:
        return 0.0

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def request(self, *args: Any, **kwargs: Any) -> PrepareReply:
        return PrepareReply(ok=False, status=422, error_body=b'{"error": {"message": "read"}}')

    async def publish(self, *args: Any) -> None:
        return None


@asynccontextmanager
async def gateway(idle: float = LONG, header: float = LONG, body: float = LONG) -> AsyncIterator[int]:
    config = GatewayConfig(client_idle_timeout_s=idle, client_header_timeout_s=header, client_body_timeout_s=body)
    runner = ApiRunner(build_app(RefusingBus(), config, ["m"]), keepalive_timeout=idle,  # type: ignore[arg-type]
                       header_timeout_s=header)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def exchange(port: int, *parts: bytes) -> bytes:
    """Send the parts, then read one response (head and body), or b"" when the gateway closes the connection
    without one. (After an answer to a body left unread aiohttp lingers, reading, before it closes.)"""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for part in parts:
        writer.write(part)
    await writer.drain()
    try:
        return await asyncio.wait_for(_response(reader), BOUND)
    finally:
        writer.close()


async def _response(reader: asyncio.StreamReader) -> bytes:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as closed:
        return closed.partial
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return head + await reader.readexactly(length)


async def test_a_silent_connection_is_closed() -> None:
    async with gateway(idle=SHORT) as port:
        assert await exchange(port) == b""


async def test_a_request_head_that_never_ends_is_closed_unanswered() -> None:
    async with gateway(header=SHORT) as port:
        assert await exchange(port, HEAD + b"X-Slow: 1\r\n") == b""


async def test_a_whole_head_is_served_under_the_header_bound() -> None:
    async with gateway(header=SHORT) as port:
        answer = await exchange(port, HEAD + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert answer.startswith(b"HTTP/1.1 422")


async def test_a_body_that_never_ends_is_a_408_in_the_api_json() -> None:
    async with gateway(body=SHORT) as port:
        answer = await exchange(port, HEAD + b"Content-Length: 100\r\n\r\n{\"model\"")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        error = orjson.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and "took longer than 0.2 s" in error["message"]
        answer = await exchange(port, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and orjson.loads(body)["type"] == "error"
