"""GET /v1/models and /v1/models/{id}: the served model(s), as OpenAI lists them."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from services.gateway.errors import ApiError, json_response


class ModelsHandler:
    def __init__(self, names: list[str], created: int) -> None:
        self._names = names
        self._created = created

    def _card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "deepinfer"}

    async def list(self, request: web.Request) -> web.Response:
        data = [self._card(name) for name in self._names]
        return json_response(200, orjson.dumps({"object": "list", "data": data}))

    async def get(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name not in self._names:
            raise ApiError(404, f"The model '{name}' does not exist", code="model_not_found")
        return json_response(200, orjson.dumps(self._card(name)))
