"""The recipe's one-reply questions, which generate nothing: vLLM's /tokenize and /detokenize, the served
models' context lengths (/v1/models), and stored responses (GET / DELETE /v1/responses/{id}).

    recipe.tokenize / recipe.detokenize   TokenizeRequest / DetokenizeRequest -> JsonReply (OpenAI error body)
    recipe.models                         ModelsRequest -> ModelsReply
    recipe.responses.get / .delete        StoredResponseQuery -> JsonReply

Every recipe instance answers (queue group): they serve the same models and share the response store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from services.recipe import tokenize
from services.recipe.convert import ConvertOptions
from services.recipe.errors import ConversionError, openai_error
from services.recipe.model import ServedModel
from services.recipe.responses_store import ResponseStore
from shared import subjects
from shared.bus import Bus, Subscription
from shared.schemas.gateway import (
    DetokenizeRequest,
    JsonReply,
    ModelCard,
    ModelsReply,
    ModelsRequest,
    StoredResponseQuery,
    TokenizeRequest,
)


def _answer(work: Callable[[dict[str, Any]], dict[str, Any]], body: bytes) -> JsonReply:
    """Blocking (tokenizing, rendering): run it off the event loop."""
    try:
        parsed = orjson.loads(body)
        if not isinstance(parsed, dict):
            raise ConversionError("the request body must be a JSON object")
        return JsonReply(200, orjson.dumps(work(parsed)))
    except orjson.JSONDecodeError as exc:
        error = openai_error(400, f"invalid JSON request: {exc}")
    except ConversionError as exc:
        code = "model_not_found" if exc.status == 404 else "invalid_request_error"
        error = openai_error(exc.status, exc.message, code=code)
    return JsonReply(error.status, error.body)


class Queries:
    def __init__(self, models: Mapping[str, ServedModel], options: ConvertOptions, store: ResponseStore) -> None:
        self._models = models
        self._options = options
        self._store = store

    async def subscribe(self, bus: Bus) -> list[Subscription]:
        group = subjects.RECIPE_GROUP
        return [
            await bus.serve(subjects.RECIPE_TOKENIZE, TokenizeRequest, self.tokenize, queue=group),
            await bus.serve(subjects.RECIPE_DETOKENIZE, DetokenizeRequest, self.detokenize, queue=group),
            await bus.serve(subjects.RECIPE_MODELS, ModelsRequest, self.models, queue=group),
            await bus.serve(subjects.RECIPE_RESPONSE_GET, StoredResponseQuery, self._store.get, queue=group),
            await bus.serve(subjects.RECIPE_RESPONSE_DELETE, StoredResponseQuery, self._store.delete, queue=group),
        ]

    async def tokenize(self, req: TokenizeRequest) -> JsonReply:
        work = lambda body: tokenize.tokenize(body, self._models, self._options)  # noqa: E731
        return await asyncio.to_thread(_answer, work, req.body)

    async def detokenize(self, req: DetokenizeRequest) -> JsonReply:
        work = lambda body: tokenize.detokenize(body, self._models)  # noqa: E731
        return await asyncio.to_thread(_answer, work, req.body)

    async def models(self, _: ModelsRequest) -> ModelsReply:
        return ModelsReply([ModelCard(m.name, m.context_length) for m in self._models.values()])
