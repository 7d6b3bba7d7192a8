"""DeepSeek V4 and V4.1 prompts, byte-exact with deepseek-recipe 0.2.0 (the oracle in tests/oracle/).

A prompt is BOS, the messages, then the generation prompt:

    <｜begin▁of▁sentence｜>[effort][system + tools prompt + JSON instructions]<｜User｜>question
    <｜Assistant｜></think>answer[DSML tool calls]<｜end▁of▁sentence｜><｜User｜><tool_result>..</tool_result>
    <｜Assistant｜><think>                      (or </think> without thinking; a prefix ends mid-message instead)

The two versions differ in a few rules, each one method of `V4` that `V41` overrides:
- system messages: V4 has no system token and gathers every system message into one leading block;
  V4.1 writes each where it stands, after `<｜System｜>`;
- reasoning effort: V4 prose for high / max (none for low), V4.1 a number 1-100;
- tool results: V4 opens a new user turn for a result that follows user text, V4.1 joins them;
- the order of tool results, DSML details and the JSON-output instructions (see the methods).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.recipe.conversation import Conversation, Message, ReasoningEffort, ToolCall
from services.recipe.formats import dsml
from services.recipe.formats.dsml import (
    ASSISTANT,
    BOS,
    DSML,
    END_THINK,
    EOS,
    IMAGE,
    LATEST_REMINDER,
    SYSTEM,
    THINK,
    USER,
)
from services.recipe.formats.jsontext import dumps
from services.recipe.formats.prompt import PromptBuilder, RenderedPrompt
from services.recipe.prepared import ToolSpec


@dataclass
class _Render:
    """One render's state: the conversation, its prepared message list, and what the system block gets."""

    conv: Conversation
    messages: list[Message]
    tools: tuple[ToolSpec, ...]
    format_text: str


