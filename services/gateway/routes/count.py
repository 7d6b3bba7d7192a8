"""POST /v1/messages/count_tokens: the recipe renders and encodes the request and answers with its size."""

from __future__ import annotations

from aiohttp import web

from services.gateway.errors import ApiError, bus_down, json_response
from services.gateway.routes.table import ApiRoute
from services.gateway.routes.generate import read_json_object
from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.schemas.gateway import CountTokensReply, CountTokensRequest


class CountTokensHandler:
    def __init__(self, bus: Bus, *, timeout_s: float, max_body_bytes: int) -> None:
        self._bus = bus
        self._timeout_s = timeout_s
        self._max_body_bytes = max_body_bytes

    async def handle(self, request: web.Request, route: ApiRoute) -> web.Response:
        body = await read_json_object(request, self._max_body_bytes)
        if not self._bus.connected:
            raise bus_down()
        try:
            reply = await self._bus.request(
                subjects.RECIPE_COUNT_TOKENS, CountTokensRequest(route.api, body), CountTokensReply,
                timeout=self._timeout_s,
            )
        except BusTimeout:
            raise ApiError(503, "no recipe is available to count the tokens") from None
        return json_response(reply.status, reply.body)
