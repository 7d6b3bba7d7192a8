"""The streaming output parser: text pieces in, API-neutral events out.

    pieces --Machine--> (action, length) segments --assembly--> deltas --> events

Assembly maps segments back onto the pieces they came from. Within one piece, consecutive segments with the
same action merge into one delta; a delta is emitted when the action changes or its piece is fully parsed.
Pieces never merge, and the last delta of a piece whose tail is still stashed (a possible marker) waits:

    piece "ab<" -> [reasoning "ab"] + stash "<"  -> nothing yet
    piece "c"   -> "<c" was no marker            -> reasoning "ab<", reasoning "c"

A label (a JSON fragment the markup stands for) belongs to the piece where its marker starts. An empty text
chunk is a piece too: it gets the action of the segment that covers it (an empty delta: `"content": ""`), or,
when nothing is pending, the last action at once. This is exactly deepseek-recipe's event granularity, which
the oracle tests require at every chunk boundary.

Events are tuples, cheap on the hot path:
    ("reasoning", text) | ("content", text) | ("tool", index, name) | ("args", index, json_text)
    | ("stop", sequence)   (a stop sequence ended the answer; the parser is done)

A chat-template model offered tools (`hermes`) writes its calls as Hermes markup in plain text: parse/hermes.py
turns them into the same ("tool", ...) and ("args", ...) events.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Union

import orjson

from services.recipe.parse import stages as st
from services.recipe.parse.detok import Piece
from services.recipe.parse.hermes import HermesCalls
from services.recipe.parse.machine import Act, Machine
from services.recipe.prepared import ParsingSpec

Event = Union[tuple[str, str], tuple[str, int, str]]

_NEEDS_ESCAPE = re.compile(r'[\x00-\x1f"\\]')
_KEY_ESCAPE = re.compile(r"[\x00-\x1f\\]")
# Actions whose output is the input text itself (or derived from it, piece by piece); the others are labels,
# whose output is written once, in the piece where their marker starts.
_INPUT_KINDS = frozenset(
    {"raw", "to_space", "reasoning", "tool_name", "args_raw", "args_str", "args_key", "skip", "skip_invalid"}
)


def json_escape(text: str) -> str:
    """The inside of a JSON string literal (non-ASCII kept as is, like serde_json and orjson)."""
    if _NEEDS_ESCAPE.search(text) is None:
        return text
    return orjson.dumps(text)[1:-1].decode()


def key_escape(text: str) -> str:
    """A parameter name still carries its quotes from the markup: escape the rest only."""
    if _KEY_ESCAPE.search(text) is None:
        return text
    return _KEY_ESCAPE.sub(lambda m: json_escape(m.group()), text)


class OutputParser:
    def __init__(self, spec: ParsingSpec, *, plain: bool = False, token_mode: bool = False,
                 hermes: bool = False) -> None:
        """`plain`: a chat-template model (no reasoning, DSML or JSON markup): text and stop strings only.
        `token_mode`: the output arrives as token ids (pieces from detok.TokenPieces): added tokens come as
        (symbol, spelling) pieces and match the markers, text pieces never spell one (see stages.py).
        `hermes` (plain only): the text's Hermes tool calls become call events (parse/hermes.py)."""
        table = st.build(
            spec.parse_tool_calls and not plain,
            spec.parse_json_output and not plain,
            tuple(spec.stop_sequences),
            token_mode,
        )
        start = st.PLAIN if plain else st.initial_stage(spec.starts_in_tool_calls, spec.thinking_initial_stage)
        self._machine = Machine(table, start)
        # (matcher text, spelling): spelling is None for text, an added token's text for its symbol
        self._pieces: deque[tuple[str, str | None]] = deque()
        self._pos = 0  # characters of the front piece already covered by segments
        self._act: Act | None = None  # the front piece's open delta
        self._last: Act | None = None  # the action of the last segment
        self._parts: list[str] = []
        self._name: list[str] = []
        self._out: list[Event] = []
        self.tool_calls = 0
        self.reasoning: list[str] = []  # every reasoning delta, for the usage's reasoning token count
        self.stop_sequence: str | None = None
        self.stopped = False  # a stop sequence ended the answer: feed nothing more
        self.consumed = 0  # pieces of the last push parsed (all, unless a stop sequence ended it)
        # Every piece pushed gets the next index; `event_pieces[i]` is the piece the last push's (or finish's)
        # event i came from (one piece per delta: pieces never merge), for what rides on a piece (logprobs).
        self.seen = 0
        self.event_pieces: list[int] = []
        self._calls = HermesCalls() if plain and hermes else None

    def push(self, pieces: list[Piece]) -> list[Event]:
        """One push of output: text chunks (str) or pieces from detok.TokenPieces."""
        out = self._push(pieces)
        if self._calls is None:
            return out
        out, self.event_pieces = self._calls.feed(out, self.event_pieces)
        self.tool_calls = self._calls.tool_calls
        return out

    def finish(self) -> list[Event]:
        out = self._finish()
        if self._calls is None:
            return out
        out, self.event_pieces = self._calls.feed(out, self.event_pieces)
        more, pieces = self._calls.finish()
        self.event_pieces += pieces
        self.tool_calls = self._calls.tool_calls
        return out + more

    def _push(self, pieces: list[Piece]) -> list[Event]:
        self._out = out = []
        self.event_pieces = []
        self.consumed = 0
        if self.stopped:
            return out
        for piece in pieces:
            self.consumed += 1
            self.seen += 1
            if isinstance(piece, str):  # text: a text chunk, or ordinary tokens' text in token mode
                if not piece:
                    self._empty_piece()
                    continue
                text, spelling = piece, None
            else:
                text, spelling = piece
            self._pieces.append((text, spelling))
            self._apply(self._machine.feed(text))
            if self.stopped:
                break
        return out

    @property
    def front(self) -> int:
        """The index of the oldest piece not fully parsed (`seen` when none is held)."""
        return self.seen - len(self._pieces)

    def _finish(self) -> list[Event]:
        self._out = out = []
        self.event_pieces = []
        if not self.stopped:
            self._apply(self._machine.finish())
        self._pieces.clear()
        return out

    # --- assembly -------------------------------------------------------------------------------------------

    def _empty_piece(self) -> None:
        if self._pieces or self._last is None:
            self._pieces.append(("", None))  # covered (and emitted) by the next segment
        else:
            self._act, self._parts = self._last, [""] if self._last.kind in _INPUT_KINDS else []
            self._flush()
            self._act = None

    def _apply(self, segments: list[tuple[Act, int]]) -> None:
        pieces = self._pieces
        for act, n in segments:
            self._last = act
            first = True
            while n or (pieces and not pieces[0][0]):
                text, spelling = pieces[0]
                pos = self._pos
                take = min(n, len(text) - pos)
                if act is not self._act:
                    self._flush()
                    self._act = act
                if act.kind in _INPUT_KINDS:
                    if spelling is None:
                        self._parts.append(text[pos : pos + take])
                    else:  # an added token: one symbol, always covered whole
                        self._parts.append(spelling)
                elif first:
                    self._parts.append(act.text)
                first = False
                n -= take
                pos += take
                if pos == len(text):
                    self._flush()
                    self._act = None
                    pieces.popleft()
                    pos = 0
                self._pos = pos

    def _flush(self) -> None:
        act, parts = self._act, self._parts
        if act is None or not parts:
            return
        self._parts = []
        kind = act.kind
        out = self._out
        n = len(out)
        self._flush_kind(kind, act, parts, out)
        if len(out) > n:  # the delta's piece: the front one, or the empty piece flushed at once (_empty_piece)
            self.event_pieces.append(self.seen - len(self._pieces) if self._pieces else self.seen - 1)

    def _flush_kind(self, kind: str, act: Act, parts: list[str], out: list[Event]) -> None:
        if kind == "raw":
            out.append(("content", "".join(parts)))
        elif kind == "reasoning":
            text = "".join(parts)
            self.reasoning.append(text)
            out.append(("reasoning", text))
        elif kind == "args_str":
            out.append(("args", self.tool_calls - 1, json_escape("".join(parts))))
        elif kind == "args_label":
            out.append(("args", self.tool_calls - 1, act.text))
        elif kind == "args_raw":
            out.append(("args", self.tool_calls - 1, "".join(parts)))
        elif kind == "args_key":
            out.append(("args", self.tool_calls - 1, key_escape("".join(parts))))
        elif kind == "to_space":
            out.append(("content", " "))
        elif kind == "label":
            out.append(("content", act.text))
        elif kind == "tool_name":
            self._name += parts
        elif kind == "tool_begin":
            self._name = []
        elif kind == "tool_name_end":
            out.append(("tool", self.tool_calls, "".join(self._name)))
            self.tool_calls += 1
        elif kind == "stop":
            self.stop_sequence = act.text
            self.stopped = True
            out.append(("stop", act.text))
