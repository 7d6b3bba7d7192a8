"""OpenAI Responses: response.created ... response.completed / response.incomplete, and the `response`
object, as deepseek-recipe shapes them.

Output items open lazily, one per kind of output in turn: a `reasoning` item (rs_<id>_<n>), a `message`
(msg_<id>_<n>), then one `function_call` per tool call (fc_<id>_<n>); n is the output index. Each closes with
its *.done events when the next opens or the response ends. A message that tool calls follow is reported as
"commentary", otherwise as the "final_answer". Ending on max_tokens or a content filter makes the open item
and the response "incomplete". Event keys after "type" are in alphabetical order, as the oracle writes them.

Logprobs (when asked): each `response.output_text.delta` carries the entries of the tokens behind its text
(emit/logprobs.py), and the message's `output_text` part (in its *.done events and the response) all of them;
reasoning text reports none, as deepseek-recipe does.

The response object reports request settings (`echo`, filled by the input side's conversion): instructions,
max_output_tokens, reasoning, temperature, text, tool_choice, tools, top_logprobs, top_p, user, and (from the
service, which keeps stored responses) store and previous_response_id. They may come
as the request wrote them: absent ones get the reference's defaults and `reasoning`, `text` and function /
namespace tools get the reference's full shape (missing fields as null, its key order).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from services.recipe.emit.base import Finish, StreamEvent, Usage, dumps
from services.recipe.emit.chat import call_id
from services.recipe.emit.logprobs import Entry, openai_json
from services.recipe.parse.stream import Event as ParseEvent

ECHO_DEFAULTS: dict[str, Any] = {
    "instructions": None, "max_output_tokens": None, "reasoning": {"effort": None, "summary": None},
    "temperature": 1.0, "text": {"format": {"type": "text"}, "verbosity": None}, "tool_choice": "auto",
    "tools": [], "top_logprobs": 0, "top_p": 1.0, "user": None,
    "parallel_tool_calls": True,  # ours: the reference reads no such field and always reports true
    # set by the recipe service, which stores responses (responses_store.py); the reference stores none
    "store": False, "previous_response_id": None,
}
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def echo_json(echo: Mapping[str, Any]) -> dict[str, Any]:
    """The request settings in the response's shape (see the module docstring)."""
    out = {k: ECHO_DEFAULTS[k] if echo.get(k) is None else echo[k] for k in ECHO_DEFAULTS}
    reasoning, text = out["reasoning"], out["text"]
    out["reasoning"] = {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}
    out["text"] = {"format": _format(text.get("format") or {"type": "text"}), "verbosity": text.get("verbosity")}
    out["tools"] = [_tool(t) for t in out["tools"]]
    return out


def _format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "name": fmt.get("name"), "schema": fmt.get("schema"),
            "description": fmt.get("description"), "strict": fmt.get("strict")}


def _tool(tool: Any) -> Any:
    if not isinstance(tool, dict):
        return tool
    if tool.get("type") == "function":
        return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                "parameters": tool.get("parameters"), "strict": tool.get("strict")}
    if tool.get("type") == "namespace":
        return {"type": "namespace", "name": tool.get("name"), "description": tool.get("description"),
                "tools": [_tool(t) for t in tool.get("tools") or []]}
    return tool


