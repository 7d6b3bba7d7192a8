"""Stored responses of the OpenAI Responses API: `store`, `previous_response_id`, GET and DELETE by id.

    request {store?: true, previous_response_id?, input}
      --expand--> input = previous.input_items + previous.response.output + this input   (StoreIntent)
      --convert, generate--> the response  --keep (before the client sees it done)--> KV[response id]

A response created with `store` (OpenAI's default: true) is kept in a JetStream KV bucket shared by every
recipe instance, so any of them continues it and a restarted one still finds it; each entry lives for the
bucket's TTL (`--response-ttl`). What is kept is the conversation in item form: the input items as the request
was expanded (history first) and the response object, whose `output` items are valid input items. As in
OpenAI, `instructions` (and tools) are not carried over: only items are. A response is visible only to the
tenant that created it; any other tenant, an unknown or an expired id get the same 404.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import orjson

from services.recipe.errors import ApiError, openai_error
from services.recipe.prepared import PreparedRequest
from shared.bus import KeyValueBucket
from shared.schemas.gateway import JsonReply, StoredResponseQuery
from shared.schemas.responses import StoredResponse

log = logging.getLogger(__name__)

INTENT = "store_intent"  # PreparedRequest.extra key


@dataclass(frozen=True)
class StoreIntent:
    """What a Responses request asked of the store, settled before it is converted."""

    store: bool
    previous_response_id: str | None
    tenant: str
    input_items: list[Any]  # the whole conversation before this response's output, in item form


def _bad(message: str, param: str) -> ApiError:
    return openai_error(400, message, param=param, code="invalid_request_error")


def not_found(response_id: str) -> ApiError:
    return openai_error(404, f"Response with id '{response_id}' not found.", code="response_not_found")


def previous_not_found(response_id: str) -> ApiError:
    return openai_error(404, f"Previous response with id '{response_id}' not found.",
                        param="previous_response_id", code="previous_response_not_found")


def store_fields(body: dict[str, Any]) -> tuple[bool, str | None]:
    store, previous = body.get("store"), body.get("previous_response_id")
    if store is not None and not isinstance(store, bool):
        raise _bad("Invalid type for 'store': expected a boolean.", "store")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _bad("Invalid type for 'previous_response_id': expected a non-empty string.", "previous_response_id")
    return store is not False, previous


def input_items(value: Any) -> list[Any]:
    """`input` in item form: a string is one user message. Anything malformed is passed on as it is, for the
    conversion to refuse with the reference's message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return value
    return []


def continued(body: dict[str, Any], previous: StoredResponse) -> dict[str, Any]:
    """The request with the stored conversation before its own input."""
    output = orjson.loads(previous.response).get("output") or []
    new = body.get("input")
    if new is not None and not isinstance(new, (str, list)):
        return body  # malformed input: the conversion refuses it as it stands
    return {**body, "input": [*orjson.loads(previous.input_items), *output, *input_items(new)]}


def annotate(prepared: PreparedRequest, intent: StoreIntent) -> PreparedRequest:
    """The response reports `store` and `previous_response_id`; the intent rides along until it is kept."""
    echo = {**prepared.echo, "store": intent.store, "previous_response_id": intent.previous_response_id}
    return replace(prepared, echo=echo, extra={**prepared.extra, INTENT: intent})


def deleted_body(response_id: str) -> bytes:
    return orjson.dumps({"id": response_id, "object": "response", "deleted": True})


class ResponseStore:
    def __init__(self, bucket: KeyValueBucket[StoredResponse]) -> None:
        self._bucket = bucket

    async def _load(self, response_id: str, tenant: str) -> StoredResponse | None:
        if not self._bucket.valid_key(response_id):  # no such key can exist
            return None
        stored = await self._bucket.get(response_id)
        return stored if stored is not None and stored.tenant == tenant else None

    async def expand(self, body: bytes, tenant: str) -> tuple[bytes | dict[str, Any], StoreIntent | None]:
        """The body to convert and what to store. Raises ApiError (400 bad fields, 404 unknown previous id)."""
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body, None  # the conversion answers with the reference's message
        if not isinstance(parsed, dict):
            return body, None
        store, previous_id = store_fields(parsed)
        if previous_id is not None:
            previous = await self._load(previous_id, tenant)
            if previous is None:
                raise previous_not_found(previous_id)
            parsed = continued(parsed, previous)
        return parsed, StoreIntent(store, previous_id, tenant, input_items(parsed.get("input")))

    async def keep(self, prepared: PreparedRequest, response: bytes) -> None:
        """Store a finished response if its request asked for it. A failure (the bus, a record too large) is
        logged: the client still gets its response, but cannot continue from it."""
        intent = prepared.extra.get(INTENT)
        if not isinstance(intent, StoreIntent) or not intent.store:
            return
        response_id = orjson.loads(response)["id"]
        record = StoredResponse(intent.tenant, response, orjson.dumps(intent.input_items))
        try:
            await self._bucket.put(response_id, record)
        except Exception as exc:
            log.warning("%s: could not store the response: %s", response_id, exc)

    async def get(self, query: StoredResponseQuery) -> JsonReply:
        stored = await self._load(query.response_id, query.tenant)
        if stored is None:
            error = not_found(query.response_id)
            return JsonReply(error.status, error.body)
        return JsonReply(200, stored.response)

    async def delete(self, query: StoredResponseQuery) -> JsonReply:
        if await self._load(query.response_id, query.tenant) is None:
            error = not_found(query.response_id)
            return JsonReply(error.status, error.body)
        await self._bucket.delete(query.response_id)
        return JsonReply(200, deleted_body(query.response_id))
