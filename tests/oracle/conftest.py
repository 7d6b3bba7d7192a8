"""The oracle harness: run one request through deepseek-recipe and through our converter and formats, and report
the first difference in anything that reaches the model or the client.

Compared: the error (status and message) or else the whole conversion (messages, tools, tool choice, thinking,
effort, response format, inference options, parsing options, stream flag), the V4 and V4.1 prompt strings and
their control-token spans, and the V4 token ids. Generated requests come from `Gen`, a random-like interface
over hypothesis draws, so the per-API generators read like plain code and still shrink.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import strategies as st

dr = pytest.importorskip("deepseek_recipe")

from services.recipe.conversation import Conversation  # noqa: E402
from services.recipe.convert import convert  # noqa: E402
from services.recipe.errors import ConversionError, FieldRefusal  # noqa: E402
from services.recipe.formats.deepseek import FORMATS  # noqa: E402
from services.recipe.formats.deepseek_tokenizer import deepseek_v4_encoder, tokenizer_path  # noqa: E402

OPTIONS = dr.ConversionOptions()
REQUESTS = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}
ENCODINGS = {"v4": dr.DeepseekV4Encoding(), "v41": dr.DeepseekV41Encoding()}
STAGES = {
    "ThinkingInitialStage.ReasoningStart": "reasoning_start",
    "ThinkingInitialStage.ReasoningContinuation": "reasoning_continuation",
    "ThinkingInitialStage.ContentContinuation": "content_continuation",
}
# The reference names one of several unanswered Responses calls at random (it keeps them in a HashMap).
RANDOM_MESSAGES = ("No tool output found for tool call ",)
_ENCODER: list[Any] = []


def oracle_encoder() -> Any:
    if not _ENCODER:
        _ENCODER.append(dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(tokenizer_path()))))
    return _ENCODER[0]


def oracle_convert(api: str, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", REQUESTS[api](raw).convert(OPTIONS)
    except dr.ConversionError as exc:
        return "error", (exc.status_code, json.loads(exc.body)["error"]["message"])
    except ValueError as exc:  # a body of the wrong shape: the reference's servers answer 400 with the text
        return "error", (400, str(exc))


def our_convert(api: str, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", convert(api, raw)
    except FieldRefusal as exc:  # a deviation: see documented_refusal
        return "refused", exc
    except ConversionError as exc:
        return "error", (exc.status, exc.message)


def _num(x: float | None) -> float | None:
    return None if x is None else round(float(x), 6)


def _messages(messages: Any) -> list[tuple[Any, ...]]:
    return [
        (m.role, m.content, m.reasoning_content,
         None if m.tool_calls is None else [(t.id, t.name, t.arguments) for t in m.tool_calls],
         m.tool_call_id, m.prefix, _images(m))
        for m in messages
    ]


def _images(m: Any) -> list[tuple[str, str, str, str]]:
    """A message's image sources: (kind, detail, request location, URL), from either side."""
    if hasattr(m, "image_sources"):
        return [(s.kind, s.detail, s.path, s.data_url or s.url or "") for s in m.image_sources]
    return [(s.kind, s.detail, s.path, s.value) for s in m.images]


def _tools(tools: Any) -> list[tuple[Any, ...]]:
    return [(t.name, t.description, json.dumps(t.parameters), t.strict, t.defer_loading) for t in tools]


def oracle_view(r: Any) -> dict[str, Any]:
    c, io, po = r.conversation, r.inference_options, r.parsing_options
    oc = io.output_constraint
    stage = po.thinking_initial_stage
    return {
        "messages": _messages(c.messages), "tools": _tools(c.tools), "tool_choice": c.tool_choice,
        "thinking": c.thinking_mode, "effort": c.reasoning_effort,
        "format": (c.response_format, json.dumps(c.response_schema), c.response_regex),
        "inference": (io.max_tokens, _num(io.temperature), _num(io.top_p), io.seed, io.logprobs, io.top_logprobs,
                      oc and (oc.kind, oc.schema)),
        "parsing": (po.parse_tool_calls, po.starts_in_tool_calls, po.parse_json_output,
                    None if stage is None else STAGES[str(stage)], list(po.stop_sequences)),
        "stream": r.stream,
    }


