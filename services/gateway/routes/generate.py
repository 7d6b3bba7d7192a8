"""POST /v1/chat/completions, /v1/messages, ...: one request through the mesh.

    subscribe events.<rid>  ->  recipe.prepare (request/reply)  ->  relay ApiEvents in seq order until `done`

The client's `X-Request-Id` (vLLM's convention) names the request for the client: the ids it sees derive from it
and the header is echoed back. The mesh's own request id (its subjects, its cancel) is always ours, so no client
id can reach another request's streams.

A recipe that dies with requests in flight (its presence silent PRESENCE_TIMEOUT_S) does not take them along:
the gateway hands each to another recipe, or to the one the launcher restarts, with what the client has had of it
(PrepareRequest.resume: the engine tokens behind the events relayed, the seed, the latest migration); that recipe
replays them and resumes generation after them, an exact continuation, so the client's stream goes on with no
token missing or repeated. No recipe within RECIPE_TAKEOVER_WAIT_S, or a request that lost MAX_RECIPE_LOSSES
recipes: a 503 in the API's format (a last error frame on a started stream).

Every accepted request ends explicitly. Any ending other than its `done` event (the client went away, the model
fell silent, the gateway is stopping, a bug) sends Cancel(rid) on `requests.cancel`, so every hop frees what it
holds for the request, KV blocks first of all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from typing import Any

import orjson
from aiohttp import web
from opentelemetry import trace

from services.gateway import genai
from services.gateway.auth import presented_key, tenant_of
from services.gateway.errors import ApiError, ErrorFormat, bus_down, error_response, json_response
from services.gateway.fleet import Fleet
from services.gateway.metrics import Metrics
from services.gateway.protocol import ApiRequestHandler
from services.gateway.routes.table import ApiRoute
from services.gateway.streaming import EventPump, PumpAborted, Pumps
from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.bus_state import OUTAGE_GRACE_S, RECONNECT_MAX_S, RESUME_S
from shared.json_depth import depth_message, too_deep
from shared.presence import PRESENCE_TIMEOUT_S
from shared.schemas.gateway import ApiEvent, PrepareReply, PrepareRequest
from shared.schemas.generate import Cancel

log = logging.getLogger(__name__)

# How soon a vanished client is noticed while no event arrives. Handler cancellation (see service.py) usually
# tells us at once; this poll is the backstop.
DISCONNECT_POLL_S = 0.5
REQUEST_ID_HEADER = "X-Request-Id"
BUS_LOST = "the message bus was lost while the request was in flight and its answer did not resume; try again"
RECIPE_LOST = "the recipe serving the request was lost and no other could take it over; try again"
TAKEOVER_RETRY_S = 0.5
RECIPE_TAKEOVER_WAIT_S = 20.0  # for a recipe to take over a request whose recipe died (a restart loads a tokenizer)
MAX_RECIPE_LOSSES = 2  # recipes one request may lose (and be taken over) before it ends with RECIPE_LOST
CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # fits in an id, a header and a log line as it stands
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(ConnectionResetError):
    pass


class RequestEnded(Exception):
    """The request ends before its `done` event: the client gets `status`, every hop gets Cancel(`reason`)."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


# Seconds a handler may spend reading one body (--client-body-timeout). An app setting rather than an argument:
# every route that reads a body reads it through read_json, and a missing key (an app built by a test) = none.
BODY_TIMEOUT = web.AppKey("body_timeout_s", float)


async def read_json_object(request: web.Request, max_bytes: int) -> bytes:
    """The raw body, once known to be a JSON object (the recipe validates the rest)."""
    return (await read_json(request, max_bytes))[0]


async def read_json(request: web.Request, max_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body and the JSON object it holds."""
    too_large = ApiError(413, f"the request body is larger than {max_bytes} bytes")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large
    try:
        # aiohttp decompresses a Content-Encoding (gzip, deflate) as it reads; client_max_size counts the
        # decompressed bytes, so neither a chunked body nor a zip bomb gets past max_bytes.
        async with asyncio.timeout(request.app.get(BODY_TIMEOUT)):
            body = await request.read()
    except TimeoutError:  # a client trickling its body holds a connection and a handler: 408, as nginx's
        if isinstance(request.protocol, ApiRequestHandler):
            request.protocol.close_without_lingering()
        raise ApiError(408, f"the request body took longer than {request.app[BODY_TIMEOUT]:g} s to arrive") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except web.RequestPayloadError as exc:  # a body that is not in its Content-Encoding, or cut short
        raise ApiError(400, f"the request body could not be read: {_payload_problem(request, exc)}") from None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if too_deep(parsed):  # every later walk over the body (gateway and recipe) is recursive
        raise ApiError(400, depth_message())
    return body, parsed


def _payload_problem(request: web.Request, exc: web.RequestPayloadError) -> str:
    encoding = request.headers.get("Content-Encoding")
    if encoding:
        return f"it is not valid {encoding} (Content-Encoding: {encoding})"
    return str(exc.__cause__ or exc) or "the body ended early"


def client_request_id(request: web.Request) -> str:
    """The client's X-Request-Id ("" if none); a 400 if it cannot name a request."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return ""
    if not CLIENT_ID.fullmatch(value):
        raise ApiError(400, f"{REQUEST_ID_HEADER} must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
                       code="invalid_request_id")
    return value


class _Sse:
    """A server-sent-event response, started (headers sent) by its first write."""

    def __init__(self, request: web.Request, request_id: str) -> None:
        self._request = request
        self.request_id = request_id  # as the client sees it (its X-Request-Id, or ours)
        self.response: web.StreamResponse | None = None

    async def write(self, data: bytes) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers={**SSE_HEADERS, REQUEST_ID_HEADER: self.request_id})
            await self.response.prepare(self._request)
        await self.response.write(data)

    async def finish(self) -> web.StreamResponse:
        await self.write(b"")
        assert self.response is not None
        await self.response.write_eof()
        return self.response