class ResponsesEmitter:
    done_frame = b""

    def __init__(
        self, response_id: str, model: str, created: int, *, stream: bool, echo: Mapping[str, Any],
        namespaces: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        self._id, self._model, self._created = response_id, model, created
        self._stream = stream
        self._echo = echo_json(echo)
        self._namespaces = namespaces or {}
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # finished output items
        self._item: dict[str, Any] | None = None  # the open one
        self._parts: list[str] = []
        self._logprobs: list[dict[str, Any]] = []  # the open message's
        self._response: dict[str, Any] | None = None

    # --- framing ---------------------------------------------------------------------------------------------

    def _emit(self, out: list[StreamEvent], name: str, data: dict[str, Any]) -> None:
        """`data` holds every key but "type" and "sequence_number", in order; the sequence number is slotted
        in alphabetically (only "text" sorts after it)."""
        if self._stream:
            text = data.pop("text", None) if "text" in data else None
            event = {"type": name, **data, "sequence_number": self._seq}
            if text is not None:
                event["text"] = text
            out.append((name, dumps(event)))
        self._seq += 1

    def _object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                completed_at: int | None, incomplete: dict[str, str] | None) -> dict[str, Any]:
        e = self._echo
        return {
            "id": self._id, "object": "response", "created_at": self._created, "status": status,
            "background": False, "completed_at": completed_at, "content_filters": None, "error": None,
            "frequency_penalty": 0.0, "incomplete_details": incomplete, "instructions": e["instructions"],
            "max_output_tokens": e["max_output_tokens"], "max_tool_calls": None, "model": self._model,
            "moderation": None, "output": output, "parallel_tool_calls": e["parallel_tool_calls"], "presence_penalty": 0.0,
            "previous_response_id": e["previous_response_id"], "prompt_cache_key": None, "prompt_cache_retention": None,
            "reasoning": e["reasoning"], "safety_identifier": None, "service_tier": "default", "store": e["store"],
            "temperature": e["temperature"], "text": e["text"], "tool_choice": e["tool_choice"],
            "tools": e["tools"], "top_logprobs": e["top_logprobs"], "top_p": e["top_p"], "truncation": "disabled",
            "usage": usage, "user": e["user"], "metadata": {},
        }

    # --- items -----------------------------------------------------------------------------------------------

    def _open(self, item: dict[str, Any], out: list[StreamEvent]) -> None:
        index = len(self._items)
        self._item, self._parts, self._logprobs = item, [], []
        self._index, self._item_id = index, item["id"]
        self._emit(out, "response.output_item.added", {"item": item, "output_index": index})
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        elif item["type"] == "message":
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        else:
            return
        self._emit(out, "response.content_part.added",
                   {"content_index": 0, "item_id": item["id"], "output_index": index, "part": part})

    def _close(self, out: list[StreamEvent], status: str, phase: str = "final_answer") -> None:
        item, index, item_id = self._item, self._index, self._item_id
        assert item is not None
        text = "".join(self._parts)
        where = {"item_id": item_id, "output_index": index}
        if item["type"] == "function_call":
            self._emit(out, "response.function_call_arguments.done", {"arguments": text, **where})
            done = {**item, "status": status, "arguments": text}
        else:
            if item["type"] == "reasoning":
                name, part = "response.reasoning_text.done", {"type": "reasoning_text", "text": text}
                self._emit(out, name, {"content_index": 0, **where, "text": text})
                done = {**item, "status": status, "content": [part]}
            else:
                part = {"type": "output_text", "annotations": [], "logprobs": self._logprobs, "text": text}
                self._emit(out, "response.output_text.done",
                           {"content_index": 0, "item_id": item_id, "logprobs": self._logprobs,
                            "output_index": index, "text": text})
                done = {**item, "status": status, "phase": phase, "content": [part]}
            self._emit(out, "response.content_part.done", {"content_index": 0, **where, "part": part})
        self._emit(out, "response.output_item.done", {"item": done, "output_index": index})
        self._items.append(done)
        self._item = None

    def start(self, usage: Usage) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        response = self._object("in_progress", [], None, None, None)
        self._emit(out, "response.created", {"response": response})
        self._emit(out, "response.in_progress", {"response": response})
        return out

    def event(self, ev: ParseEvent, out: list[StreamEvent], logprobs: list[Entry] | None = None) -> None:
        kind = ev[0]
        item = self._item
        if kind == "content":
            if item is None or item["type"] != "message":
                if item is not None:
                    self._close(out, "completed")
                n = len(self._items)
                self._open({"type": "message", "id": f"msg_{self._id}_{n}", "status": "in_progress",
                            "role": "assistant", "phase": "final_answer", "content": []}, out)
            self._text_delta("response.output_text.delta", ev[1], out, logprobs=openai_json(logprobs or ()))
        elif kind == "reasoning":
            if item is None or item["type"] != "reasoning":
                if item is not None:
                    self._close(out, "completed")
                n = len(self._items)
                self._open({"type": "reasoning", "id": f"rs_{self._id}_{n}", "status": "in_progress",
                            "content": [], "summary": [], "encrypted_content": f"{self._id}-{n}"}, out)
            self._text_delta("response.reasoning_text.delta", ev[1], out, logprobs=None)
        elif kind == "args":
            self._parts.append(ev[2])
            self._emit(out, "response.function_call_arguments.delta",
                       {"delta": ev[2], "item_id": self._item_id, "output_index": self._index})
        elif kind == "tool":
            if item is not None:
                self._close(out, "completed", phase="commentary")
            n = len(self._items)
            call: dict[str, Any] = {"type": "function_call", "id": f"fc_{self._id}_{n}", "status": "in_progress",
                                    "call_id": call_id(ev[1]), "name": ev[2]}
            if ev[2] in self._namespaces:
                namespace, call["name"] = self._namespaces[ev[2]]
                call["namespace"] = namespace
            call["arguments"] = ""
            self._open(call, out)

    def _text_delta(self, name: str, text: str, out: list[StreamEvent], *,
                    logprobs: list[dict[str, Any]] | None) -> None:
        """`logprobs`: output text's (a list, maybe empty); None for reasoning text, which has no such key."""
        self._parts.append(text)
        data: dict[str, Any] = {"content_index": 0, "delta": text, "item_id": self._item_id}
        if logprobs is not None:
            self._logprobs += logprobs
            data["logprobs"] = logprobs
        data["output_index"] = self._index
        self._emit(out, name, data)

    def finish(self, finish: Finish, usage: Usage) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        incomplete = _INCOMPLETE.get(finish.reason)
        if self._item is not None:
            self._close(out, "incomplete" if incomplete else "completed")
        status = "incomplete" if incomplete else "completed"
        self._response = self._object(status, self._items, usage_json(usage), int(time.time()),
                                      {"reason": incomplete} if incomplete else None)
        self._emit(out, f"response.{status}", {"response": self._response})
        return out

    def body(self) -> bytes:
        assert self._response is not None, "body() before finish()"
        return dumps(self._response)