def our_view(p: Any) -> dict[str, Any]:
    c, io, po = p.conversation, p.inference, p.parsing
    oc = io.output_constraint
    fmt = c.response_format
    return {
        "messages": _messages(c.messages), "tools": _tools(c.tools), "tool_choice": c.tool_choice,
        "thinking": c.thinking, "effort": c.reasoning_effort,
        "format": (fmt.kind, json.dumps(fmt.schema), fmt.regex),
        "inference": (io.max_tokens, _num(io.temperature), _num(io.top_p), io.seed, io.logprobs, io.top_logprobs,
                      oc and (oc.kind, oc.schema)),
        "parsing": (po.parse_tool_calls, po.starts_in_tool_calls, po.parse_json_output, po.thinking_initial_stage,
                    list(po.stop_sequences)),
        "stream": p.stream,
    }


N_REFUSED = "Invalid n value (currently only n = 1 is supported)"  # the reference's words for n != 1


def compare_request(api: str, body: Any) -> str | None:
    """None when both sides agree on `body`, else the first difference."""
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    (o_kind, o), (g_kind, g) = oracle_convert(api, raw), our_convert(api, raw)
    if o_kind == "error" and o[1] == N_REFUSED and isinstance(body, dict) and "n" in body:
        # a deviation: the reference serves n = 1 only, we serve n in [1, 16] (recipe/fanout.py), checked where
        # it checks n; without the field both sides must agree on the rest
        return compare_request(api, {k: v for k, v in body.items() if k != "n"})
    if g_kind == "refused":
        return documented_refusal(api, body, o_kind, o, g)
    if o_kind == "error" or g_kind == "error":
        if o_kind == g_kind and any(o[1].startswith(m) and g[1].startswith(m) for m in RANDOM_MESSAGES):
            return None if o[0] == g[0] else f"status {o[0]} != {g[0]}"
        return None if (o_kind, o) == (g_kind, g) else f"oracle {o_kind} {o if o_kind == 'error' else ''} / ours " \
                                                       f"{g_kind} {g if g_kind == 'error' else ''}"
    ov, gv = oracle_view(o), our_view(g)
    for key in ov:
        if ov[key] != gv[key]:
            return f"{key}: oracle {ov[key]!r} / ours {gv[key]!r}"
    return compare_prompts(o.conversation, g.conversation)


def documented_refusal(api: str, body: Any, o_kind: str, o: Any, refusal: FieldRefusal) -> str | None:
    """Our deliberate 400s (services/recipe/convert/fields.py, image input) come after every check the
    reference makes: the reference must accept the request, and without the refused field both sides must
    agree on the rest. Image and file parts cannot be taken out: the reference's acceptance is what is checked."""
    if isinstance(body, bytes):
        body = json.loads(body)
    if o_kind != "ok":
        return f"oracle error {o} / ours refused {refusal.message!r}: a refusal ahead of the reference's checks"
    if refusal.field is None:
        return None if "image and file input is not supported" in refusal.message else refusal.message
    if not isinstance(body, dict) or refusal.field not in body:
        return f"ours refused {refusal.field!r}, which the body does not have"
    return compare_request(api, {k: v for k, v in body.items() if k != refusal.field})


def compare_prompts(oracle_conv: Any, ours: Conversation) -> str | None:
    """Both formats render every conversation, except that images are V4.1's only: a conversation with image
    sources (only a V4.1 conversion makes one) is compared in V4.1, with its images in placeholder order."""
    with_images = any(m.images for m in ours.messages)
    for name, encoding in ENCODINGS.items():
        if with_images and name == "v4":
            continue
        expected, got = encoding.render_conversation(oracle_conv), FORMATS[name].render(ours)
        if expected.prompt != got.prompt:
            return f"{name} prompt:\n{expected.prompt!r}\n{got.prompt!r}"
        if list(expected.special_ranges) != list(got.special_ranges):
            return f"{name} control-token spans differ"
        if _images(_Sources(expected.image_sources)) != _images(_Sources(got.images)):
            return f"{name} image order differs"
    if with_images:
        return None
    if oracle_encoder().encode(oracle_conv) != deepseek_v4_encoder().encode(FORMATS["v4"].render(ours)):
        return "v4 token ids differ"
    return None


