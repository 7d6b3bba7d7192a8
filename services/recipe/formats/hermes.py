"""The Hermes tool-call convention (NousResearch Hermes 2 Pro, Qwen2.5, what vLLM's `--tool-call-parser hermes`
reads): how a chat-template model is offered tools, shown its past calls and their results, and writes a call.

    offered   a system block: "# Tools", the tools' JSON schemas one a line inside <tools></tools>, and the
              convention below (SYSTEM_BLOCK; after the client's own system text, as Qwen2.5's template puts it)
    a call    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
              (one after another, "\\n" between, for parallel calls)
    a result  <tool_response>\\n...\\n</tool_response>, in a user turn (consecutive results share one)

This is what a template that does not read `tools` (SmolLM2) gets, written into its messages' text; a template
that reads `tools` renders all of it itself (formats/chat_template.py). Either way the model writes the call
markup above, which the output parser (parse/hermes.py) reads and the tool grammar (hermes_grammar.py) enforces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.recipe.formats.dsml import call_arguments
from services.recipe.prepared import ToolSpec

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_HEAD = '\n{"name": '  # then the name as a JSON string
ARGUMENTS = ', "arguments": '  # then the arguments object
CALL_TAIL = "}\n"  # then CALL_CLOSE
RESPONSE_OPEN = "<tool_response>\n"
RESPONSE_CLOSE = "\n</tool_response>"

SYSTEM_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def function(tool: ToolSpec) -> dict[str, Any]:
    """A tool as the OpenAI function object templates and the system block list."""
    out: dict[str, Any] = {"name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["parameters"] = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": out}


def system_block(tools: Sequence[ToolSpec]) -> str:
    listed = "".join("\n" + _dumps(function(t)) for t in tools if not t.defer_loading)
    return SYSTEM_BLOCK.format(tools=listed)


def call(name: str, arguments: str) -> str:
    """A call as the model writes it; `arguments` is the client's JSON text (a malformed one is shown as the single
    string argument "arguments", as the DeepSeek formats show it)."""
    return f"{CALL_OPEN}{CALL_HEAD}{_dumps(name)}{ARGUMENTS}{_dumps(call_arguments(arguments))}{CALL_TAIL}{CALL_CLOSE}"


def response(content: str) -> str:
    return f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"


def parse_call(inner: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of the text between <tool_call> and </tool_call>, None when it is not a call (not
    JSON, no string name, arguments that are not an object): that text then stays the answer's text, as vLLM's
    parser leaves it. Arguments given as JSON text (some models quote them) are read too."""
    try:
        value = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], _dumps(arguments)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
