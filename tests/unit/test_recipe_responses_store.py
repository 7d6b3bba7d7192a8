"""Stored responses: what a `previous_response_id` request is expanded to, and which fields it may carry."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.recipe.convert import ConvertOptions, convert
from services.recipe.emit.base import Finish, Usage
from services.recipe.emit.responses import ResponsesEmitter
from services.recipe.errors import ApiError
from services.recipe.responses_store import StoreIntent, annotate, continued, input_items, store_fields
from shared.schemas.responses import StoredResponse

OPTIONS = ConvertOptions(models={"m": "chat_template"})
OUTPUT = [
    {"type": "message", "id": "msg_r1_0", "status": "completed", "role": "assistant", "phase": "final_answer",
     "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Paris."}]},
]


def stored(input_items: list[Any], output: list[Any] = OUTPUT) -> StoredResponse:
    return StoredResponse("t", orjson.dumps({"id": "resp_r1", "output": output}), orjson.dumps(input_items))


def test_store_defaults_to_true_and_fields_are_typed() -> None:
    assert store_fields({}) == (True, None)
    assert store_fields({"store": False, "previous_response_id": "resp_x"}) == (False, "resp_x")
    for body, param in (({"store": "no"}, "store"), ({"previous_response_id": 5}, "previous_response_id"),
                        ({"previous_response_id": ""}, "previous_response_id")):
        with pytest.raises(ApiError) as info:
            store_fields(body)
        assert info.value.status == 400 and orjson.loads(info.value.body)["error"]["param"] == param


def test_a_string_input_is_one_user_message() -> None:
    assert input_items("Hi") == [{"type": "message", "role": "user", "content": "Hi"}]
    assert input_items(None) == [] and input_items([{"role": "user", "content": "x"}]) == [
        {"role": "user", "content": "x"}]


def test_continued_conversation_converts_as_history_then_new_input() -> None:
    previous = stored(input_items("Capital of France?"))
    body = continued({"model": "m", "input": "And of Italy?", "instructions": "Be terse."}, previous)
    messages = convert("responses", body, OPTIONS).conversation.messages
    # the new request's instructions only (OpenAI does not carry the previous ones over), then the history
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be terse."), ("user", "Capital of France?"), ("assistant", "Paris."), ("user", "And of Italy?")]


def test_tool_calls_in_the_output_continue_with_their_results() -> None:
    call = {"type": "function_call", "id": "fc_r1_0", "status": "completed", "call_id": "call_1",
            "name": "weather", "arguments": '{"city": "Paris"}'}
    previous = stored(input_items("Weather?"), [call])
    body = continued({"model": "m", "input": [{"type": "function_call_output", "call_id": "call_1",
                                                "output": "sunny"}]}, previous)
    history = body["input"]
    assert history[1] == call and history[2]["type"] == "function_call_output"
    assert convert("responses", {**body, "model": "DeepSeek-V4-Pro"}).conversation.messages[-1].content == "sunny"


def _response(echo: dict[str, Any]) -> dict[str, Any]:
    emitter = ResponsesEmitter("resp_1", "m", 0, stream=False, echo=echo)
    emitter.finish(Finish("stop", None), Usage())
    return orjson.loads(emitter.body())


def test_the_response_reports_store_and_previous_id() -> None:
    prepared = convert("responses", {"model": "m", "input": "Hi"}, OPTIONS)
    intent = StoreIntent(True, "resp_prev", "t", input_items("Hi"))
    response = _response(annotate(prepared, intent).echo)
    assert response["store"] is True and response["previous_response_id"] == "resp_prev"
    plain = _response(prepared.echo)
    assert plain["store"] is False and plain["previous_response_id"] is None  # the reference's, offline