class V4:
    name = "v4"
    tags = dsml.Tags("tool_calls", "invoke", "parameter", "spaced", schemas_joined=False)

    def render(self, conv: Conversation) -> RenderedPrompt:
        messages = self._sort_tool_results(self._normalize(conv.messages))
        ctx = _Render(conv, messages, _shown_tools(conv), self._response_format(conv))
        if (ctx.tools or ctx.format_text) and (not messages or messages[0].role != "system"):
            messages.insert(0, Message("system", ""))  # tools and JSON instructions live in the system block
        out = PromptBuilder(dsml.CONTROL_TOKENS)
        out.special(BOS)
        self._after_bos(out, conv)
        prefix = conv.continues_prefix
        for i in range(len(messages)):
            self._message(out, ctx, i, final_prefix=prefix and i == len(messages) - 1)
        if not prefix:
            out.special(ASSISTANT)
            out.special(THINK if conv.thinking else END_THINK)
        if conv.tool_choice == "required" and conv.tools:  # the model must start with a call, even mid-prefix
            out.markup(self.tags.open_block())
        return out.build()

    # --- message list preparation --------------------------------------------------------------------------

    def _normalize(self, messages: tuple[Message, ...]) -> list[Message]:
        """V4: all system text moves into one leading system message (empty ones dropped from the join);
        consecutive user messages become one, joined by a blank line."""
        systems = [m.content for m in messages if m.role == "system"]
        rest = _merge_users([m for m in messages if m.role != "system"], skip_empty=True)
        if not systems:
            return rest
        return [Message("system", "\n\n".join(s for s in systems if s)), *rest]

    def _sort_tool_results(self, messages: list[Message]) -> list[Message]:
        """V4 orders what follows a tool-calling message by sorting the len(calls) messages right after it
        (when there are that many): tool results by call id (as the calls themselves are shown), everything else
        after them. Results that arrive out of order are sorted, and a message that came between the calls and
        their results moves behind the results:

            [A calls(a, b)] [user q] [result b] [result a]  ->  [A] [result b] [user q] [result a]
        """
        # Positions are taken before any sorting: a window may hold a later tool-calling message, which then
        # sorts the window after its original position.
        windows = [(i + 1, i + 1 + len(m.tool_calls)) for i, m in enumerate(messages) if m.tool_calls]
        for start, end in windows:
            if end <= len(messages):
                messages[start:end] = sorted(messages[start:end], key=_by_call_id)
        return messages

    def _response_format(self, conv: Conversation) -> str:
        fmt = conv.response_format
        if fmt.kind == "json_object":
            return dsml.V4_JSON_OBJECT
        if fmt.kind == "json_schema":
            return dsml.RESPONSE_FORMAT_SCHEMA + dumps(fmt.schema, self.tags.json_style)
        return ""

    # --- one message ---------------------------------------------------------------------------------------

    def _message(self, out: PromptBuilder, ctx: _Render, i: int, *, final_prefix: bool) -> None:
        msg = ctx.messages[i]
        prev = ctx.messages[i - 1] if i else None
        if i == 0:
            self._opening(out, ctx.conv, msg)
        if msg.role == "system":
            self._system(out, ctx, msg, i)
            if i == 0:
                self._system_tail(out, ctx)
        elif msg.role in ("user", "tool"):
            # A user turn goes on (blank line) after user text or results; a result opens a new turn where the
            # version says so.
            if msg.role == "user":
                joins = prev is not None and prev.role in ("user", "tool")
            else:
                joins = self._joins_result(prev)
            if joins:
                out.text("\n\n")
            else:
                out.special(USER)
            if msg.role == "user":
                self._content(out, ctx, msg)
            else:
                out.text("<tool_result>")
                self._content(out, ctx, msg)
                out.text("</tool_result>")
        elif msg.role == "latest_reminder":
            out.special(LATEST_REMINDER)
            out.text(msg.content)
        elif final_prefix:
            self._prefix(out, ctx.conv, msg, i)
        else:
            out.special(ASSISTANT)
            self._past_reasoning(out, ctx.conv, msg, i)
            out.special(END_THINK)
            out.text(msg.content)
            self._tool_calls(out, msg)
            out.special(EOS)

    def _past_reasoning(self, out: PromptBuilder, conv: Conversation, msg: Message, i: int) -> None:
        """Past reasoning stays in the history only while tools are offered (an agent loop needs it); V4 then
        shows any reasoning the client sent back, in thinking mode or not."""
        if conv.offers_tools and msg.reasoning_content is not None:
            out.special(THINK)
            out.text(msg.reasoning_content)

    def _after_bos(self, out: PromptBuilder, conv: Conversation) -> None:
        """V4 writes the reasoning-effort prose right after BOS, messages or not."""
        out.text(self._effort(conv))

    def _opening(self, out: PromptBuilder, conv: Conversation, first: Message) -> None:
        pass

    def _effort(self, conv: Conversation) -> str:
        if not conv.thinking:
            return ""
        effort: ReasoningEffort = conv.reasoning_effort or "high"
        texts = {"low": "", "high": dsml.V4_EFFORT_HIGH, "xhigh": dsml.V4_EFFORT_HIGH, "max": dsml.V4_EFFORT_MAX}
        return texts[effort]

    def _system(self, out: PromptBuilder, ctx: _Render, msg: Message, i: int) -> None:
        out.text(msg.content)

    def _content(self, out: PromptBuilder, ctx: _Render, msg: Message) -> None:
        """A message's text, its image placeholders (V4.1) as control tokens."""
        pos = 0
        for start, source in zip(msg.image_at, msg.images, strict=True):
            out.text(msg.content[pos:start])
            out.image(IMAGE, source)
            pos = start + len(IMAGE)
        out.text(msg.content[pos:])

    def _system_tail(self, out: PromptBuilder, ctx: _Render) -> None:
        if ctx.tools:
            out.text("\n\n")
            self.tags.tools_prompt(out, ctx.tools)
        out.text(ctx.format_text)

    def _joins_result(self, prev: Message | None) -> bool:
        return prev is not None and prev.role == "tool"

    def _prefix(self, out: PromptBuilder, conv: Conversation, msg: Message, i: int) -> None:
        """The continued final assistant message: no end-of-sentence, no generation prompt after it."""
        out.special(ASSISTANT)
        if msg.reasoning_content is not None:
            out.special(THINK)
            out.text(msg.reasoning_content)
        # In thinking mode the reasoning (if any) stays open unless an answer follows it; otherwise it is closed.
        if msg.content or not conv.thinking:
            out.special(END_THINK)
            out.text(msg.content)
        self._tool_calls(out, msg)

    def _tool_calls(self, out: PromptBuilder, msg: Message) -> None:
        """V4 writes the block whenever the message has a tool-call list, even an empty one, calls ordered by id."""
        if msg.tool_calls is None:
            return
        out.markup(f"\n\n<{DSML}{self.tags.block}>")
        for call in sorted(msg.tool_calls, key=lambda c: c.id):
            out.markup(f"\n<{DSML}{self.tags.invoke} name=\"")
            out.text(f'{call.name}">')
            out.text("\n")
            if self.tags.parameters(out, call):
                out.text("\n")
            out.markup(f"</{DSML}{self.tags.invoke}>")
        out.markup(f"\n</{DSML}{self.tags.block}>")


