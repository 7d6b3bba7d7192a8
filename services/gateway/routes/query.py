"""Requests the recipe answers in one reply, status and JSON body, with nothing generated (no events, no
cancel): vLLM's /tokenize and /detokenize, stored responses (GET / DELETE /v1/responses/{id})."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.auth import presented_key, tenant_of
from services.gateway.errors import ApiError, bus_down, json_response
from services.gateway.routes.generate import read_json_object
from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.schemas.gateway import DetokenizeRequest, JsonReply, StoredResponseQuery, TokenizeRequest


class RecipeQueries:
    def __init__(self, bus: Bus, *, timeout_s: float, max_body_bytes: int) -> None:
        self._bus = bus
        self._timeout_s = timeout_s
        self._max_body_bytes = max_body_bytes

    async def _ask(self, subject: str, message: Any) -> web.Response:
        if not self._bus.connected:
            raise bus_down()
        try:
            reply = await self._bus.request(subject, message, JsonReply, timeout=self._timeout_s)
        except BusTimeout:
            raise ApiError(503, "no recipe is available to answer, try again") from None
        return json_response(reply.status, reply.body)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._max_body_bytes)
        return await self._ask(subjects.RECIPE_TOKENIZE, TokenizeRequest(body))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json_object(request, self._max_body_bytes)
        return await self._ask(subjects.RECIPE_DETOKENIZE, DetokenizeRequest(body))

    def _response_query(self, request: web.Request) -> StoredResponseQuery:
        return StoredResponseQuery(request.match_info["response_id"], tenant_of(presented_key(request.headers)))

    async def get_response(self, request: web.Request) -> web.Response:
        return await self._ask(subjects.RECIPE_RESPONSE_GET, self._response_query(request))

    async def delete_response(self, request: web.Request) -> web.Response:
        return await self._ask(subjects.RECIPE_RESPONSE_DELETE, self._response_query(request))