class _Sources:
    """A rendered prompt's images, shaped like a message for `_images`."""

    def __init__(self, sources: Any) -> None:
        if sources and hasattr(sources[0], "value"):
            self.images = sources
        else:
            self.image_sources = sources


class Gen:
    """random.Random's interface over hypothesis draws, so generators shrink like any strategy."""

    def __init__(self, draw: Any) -> None:
        self._draw = draw

    def chance(self, p: float) -> bool:
        return self._draw(st.integers(0, 99)) < p * 100

    def choice(self, items: Any) -> Any:
        return self._draw(st.sampled_from(list(items)))

    def between(self, lo: int, hi: int) -> int:
        return self._draw(st.integers(lo, hi))

    def sample(self, items: list[Any], k: int) -> list[Any]:
        return self._draw(st.permutations(items))[:k]

    def shuffled(self, items: list[Any]) -> list[Any]:
        return self._draw(st.permutations(items))

    def unicode(self) -> str:
        return self._draw(st.text(max_size=6))

    def number(self) -> Any:
        return self._draw(st.one_of(st.integers(-10**20, 10**20), st.floats(allow_nan=False, allow_infinity=False)))


# Spellings of the template's control tokens, JSON-ish text and odd whitespace: the texts that break templates.
WORDS = [
    "a", "b", "x y", "json", "JSON", "\n", " ", "\t", "é", "😀", "", "<｜User｜>", "<｜Assistant｜>", "<think>",
    "</think>", "｜DSML｜", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜System｜>", "<｜latest_reminder｜>",
    "<tool_result>", '{"a": 1}', "<｜DSML｜tool_calls>", "123", "\n\n",
]
MODELS = ["DeepSeek-V4-Pro"] * 4 + ["DeepSeek-V4.1-Flash"] * 3 + ["gpt-4"]
BAD_VALUES = [None, 5, -1, 1.5, "s", True, [], [1], {}]


def text(g: Gen, n: int = 3) -> str:
    return "".join(g.unicode() if g.chance(0.15) else g.choice(WORDS) for _ in range(g.between(0, n)))


def arguments(g: Gen) -> str:
    """Tool-call arguments as a client sends them: JSON text, usually an object, sometimes not."""
    if g.chance(0.1):
        return g.choice(["not json", "", "[1]", '"s"', "5", " {} "])
    keys = ["a", "b c", 'q"', "z", "é"]
    return json.dumps({g.choice(keys): g.choice(["s", None, True, [1, {"k": 2}], "<think>"]) if g.chance(0.6)
                       else g.number() for _ in range(g.between(0, 3))}, ensure_ascii=g.chance(0.5))


def schema(g: Gen, depth: int = 0) -> dict[str, Any]:
    kind = g.choice(["scalar", "scalar", "object", "array", "any_of"] if depth < 2 else ["scalar"])
    if kind == "scalar":
        out: dict[str, Any] = {"type": g.choice(["string", "number", "integer", "boolean"])}
        if g.chance(0.3):
            out["description"] = text(g)
        return out
    if kind == "object":
        props = {k: schema(g, depth + 1) for k in g.sample(["a", "b", "c d"], g.between(0, 2))}
        return {"type": "object", "properties": props, **({"required": ["a"]} if g.chance(0.2) else {})}
    if kind == "array":
        return {"type": "array", "items": schema(g, depth + 1)}
    return {"anyOf": [schema(g, depth + 1), {"type": "null"}]}


def parameters(g: Gen) -> dict[str, Any]:
    return {"type": "object", "properties": {k: schema(g) for k in g.sample(["a", "b", "c d"], g.between(0, 3))}}


def mutate(g: Gen, body: dict[str, Any]) -> None:
    """One field somewhere replaced by a value of the wrong kind, or deleted: an invalid request."""
    paths: list[tuple[Any, ...]] = []

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        paths.append(path)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            walk(item, (*path, key))

    walk(body, ())
    path = g.choice(paths[1:])
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and g.chance(0.3):
        del parent[path[-1]]
    else:
        parent[path[-1]] = g.choice(BAD_VALUES)
