"""Hermes tool calls in a chat-template model's answer (formats/hermes.py): the plain parser's text events in, the
same text with each `<tool_call>...</tool_call>` turned into a call's events out.

    ("content", "Let me check.\\n<tool_call>\\n{...}\\n</tool_call>")
        -> ("content", "Let me check."), ("tool", 0, "get_weather"), ("args", 0, '{"city": "Paris"}')

A call is read once its closing tag has come (vLLM's hermes parser reads it whole too): its name is one event and
its arguments one more (OpenAI's stream shape: the name with empty arguments, then the arguments). Text that may
still become `<tool_call>` is held until it does or cannot. What is not a call stays text, never an error: a block
that is not a JSON object with a name and object arguments, and one still open at the end (max_tokens, a stop
sequence). Whitespace right before a call and after the last one is dropped (what lies between the markup, not
answer text); other text is passed on as it came.
"""

from __future__ import annotations

from services.recipe.formats.hermes import CALL_CLOSE, CALL_OPEN, parse_call

Event = tuple  # the stream parser's events (parse/stream.py)


class HermesCalls:
    def __init__(self) -> None:
        self.tool_calls = 0
        self._held = ""  # text that may begin a call, a call still open, or whitespace that may precede one
        self._piece = 0  # the piece of the latest event held text came with

    def feed(self, events: list[Event], pieces: list[int]) -> tuple[list[Event], list[int]]:
        """Events and the piece each came from (OutputParser.event_pieces), converted."""
        out: list[Event] = []
        at: list[int] = []
        for ev, piece in zip(events, pieces):
            if ev[0] != "content":
                self._flush(out, at)  # a stop sequence ended the answer: what is held is text
                out.append(ev)
                at.append(piece)
                continue
            self._piece = piece
            self._text(ev[1], out, at)
        return out, at

    def finish(self) -> tuple[list[Event], list[int]]:
        out: list[Event] = []
        at: list[int] = []
        self._flush(out, at)
        return out, at

    def _text(self, text: str, out: list[Event], at: list[int]) -> None:
        buf = self._held + text
        while True:
            start = buf.find(CALL_OPEN)
            if start < 0:
                break
            end = buf.find(CALL_CLOSE, start + len(CALL_OPEN))
            if end < 0:  # open: held whole, with the whitespace before it (dropped if it proves a call)
                before = buf[:start].rstrip()
                self._emit(before, out, at)
                self._held = buf[len(before) :]
                return
            call = parse_call(buf[start + len(CALL_OPEN) : end])
            if call is None:  # not a call: text, up to and with its closing tag
                self._emit(buf[: end + len(CALL_CLOSE)], out, at)
            else:
                self._emit(buf[:start].rstrip(), out, at)
                out += [("tool", self.tool_calls, call[0]), ("args", self.tool_calls, call[1])]
                at += [self._piece, self._piece]
                self.tool_calls += 1
            buf = buf[end + len(CALL_CLOSE) :]
        # hold what may begin a call (a prefix of <tool_call>), and trailing whitespace (it may precede one)
        keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(buf)), 0, -1) if CALL_OPEN.startswith(buf[-k:])), 0)
        body = buf[: len(buf) - keep]
        blank = len(body) - len(body.rstrip())
        self._emit(body[: len(body) - blank], out, at)
        self._held = buf[len(body) - blank :]

    def _emit(self, text: str, out: list[Event], at: list[int]) -> None:
        if text:
            out.append(("content", text))
            at.append(self._piece)

    def _flush(self, out: list[Event], at: list[int]) -> None:
        held, self._held = self._held, ""
        if held and not (held.isspace() and self.tool_calls):
            out.append(("content", held))
            at.append(self._piece)