class GenerateHandler:
    def __init__(
        self,
        bus: Bus,
        pumps: Pumps,
        metrics: Metrics,
        *,
        prepare_timeout_s: float,
        event_timeout_s: float,
        max_body_bytes: int,
        fleet: Fleet | None = None,
    ) -> None:
        """`fleet`: the services' presence as heard (a recipe that dies is noticed there); None: not watched."""
        self._fleet = fleet
        self._bus = bus
        self._pumps = pumps
        self._metrics = metrics
        self._prepare_timeout_s = prepare_timeout_s
        self._event_timeout_s = event_timeout_s
        self._max_body_bytes = max_body_bytes

    async def handle(self, request: web.Request, route: ApiRoute) -> web.StreamResponse:
        if self._pumps.closing:
            raise ApiError(503, "the gateway is shutting down")
        if not self._bus.connected:
            raise bus_down()
        arrival = time.monotonic()
        client_id = client_request_id(request)
        body, parsed = await read_json(request, self._max_body_bytes)
        request_id = uuid.uuid4().hex
        span = trace.get_current_span()
        span.set_attribute("request_id", request_id)
        if client_id:
            span.set_attribute("client_request_id", client_id)
        span.set_attributes(genai.request_attributes(route.api, parsed))
        tenant = tenant_of(presented_key(request.headers))
        prepare = PrepareRequest(request_id, route.api, body, tenant, client_request_id=client_id)
        headers = {REQUEST_ID_HEADER: client_id or request_id}
        sse = _Sse(request, headers[REQUEST_ID_HEADER])
        # Subscribe first: the recipe may publish events before its reply reaches us.
        async with self._pumps.open(request_id) as pump:
            try:
                pump.prepare = prepare
                reply = await self._prepare(prepare)
                if not reply.ok:
                    if reply.retry_after_s:  # refused for load, before anything was queued
                        headers["Retry-After"] = str(reply.retry_after_s)
                    return json_response(reply.status, reply.error_body, headers)
                pump.accepted(reply, time.monotonic())
                model = str(parsed.get("model", ""))  # the recipe accepted it: one of the served names
                pump.meter = self._metrics.meter(model, stream=reply.stream, prompt_tokens=reply.prompt_tokens,
                                                 arrival=arrival)
                if reply.stream:
                    return await self._relay_stream(request, pump, sse, route.errors)
                return await self._relay_unary(request, pump, headers)
            except RequestEnded as end:
                await self._cancel(request_id, end.reason)
                error = ApiError(end.status, end.message)
                if sse.response is None:
                    return error_response(route.errors, error, headers)
                await sse.write(route.errors.frame(route.errors.body(error)))
                return await sse.finish()
            except BaseException as exc:
                await self._cancel(request_id, self._reason(exc))
                raise
            finally:
                if (meter := pump.meter) is not None:
                    meter.end(time.monotonic())
                    span.set_attributes(genai.response_attributes(
                        meter.model, meter.prompt_tokens, meter.output_tokens, meter.finish_reason))

    async def _prepare(self, prepare: PrepareRequest) -> PrepareReply:
        try:
            return await self._bus.request(
                subjects.RECIPE_PREPARE, prepare, PrepareReply, timeout=self._prepare_timeout_s
            )
        except BusTimeout:
            # Cancel anyway: a recipe too slow to answer may still have taken the request.
            raise RequestEnded(503, "no recipe is available to serve the request", "no recipe reply") from None

    async def _relay_unary(self, request: web.Request, pump: EventPump, headers: dict[str, str]) -> web.Response:
        while True:  # events before `done` only prove the request is alive (they reset the silence timer)
            event = await self._next_event(request, pump)
            if event.done:
                return json_response(event.status, event.body, headers)

    async def _relay_stream(
        self, request: web.Request, pump: EventPump, sse: _Sse, errors: ErrorFormat
    ) -> web.StreamResponse:
        while True:
            event = await self._next_event(request, pump)
            if event.done and event.status != 200 and event.body and sse.response is None:
                # Failed before any frame went out: still time for a plain HTTP error (its error frames unused).
                return json_response(event.status, event.body, {REQUEST_ID_HEADER: sse.request_id})
            if event.frames:
                await sse.write(b"".join(event.frames))
            if event.done:
                if event.status != 200 and not event.frames and event.body:
                    await sse.write(errors.frame(event.body))
                return await sse.finish()

    async def _next_event(self, request: web.Request, pump: EventPump) -> ApiEvent:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._event_timeout_s
        while True:
            if request.transport is None or request.transport.is_closing():
                raise ClientGone("client disconnected")
            left = deadline - loop.time()
            if left <= 0:
                message = f"the model sent nothing for {self._event_timeout_s:g} s"
                raise RequestEnded(504, message, "timed out")
            self._check_bus(pump)
            try:
                event = await pump.next(min(left, DISCONNECT_POLL_S))
            except TimeoutError:
                if self._recipe_lost(pump):
                    await self._take_over(pump)
                continue
            except PumpAborted as exc:
                raise RequestEnded(503, "the gateway is shutting down", exc.reason) from None
            pump.losses, pump.last_event_at = self._bus.losses, time.monotonic()
            return event

    def _check_bus(self, pump: EventPump) -> None:
        """End a request whose events the bus cannot bring (shared/bus.py replays a stream's messages after an
        outage, so a short one costs a stream nothing): the bus down OUTAGE_GRACE_S, or back RESUME_S with the
        stream still silent since the outage. A 503 within seconds, not the event timeout."""
        if self._bus.down_for() > OUTAGE_GRACE_S:
            raise RequestEnded(503, BUS_LOST, "bus lost")
        if pump.losses != self._bus.losses and self._bus.connected:
            if time.monotonic() - max(pump.last_event_at, self._bus.back_at) > RESUME_S:
                raise RequestEnded(503, BUS_LOST, "bus lost")

    def _recipe_lost(self, pump: EventPump) -> bool:
        """The recipe that has the request has not been heard for PRESENCE_TIMEOUT_S (counted from when it took
        the request, and from the bus's last reconnect: the presence of every service pauses with the bus, and
        each comes back within about RECONNECT_MAX_S of the server)."""
        if self._fleet is None or not pump.recipe or not self._bus.connected:
            return False
        heard = self._fleet.last_heard(pump.recipe) or 0.0
        since = max(heard, pump.accepted_at, self._bus.back_at + RECONNECT_MAX_S if self._bus.back_at else 0.0)
        return time.monotonic() - since > PRESENCE_TIMEOUT_S

    async def _take_over(self, pump: EventPump) -> None:
        """Hand the request to another recipe (or the restarted one), to go on from what the client has; a
        RequestEnded (503) when none takes it within RECIPE_TAKEOVER_WAIT_S or it lost too many recipes."""
        assert pump.prepare is not None
        if pump.epoch >= MAX_RECIPE_LOSSES:
            raise RequestEnded(503, RECIPE_LOST, "recipe lost")
        resume = pump.resume()
        log.warning("%s: its recipe is gone; handing it to another with %d tokens streamed", pump.request_id,
                    len(resume.token_ids))
        prepare = dataclasses.replace(pump.prepare, resume=resume)
        deadline = time.monotonic() + RECIPE_TAKEOVER_WAIT_S
        while True:
            left = deadline - time.monotonic()
            try:
                reply = await self._bus.request(subjects.RECIPE_PREPARE, prepare, PrepareReply,
                                                timeout=max(0.1, min(left, self._prepare_timeout_s)))
                break
            except BusTimeout:  # no recipe subscribed yet (restarting) or none answered in time
                if time.monotonic() + TAKEOVER_RETRY_S >= deadline:
                    raise RequestEnded(503, RECIPE_LOST, "recipe lost") from None
                await asyncio.sleep(TAKEOVER_RETRY_S)
        if not reply.ok:
            log.warning("%s: no recipe could take it over (%d)", pump.request_id, reply.status)
            raise RequestEnded(503, RECIPE_LOST, "recipe lost")
        pump.accepted(reply, time.monotonic())

    def _reason(self, exc: BaseException) -> str:
        if self._pumps.closing:
            return "gateway shutting down"
        if isinstance(exc, (ConnectionResetError, asyncio.CancelledError)):
            return "client disconnected"
        return "gateway error"

    async def _cancel(self, request_id: str, reason: str) -> None:
        self._metrics.cancelled(reason)
        try:
            await self._bus.publish(subjects.CANCEL, Cancel(request_id=request_id, reason=reason))
        except Exception as exc:  # the bus is gone: the other hops' TTLs free the request instead
            log.warning("could not publish Cancel for %s (%s): %s", request_id, reason, exc)
