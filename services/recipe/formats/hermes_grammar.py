"""The grammar of a Hermes tool call (formats/hermes.py), as an xgrammar structural tag: what a chat-template model's
`tool_choice` constrains the output to (shared/engine/grammar.py compiles and enforces it).

    required / named / must_call   call ("\\n" call)*          (one call without parallel_tool_calls), then the end
    auto                           any text; once <tool_call> comes, one whole call (then text again, and more
                                   calls, or the end without parallel_tool_calls)

    call   <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>     ARGS: JSON of the tool's schema

The prompt opens nothing (unlike DSML's required prompt), so required and must_call are one mode. Where the
tokenizer has <tool_call> / </tool_call> as tokens of their own (Qwen2.5's added tokens, which the engine's
vocabulary gives no text: see shared/engine/grammar.py MARKUP_PREFIX), the grammar names them by id; otherwise
(SmolLM2) they are text, spelled by ordinary tokens (and any spelling of <tool_call> triggers the call). Each
tool's part carries {"tool": NAME} (tag_grammar.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from services.recipe.formats import hermes
from services.recipe.formats.dsml_grammar import Mode
from services.recipe.formats.tag_grammar import Format, either, json_value, labelled, lit, seq, star, structural_tag, token
from services.recipe.prepared import ToolSpec


def spec(tools: Sequence[ToolSpec], mode: Mode, open_id: int | None = None, close_id: int | None = None,
         parallel: bool = True) -> str:
    """The structural tag (JSON text). `open_id` / `close_id`: the ids of <tool_call> / </tool_call> where each is a
    token of its own (None: text); `parallel`: more than one call may come (parallel_tool_calls), else one."""
    bodies = either([_body(t) for t in tools])
    begin = token(open_id) if open_id is not None else hermes.CALL_OPEN
    end = token(close_id) if close_id is not None else hermes.CALL_CLOSE
    tag: Format = {"type": "tag", "begin": begin, "content": bodies, "end": end}
    if mode != "auto":
        return structural_tag(seq(tag, star(seq(lit("\n"), tag))) if parallel else tag)
    if open_id is not None:
        # free text may not hold the closing token: the parser reads its spelling, so a call whose opening tag
        # were spelled in ordinary tokens (no trigger) could otherwise close unconstrained
        excludes = [close_id] if close_id is not None else []
        fmt: Format = {"type": "token_triggered_tags", "trigger_tokens": [open_id], "exclude_tokens": excludes,
                       "tags": [tag], "stop_after_first": not parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": [hermes.CALL_OPEN], "tags": [tag],
               "stop_after_first": not parallel}
    return structural_tag(fmt)


def _body(tool: ToolSpec) -> Format:
    """What comes between the call's tags for this tool."""
    schema = tool.parameters if isinstance(tool.parameters, dict) and tool.parameters else {"type": "object"}
    head = f"{hermes.CALL_HEAD}{json.dumps(tool.name, ensure_ascii=False)}{hermes.ARGUMENTS}"
    return labelled(seq(lit(head), json_value(schema), lit(hermes.CALL_TAIL)), tool.name)
