"""The fixed texts of the DeepSeek V4 / V4.1 prompts: control tokens, reasoning-effort prose, the tools prompt,
DSML tool-call markup and the JSON-output instructions.

DSML (DeepSeek markup language) is how the model writes tool calls, and how the history shows past ones:

    <｜DSML｜tool_calls>                                  V4.1 spells the tags "<｜DSML｜ calls>",
    <｜DSML｜invoke name="get_weather">                   "<｜DSML｜ invoke ...>" and "<｜DSML｜ parameter ...>"
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String arguments are written as is (string="true"), any other JSON value as JSON (string="false"). Only
`｜DSML｜`, `<think>` and `</think>` inside these templates are control tokens; names and values are client text.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from services.recipe.conversation import ToolCall
from services.recipe.formats.jsontext import Style, dumps
from services.recipe.formats.prompt import PromptBuilder
from services.recipe.prepared import ToolSpec

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"  # V4.1 only: the V4 tokenizer has no such token
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
BLOCK_LEAD = "\n\n"  # what comes between the answer text and a tool-call block
IMAGE = "<｜image｜>"  # V4.1: an image placeholder (never in CONTROL_TOKENS: template prose has none)
CONTROL_TOKENS = (BOS, EOS, USER, ASSISTANT, SYSTEM, LATEST_REMINDER, THINK, END_THINK, DSML)

V4_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
V4_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
V41_EFFORT = "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
V41_EFFORT_BUDGETS = {"low": 50, "high": 75, "xhigh": 75, "max": 100}

RESPONSE_FORMAT_SCHEMA = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
V4_JSON_OBJECT = (
    "\n\nYou are a helpful assistant designed to output JSON.\n## Response Format:\n\nReply with JSON object ONLY."
)

# The tools prompt before the schemas (one line per entry; {D} DSML, {B}/{I}/{P} the block/invoke/parameter tags).
_TOOLS_HEAD = "\n".join((
    '## Tools',
    '',
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    'writing a "<{D}{B}>" block like the following:',
    '',
    '<{D}{B}>',
    '<{D}{I} name="$TOOL_NAME">',
    '<{D}{P} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}{P}>',
    '...',
    '</{D}{I}>',
    '<{D}{I} name="$TOOL_NAME2">',
    '...',
    '</{D}{I}>',
    '</{D}{B}>',
    '',
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.',
    '',
    'If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning '
    'inside <think>...</think> BEFORE any tool calls or final response.',
    '',
    'Otherwise, output directly after </think> with tool calls or final response.',
    '',
    '### Available Tool Schemas',
    '',
    '',
))
_TOOLS_TAIL = "\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


class Tags:
    """The DSML tag names of one format version."""

    def __init__(self, block: str, invoke: str, parameter: str, json_style: Style, *, schemas_joined: bool) -> None:
        self.block, self.invoke, self.parameter, self.json_style = block, invoke, parameter, json_style
        # V4.1 joins the schema lines ("\n\n" + lines + "\n\n"); V4 ends each with "\n", so an empty list
        # (all tools deferred) leaves one newline fewer.
        self.schemas_joined = schemas_joined

    def tools_prompt(self, out: PromptBuilder, tools: tuple[ToolSpec, ...]) -> None:
        out.markup(_TOOLS_HEAD.format(D=DSML, B=self.block, I=self.invoke, P=self.parameter))
        schemas = (
            {"name": t.name, "description": t.description or "", "parameters": t.parameters}
            for t in tools
            if not t.defer_loading
        )
        lines = [dumps(s, self.json_style) for s in schemas]
        out.text("\n".join(lines) + "\n" if self.schemas_joined else "".join(line + "\n" for line in lines))
        out.markup(_TOOLS_TAIL)

    def open_block(self) -> str:
        return f"{BLOCK_LEAD}<{DSML}{self.block}>\n"

    def parameters(self, out: PromptBuilder, call: ToolCall) -> int:
        """Writes the call's arguments as DSML parameters, one a line; returns how many."""
        arguments = call_arguments(call.arguments)
        for i, (key, value) in enumerate(arguments.items()):
            if i:
                out.text("\n")
            is_str = isinstance(value, str)
            out.markup(f"<{DSML}{self.parameter} name=\"")
            out.text(f'{key}" string="{"true" if is_str else "false"}">')
            out.text(value if is_str else dumps(value, self.json_style))
            out.markup(f"</{DSML}{self.parameter}>")
        return len(arguments)


def call_arguments(arguments: str) -> dict[str, Any]:
    """A history tool call's arguments as a JSON object; anything else (malformed, or not an object) becomes the
    single string argument "arguments", as the reference does: a past call is shown, never refused."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        value = None
    if isinstance(value, dict) and "-0" in arguments:  # rare: redo with the reference's reading of -0
        value = json.loads(arguments, parse_int=_rust_int)
    return value if isinstance(value, dict) else {"arguments": arguments}


def _rust_int(text: str) -> int | float:
    """Rust's JSON parser keeps the sign of -0 (as a float); orjson makes it the integer 0."""
    return -0.0 if text == "-0" else int(text) if -(2**63) <= int(text) < 2**64 else float(text)
