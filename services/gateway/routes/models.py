"""GET /v1/models and /v1/models/{id}: the served model(s), as OpenAI lists them, with vLLM's `max_model_len`.

The gateway holds no model: each listing asks the recipe (`recipe.models`) for the context lengths it enforces.
Without an answer in time the last known lengths are shown (a model's length does not change while it is
served), and a model never seen yet is listed without one rather than not at all.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from services.gateway.errors import ApiError, json_response
from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.schemas.gateway import ModelsReply, ModelsRequest

LENGTHS_TIMEOUT_S = 2.0  # a listing must stay quick when no recipe answers


class ModelsHandler:
    def __init__(self, names: list[str], created: int, bus: Bus | None = None) -> None:
        self._names = names
        self._created = created
        self._bus = bus
        self._lengths: dict[str, int] = {}  # model name -> max_model_len, as the recipe last said

    async def _refresh(self) -> None:
        if self._bus is None:
            return
        try:
            reply = await self._bus.request(subjects.RECIPE_MODELS, ModelsRequest(), ModelsReply,
                                            timeout=LENGTHS_TIMEOUT_S)
        except BusTimeout:
            return
        self._lengths.update({card.name: card.max_model_len for card in reply.models})

    def _card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": self._created, "owned_by": "deepinfer"}
        if name in self._lengths:
            card["max_model_len"] = self._lengths[name]
        return card

    async def list(self, request: web.Request) -> web.Response:
        await self._refresh()
        data = [self._card(name) for name in self._names]
        return json_response(200, orjson.dumps({"object": "list", "data": data}))

    async def get(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name not in self._names:
            raise ApiError(404, f"The model '{name}' does not exist", code="model_not_found")
        await self._refresh()
        return json_response(200, orjson.dumps(self._card(name)))
