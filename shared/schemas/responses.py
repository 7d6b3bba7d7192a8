"""What the recipe keeps of a Responses API response created with `store` (JetStream KV `RESPONSES_BUCKET`,
keyed by the response id): enough to answer GET /v1/responses/{id} and to continue the conversation from it
(`previous_response_id`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    tenant: str  # who created it (API-key hash, "" = anonymous): nobody else sees it
    response: bytes  # the response object as the client got it (JSON), output items included
    input_items: bytes  # the whole conversation before its output (JSON list of input items): the previous
    #                     response's history and output, then this request's own input, in item form