def _merge_users(messages: list[Message], *, skip_empty: bool) -> list[Message]:
    """Consecutive user messages become one, joined by blank lines (V4 leaves empty ones out of the join); their
    images (V4.1) carry over, the placeholder offsets shifted by what precedes them."""
    out: list[Message] = []
    for msg in messages:
        if msg.role == "user" and out and out[-1].role == "user":
            prev = out[-1]
            parts = [prev.content, msg.content]
            if skip_empty:
                parts = [p for p in parts if p]
            shift = len(prev.content) + 2 if len(parts) == 2 else 0
            out[-1] = Message("user", "\n\n".join(parts), images=prev.images + msg.images,
                              image_at=prev.image_at + tuple(shift + p for p in msg.image_at))
        else:
            out.append(msg)
    return out


def _repeated_reminder(messages: tuple[Message, ...], i: int) -> bool:
    return i > 0 and messages[i].role == messages[i - 1].role == "latest_reminder"


def _user_tool_runs(messages: list[Message]) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of user/tool messages."""
    runs = []
    i = 0
    while i < len(messages):
        if messages[i].role in ("user", "tool"):
            start = i
            while i < len(messages) and messages[i].role in ("user", "tool"):
                i += 1
            runs.append((start, i))
        else:
            i += 1
    return runs


def _last_calls(messages: list[Message], before: int) -> tuple[ToolCall, ...]:
    for msg in reversed(messages[:before]):
        if msg.role == "assistant" and msg.tool_calls:
            return msg.tool_calls
    return ()


def _has_call_id(msg: Message) -> bool:
    return msg.role == "tool" and msg.tool_call_id is not None


def _call_ranks(calls: tuple[ToolCall, ...]) -> dict[str, int]:
    """Call id -> its position; a repeated id ranks at its first call."""
    ranks: dict[str, int] = {}
    for i, call in enumerate(calls):
        ranks.setdefault(call.id, i)
    return ranks


def _by_call_id(msg: Message) -> tuple[int, int, str]:
    """Tool results by call id (a result without one first), anything else after them."""
    if msg.role != "tool":
        return (1, 0, "")
    return (0, msg.tool_call_id is not None, msg.tool_call_id or "")


def _result_rank(msg: Message, rank: dict[str, int]) -> int:
    return rank.get(msg.tool_call_id or "", 0)


def _shown_tools(conv: Conversation) -> tuple[ToolSpec, ...]:
    """The tools the prompt offers; deferred ones are left out of the schema list, not out of the section."""
    return conv.tools if conv.offers_tools else ()


class V41(V4):
    name = "v41"
    tags = dsml.Tags(" calls", " invoke", " parameter", "python", schemas_joined=True)

    def _normalize(self, messages: tuple[Message, ...]) -> list[Message]:
        """V4.1 keeps system messages where they stand (each after `<｜System｜>`); users still merge, and of
        consecutive latest reminders only the first is kept."""
        kept = [m for i, m in enumerate(messages) if not _repeated_reminder(messages, i)]
        return _merge_users(kept, skip_empty=False)

    def _sort_tool_results(self, messages: list[Message]) -> list[Message]:
        """V4.1 sorts the results within each run of user/tool messages by the position of their call in the
        last tool-calling message before the run (unknown ids as position 0); user text keeps its place."""
        rank: dict[str, int] = {}
        for start, end in _user_tool_runs(messages):
            rank = _call_ranks(_last_calls(messages, start)) or rank
            # A result without a call id keeps its place, like user text.
            slots = [i for i in range(start, end) if _has_call_id(messages[i])]
            if not rank or len(slots) < 2:
                continue
            results = sorted((messages[i] for i in slots), key=lambda m: _result_rank(m, rank))
            for i, result in zip(slots, results, strict=True):
                messages[i] = result
        return messages

    def _response_format(self, conv: Conversation) -> str:
        if conv.response_format.kind == "json_object":
            return dsml.RESPONSE_FORMAT_SCHEMA + dumps({"type": "json_object"}, "python")
        return super()._response_format(conv)

    def _past_reasoning(self, out: PromptBuilder, conv: Conversation, msg: Message, i: int) -> None:
        if conv.thinking and conv.offers_tools and i > 0:
            out.special(THINK)
            out.text(msg.reasoning_content or "")

    def _after_bos(self, out: PromptBuilder, conv: Conversation) -> None:
        pass

    def _opening(self, out: PromptBuilder, conv: Conversation, first: Message) -> None:
        """V4.1 opens the first message with the effort, after a system token (also when the first message
        is no system message)."""
        effort = self._effort(conv)
        if effort or first.role == "system":
            out.special(SYSTEM)
        out.text(effort)

    def _effort(self, conv: Conversation) -> str:
        if not conv.thinking:
            return ""
        return dsml.V41_EFFORT.format(budget=dsml.V41_EFFORT_BUDGETS[conv.reasoning_effort or "high"])

    def _system(self, out: PromptBuilder, ctx: _Render, msg: Message, i: int) -> None:
        if i:
            out.special(SYSTEM)
        self._content(out, ctx, msg)

    def _joins_result(self, prev: Message | None) -> bool:
        return prev is not None and prev.role in ("user", "tool")

    def _prefix(self, out: PromptBuilder, conv: Conversation, msg: Message, i: int) -> None:
        """V4.1 opens the reasoning of a continued message in thinking mode (unless it is the first message),
        closing it only when an answer or tool calls follow."""
        out.special(ASSISTANT)
        if conv.thinking and i > 0:
            out.special(THINK)
            out.text(msg.reasoning_content or "")
            if msg.content or msg.tool_calls:
                out.special(END_THINK)
                out.text(msg.content)
        else:
            out.special(END_THINK)
            out.text(msg.content)
        self._tool_calls(out, msg)

    def _tool_calls(self, out: PromptBuilder, msg: Message) -> None:
        """V4.1 writes no block for an empty list, and always an (maybe empty) argument line per call."""
        if not msg.tool_calls:
            return
        out.markup(f"\n\n<{DSML}{self.tags.block}>")
        for call in msg.tool_calls:
            out.markup(f"\n<{DSML}{self.tags.invoke} name=\"")
            out.text(f'{call.name}">\n')
            self.tags.parameters(out, call)
            out.text("\n")
            out.markup(f"</{DSML}{self.tags.invoke}>")
        out.markup(f"\n</{DSML}{self.tags.block}>")


FORMATS: dict[str, V4] = {f.name: f for f in (V4(), V41())}
