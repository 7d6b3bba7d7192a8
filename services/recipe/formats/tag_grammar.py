"""The building blocks of an xgrammar structural tag (JSON), shared by every tool-call grammar: DeepSeek's DSML markup
(dsml_grammar.py) and the Hermes `<tool_call>` markup of chat-template models (hermes_grammar.py).
shared/engine/grammar.py compiles the result; a part labelled {"tool": NAME} (a key xgrammar ignores) is what the
engine compiles alone to name the tool whose schema it cannot use.
"""

from __future__ import annotations

import json
from typing import Any

Format = dict[str, Any]  # one xgrammar structural-tag format, as JSON

JSON_WHITESPACE = 1  # at most one blank in a row inside a JSON value (a small model otherwise pads it)


def structural_tag(fmt: Format) -> str:
    """The whole constraint's spec (what shared/schemas/generate.py's Constraint carries)."""
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def seq(*elements: Format) -> Format:
    return {"type": "sequence", "elements": list(elements)}


def either(formats: list[Format]) -> Format:
    return formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}


def star(content: Format) -> Format:
    return {"type": "star", "content": content}


def lit(text: str) -> Format:
    return {"type": "const_string", "value": text}


def regex(pattern: str) -> Format:
    return {"type": "regex", "pattern": pattern}


def token(token_id: int) -> Format:
    return {"type": "token", "token": token_id}


def json_value(schema: Any) -> Format:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": JSON_WHITESPACE}


def labelled(fmt: Format, tool: str) -> Format:
    return {**fmt, "tool": tool}
