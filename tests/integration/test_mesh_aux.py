"""vLLM's auxiliary surface and stored responses, through the whole running mesh (real nats-server, every
service its own process, SmolLM2): /tokenize, /detokenize, /version, /ping, max_model_len in /v1/models, the
client's X-Request-Id, structured output (schemas, regex, choice; prefill's first token and decode's rest under
one constraint), and the Responses API's store / previous_response_id / retrieve / delete, across tenants and a
recipe restart.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from services.gateway.routes.version import package_version
from tests.integration.mesh import Mesh, pids_mentioning, start_mesh

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = start_mesh(tmp_path_factory.mktemp("aux"))
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def http(mesh: Mesh) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=mesh.base_url, timeout=120, headers={"Authorization": "Bearer tenant-a"}) as client:
        yield client


def sdk(mesh: Mesh, key: str = "tenant-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def tokenize(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    reply = http.post("/tokenize", json={"model": MODEL, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


# --- /tokenize, /detokenize ----------------------------------------------------------------------------------


def test_tokenize_chat_counts_what_the_chat_request_reports(http: httpx.Client, mesh: Mesh) -> None:
    counted = tokenize(http, {"messages": FRANCE})
    assert counted["count"] == len(counted["tokens"]) and counted["max_model_len"] == 8192
    used = sdk(mesh).chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1, temperature=0)
    assert used.usage.prompt_tokens == counted["count"]
    text = http.post("/detokenize", json={"model": MODEL, "tokens": counted["tokens"]}).json()["prompt"]
    assert "What is the capital of France?" in text and text.endswith("<|im_start|>assistant\n")
    prompt = tokenize(http, {"prompt": "The capital of France is", "return_token_strs": True})
    assert prompt["token_strs"][1] == "Ġcapital"


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "The model `nope` does not exist."),
    ("/tokenize", {"model": MODEL}, 400, "either 'prompt' or 'messages'"),
    ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, 400, "Token id 1000000000 is out of vocabulary"),
    ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "'tokens' must be a list"),
])
def test_tokenize_errors_in_openai_format(http: httpx.Client, path: str, body: dict, status: int, words: str) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == status
    assert words in reply.json()["error"]["message"]
    assert http.post(path, content=b"{oops").status_code == 400


# --- /version, /ping, /v1/models -----------------------------------------------------------------------------


def test_version_ping_and_model_lengths(http: httpx.Client, mesh: Mesh) -> None:
    assert http.get("/version").json() == {"version": package_version()} and package_version() != "unknown"
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["max_model_len"] == 8192
    assert sdk(mesh).models.retrieve(MODEL).model_extra["max_model_len"] == 8192


# --- X-Request-Id ----------------------------------------------------------------------------------------------


def test_client_request_id_names_the_request_and_cannot_collide(http: httpx.Client) -> None:
    def ask(question: str) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 8,
                "temperature": 0}
        return http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "job-7.a:1"})

    questions = ["What is 2 plus 2?", "Name a colour.", "What is the capital of Italy?"]
    alone = [ask(q).json()["choices"][0]["message"]["content"] for q in questions]
    with ThreadPoolExecutor(3) as pool:  # the same client id three times at once: three separate requests
        together = list(pool.map(ask, questions))
    for reply, answer in zip(together, alone):
        assert reply.headers["X-Request-Id"] == "job-7.a:1"
        assert reply.json()["id"] == "chatcmpl-job-7.a:1"  # vLLM's: the id derives from the client's
        assert reply.json()["choices"][0]["message"]["content"] == answer
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "s-1"}) as stream:
        assert stream.headers["X-Request-Id"] == "s-1" and "chatcmpl-s-1" in stream.read().decode()
    ours = http.post("/v1/chat/completions", json={**body, "stream": False})
    assert len(ours.headers["X-Request-Id"]) == 32  # none given: the mesh's own id
    bad = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "x" * 129})
    assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]


# --- structured output ----------------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON."}]


def _streamed(client: openai.OpenAI, **body: Any) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **body):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


# strict: the schema as the reference normalizes it (which drops maxLength: greedy SmolLM2 names are short)
@pytest.mark.parametrize("temperature, strict", [(0.0, True), (1.0, False)], ids=["greedy-strict", "seeded"])
def test_a_json_schema_answer_validates_streaming_and_not(mesh: Mesh, temperature: float, strict: bool) -> None:
    client = sdk(mesh)
    body = {"model": MODEL, "messages": ASK_PERSON, "max_tokens": 60, "temperature": temperature, "seed": 3,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}}
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "stop", whole.message.content  # the grammar ended it, not max_tokens
    jsonschema.validate(json.loads(whole.message.content), PERSON)
    assert _streamed(client, **body) == (whole.message.content, "stop")  # same tokens, any chunking


def test_responses_and_messages_take_a_schema_too(mesh: Mesh, http: httpx.Client) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": False}
    answer = sdk(mesh).responses.create(model=MODEL, input=ASK_PERSON[0]["content"], text={"format": fmt},
                                        max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(answer.output_text), PERSON)
    body = {"model": MODEL, "max_tokens": 60, "temperature": 0, "messages": ASK_PERSON,
            "output_format": {"type": "json_schema", "schema": PERSON}}
    reply = http.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    (block,) = reply.json()["content"]
    jsonschema.validate(json.loads(block["text"]), PERSON)
    assert reply.json()["stop_reason"] == "end_turn"


def test_regex_choice_and_json_object_hold_and_a_bad_regex_is_a_400(mesh: Mesh) -> None:
    client = sdk(mesh)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Give me a code, in json if asked."}],
           "max_tokens": 40, "temperature": 1.0, "seed": 9}
    code = client.chat.completions.create(**ask, extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", code.choices[0].message.content)
    choice = client.chat.completions.create(**ask, extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert choice.choices[0].message.content in ("alpha", "beta", "gamma")
    paris = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    anything = client.chat.completions.create(**{**ask, "messages": paris, "temperature": 0},
                                              response_format={"type": "json_object"}).choices[0]
    assert anything.finish_reason == "stop" and "Paris" in json.loads(anything.message.content).values()
    done = client.completions.create(model=MODEL, prompt="The year was", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"regex": " [0-9]{4}\\."}})
    assert re.fullmatch(" [0-9]{4}\\.", done.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="invalid regex constraint"):
        client.chat.completions.create(**ask, extra_body={"structured_outputs": {"regex": "(unclosed"}})


# --- tool calls (the Hermes convention for a chat-template model, constrained by the tool choice) ----------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ASK_WEATHER = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast",
                                                 "parameters": WEATHER}}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The local time",
                                               "parameters": {"type": "object", "properties": {}}}}


def test_a_forced_tool_call_parses_over_the_openai_sdk_streaming_and_not(mesh: Mesh) -> None:
    client = sdk(mesh)
    body = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER_TOOL, CLOCK_TOOL], "max_tokens": 80,
            "temperature": 0, "tool_choice": "required", "parallel_tool_calls": False}
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    (call,) = whole.message.tool_calls  # parallel_tool_calls false: exactly one
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    named = client.chat.completions.create(**{**body, "tool_choice": {"type": "function",
                                                                     "function": {"name": "get_weather"}}})
    (forced,) = named.choices[0].message.tool_calls
    assert forced.function.name == "get_weather"
    jsonschema.validate(json.loads(forced.function.arguments), WEATHER)
    names, arguments, reason = [], "", None
    for chunk in client.chat.completions.create(**{**body, "tool_choice": named_choice("get_weather")}, stream=True):
        if chunk.choices:
            for delta in chunk.choices[0].delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
    assert (names, arguments, reason) == (["get_weather"], forced.function.arguments, "tool_calls")


def named_choice(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_anthropic_any_tool_and_a_responses_function_call(mesh: Mesh) -> None:
    claude = anthropic.Anthropic(base_url=mesh.base_url, api_key="tenant-a", max_retries=0, timeout=120)
    message = claude.messages.create(
        model=MODEL, max_tokens=80, messages=ASK_WEATHER, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "description": "The weather forecast", "input_schema": WEATHER}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    answer = sdk(mesh).responses.create(
        model=MODEL, input=ASK_WEATHER[0]["content"], max_output_tokens=80, temperature=0,
        tools=[{"type": "function", **WEATHER_TOOL["function"]}], parallel_tool_calls=False,
        tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [item for item in answer.output if item.type == "function_call"]
    assert call.name == "get_weather" and answer.parallel_tool_calls is False
    jsonschema.validate(json.loads(call.arguments), WEATHER)


# --- the Responses API's stored responses ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_turn(mesh: Mesh) -> openai.types.responses.Response:
    return sdk(mesh).responses.create(model=MODEL, input="My name is Ada.", instructions="Answer in French.",
                                      max_output_tokens=12, temperature=0)


def test_previous_response_id_continues_the_stored_conversation(
    mesh: Mesh, http: httpx.Client, first_turn: openai.types.responses.Response
) -> None:
    client = sdk(mesh)
    assert first_turn.store is True and first_turn.previous_response_id is None
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first_turn.id,
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first_turn.id and second.id != first_turn.id
    # The prompt is the stored conversation, then the new input; the first turn's instructions are not carried.
    history = [{"role": "user", "content": "My name is Ada."},
               {"role": "assistant", "content": first_turn.output_text},
               {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == tokenize(http, {"messages": history})["count"]
    stream = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=second.id,
                                     max_output_tokens=4, temperature=0, stream=True)
    (done,) = [e.response for e in stream if e.type in ("response.completed", "response.incomplete")]
    kept = client.responses.retrieve(done.id)  # a streamed response is stored too, before its last event
    assert kept.id == done.id and kept.previous_response_id == second.id and kept.output_text == done.output_text


def test_retrieve_delete_store_false_and_unknown_ids(mesh: Mesh, http: httpx.Client) -> None:
    client = sdk(mesh)
    made = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0)
    kept = client.responses.retrieve(made.id)
    assert kept.output_text == made.output_text and kept.usage.input_tokens == made.usage.input_tokens
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)
    unstored = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for previous in (made.id, unstored.id, "resp_never", "not a key*"):
        reply = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": previous})
        assert reply.status_code == 404
        assert reply.json()["error"] == {
            "message": f"Previous response with id '{previous}' not found.", "type": "invalid_request_error",
            "param": "previous_response_id", "code": "previous_response_not_found"}


def test_another_tenant_sees_nothing(mesh: Mesh, first_turn: openai.types.responses.Response) -> None:
    other = sdk(mesh, key="tenant-b")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first_turn.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first_turn.id)
    with pytest.raises(openai.NotFoundError, match="Previous response"):
        other.responses.create(model=MODEL, input="Hi", previous_response_id=first_turn.id)
    assert sdk(mesh).responses.retrieve(first_turn.id).id == first_turn.id  # still there for its owner


def test_stored_responses_survive_a_recipe_restart(mesh: Mesh, first_turn: openai.types.responses.Response) -> None:
    (pid,) = [p for p in pids_mentioning(str(mesh.state_dir))
              if b"services.recipe" in open(f"/proc/{p}/cmdline", "rb").read()]
    os.kill(pid, signal.SIGKILL)
    client = sdk(mesh)
    deadline = time.monotonic() + 120  # the launcher restarts it; it answers once its model is loaded
    while True:
        try:
            kept = client.responses.retrieve(first_turn.id)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline, exc
            time.sleep(0.5)
    assert kept.output_text == first_turn.output_text
    assert any("recipe-0 exited" in line for line in mesh.output)
