"""Errors aiohttp's HTTP parser answers itself, in OpenAI's error JSON instead of its plain text; a bound on the
time a client may take to send a request's head.

A bad request line, a bad Content-Length or Transfer-Encoding, a header past aiohttp's size limits: the parser
fails before any request exists, so neither a route nor a middleware sees it. aiohttp answers such a request with
`RequestHandler.handle_error`, on the connection's own handler; `ApiRunner` gives each connection a handler that
keeps aiohttp's status, logging and closing of the connection and only writes the body as JSON. The request
line may be the broken part, so the path is unknown: the body is OpenAI's format, which every route but the
Anthropic ones speaks (the Anthropic SDK reads its status all the same). Such errors, and a body that fails its
Content-Encoding after the route answered it, are logged as one line, not as tracebacks a client could fill the
log with.

aiohttp has no public seam for this: `ApiRunner` overrides `AppRunner._make_server` and copies `Server._kwargs`
(aiohttp 3.14); the header bound reads `RequestHandler._waiter` and closing without lingering sets
`_lingering_time`. If those change, the parser errors stay aiohttp's own, with their right status, and
tests/unit/test_gateway_hostile.py (or test_gateway_client_timeouts.py) fails.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError

from shared.api_errors import openai_error_body


class ApiRequestHandler(web.RequestHandler):
    """Also bounds the time from a request's first byte to its last header (`header_timeout_s`): aiohttp's
    keepalive_timeout closes a connection that sends nothing, but one that sends a header line now and then
    would hold it (and a file descriptor) for ever."""

    def __init__(self, *args: Any, header_timeout_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # start() waits on _waiter only between requests: bytes then, and no complete head yet, are a head begun
        waiting = self._waiter is not None and not self._waiter.done()
        if not waiting or self._force_close:
            self._cancel_header_timer()
        elif self._header_timer is None and self._header_timeout_s is not None:
            self._header_timer = self._loop.call_later(self._header_timeout_s, self._head_too_slow)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def close_without_lingering(self) -> None:
        """After this answer, close at once: aiohttp would otherwise read on (lingering_time, 10 s) what is left
        of a body, which a client trickling it would use to hold the connection on."""
        self._lingering_time = 0.0
        self.close()

    def _head_too_slow(self) -> None:
        self._header_timer = None
        if self._waiter is not None and not self._waiter.done():  # still no complete head: no request to answer
            self.logger.info("closed a client connection: no complete request head in %g s", self._header_timeout_s)
            self.force_close()

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, (HttpProcessingError, web.RequestPayloadError)):  # the client's bytes, not our bug:
            self.logger.info("bad HTTP from a client: %s", " ".join(str(exc).split()))  # one line, no traceback
            return
        super().log_exception(*args, **kwargs)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response already began
        if isinstance(exc, ContentEncodingError):  # known with the headers: a coding aiohttp cannot decode here
            # (brotli, zstd: their packages are not installed); RFC 9110 answers an unsupported coding with 415
            status = HTTPStatus.UNSUPPORTED_MEDIA_TYPE
            text = "this Content-Encoding is not supported: send the body uncompressed, gzip or deflate"
        elif status >= 500:  # aiohttp's last resort for a handler that failed outside every middleware
            text = "internal error in the gateway"
        else:
            text = "the HTTP request is malformed: " + " ".join((message or _phrase(status)).split())  # one line
        response = web.Response(status=status, body=openai_error_body(status, text), content_type="application/json")
        response.force_close()  # as aiohttp's own: after a parse error the connection's framing is unknown
        return response


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "bad request"


class ApiServer(web.Server):
    header_timeout_s: float | None = None

    def __call__(self) -> web.RequestHandler:
        return ApiRequestHandler(self, loop=self._loop, header_timeout_s=self.header_timeout_s, **self._kwargs)


class ApiRunner(web.AppRunner):
    """An AppRunner whose connections answer parser errors in OpenAI's error JSON and close when a request's head
    takes longer than `header_timeout_s` (None = no bound)."""

    def __init__(self, app: web.Application, *, header_timeout_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        api = ApiServer(
            server.request_handler, request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation, loop=server._loop, **server._kwargs,
        )
        api.header_timeout_s = self._header_timeout_s
        return api
