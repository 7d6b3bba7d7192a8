"""OpenTelemetry GenAI semantic-convention attributes for a request's span at the gateway: what the client asked
for (read from its body, only where a field has the right type: the recipe validates the rest) and what it got."""

from __future__ import annotations

from typing import Any

SYSTEM = "deepinfer"
OPERATIONS = {"chat": "chat", "messages": "chat", "responses": "chat", "completions": "text_completion"}
# the body fields that cap the output, per API; where several are given the smallest applies
MAX_TOKENS = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "messages": ("max_tokens",),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
}
NUMBERS = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "seed": "gen_ai.request.seed",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "n": "gen_ai.request.choice.count",
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def request_attributes(api: str, body: dict[str, Any]) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.system": SYSTEM,  # the older name; gen_ai.provider.name replaces it in newer conventions
        "gen_ai.provider.name": SYSTEM,
        "gen_ai.operation.name": OPERATIONS.get(api, api),
    }
    if isinstance(model := body.get("model"), str):
        attrs["gen_ai.request.model"] = model
    caps = [v for key in MAX_TOKENS.get(api, ()) if isinstance(v := body.get(key), int) and not isinstance(v, bool)]
    if caps:
        attrs["gen_ai.request.max_tokens"] = min(caps)
    for key, attr in NUMBERS.items():
        if _number(value := body.get(key)):
            attrs[attr] = value
    stop = body.get("stop", body.get("stop_sequences"))
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        attrs["gen_ai.request.stop_sequences"] = stop
    return attrs


def response_attributes(model: str, input_tokens: int, output_tokens: int, finish_reason: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.response.model": model,
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
    }
    if finish_reason:
        attrs["gen_ai.response.finish_reasons"] = [finish_reason]
    return attrs
