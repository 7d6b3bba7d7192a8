"""Per-token log probabilities, from the engine's ids to the entries the emitters write.

    Tokens(ids, logprobs) --feed--> pending entries --pieces--> entries per parser piece --> text events

The engine reports, per generated id, its logprob and its top ids' (shared/schemas/generate.py TokenLogprob).
An entry spells each id as the client sees it: `token` (its text, or `\\xNN` per byte when its bytes are not
whole UTF-8, as deepseek-recipe and OpenAI write a token that cuts a character), `bytes` (exact) and the
logprob as the f32 it is, written in f32's shortest digits as deepseek-recipe writes them (`numbers`; a
non-finite one is null).

Which event carries an entry: the parser cuts the ids into pieces (parse/detok.py: each run of ordinary ids of
one push, each added token alone) and every text event comes from one piece. A piece's entries ride on its
text deltas (content or reasoning); a piece that yields no text (markup, tool-call arguments, text after a stop
sequence, held newlines that are later dropped) reports none, and an id past a stop sequence inside a piece
that does yield text is reported with it. For DeepSeek formats a piece's entries ride on every text delta the
piece yields (deepseek-recipe repeats them; JSON mode can cut one piece into three deltas); for chat-template
models and Completions they go out once, on the piece's first text delta.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import orjson

from services.recipe.parse.detok import TokenPieces, TokenTable
from shared.schemas.generate import TokenLogprob


class Alt(NamedTuple):
    token: str
    logprob: orjson.Fragment  # the JSON number (`numbers`)
    bytes: bytes


class Entry(NamedTuple):
    token: str
    logprob: orjson.Fragment
    bytes: bytes
    top: tuple[Alt, ...]


def numbers(values: Sequence[float]) -> list[orjson.Fragment]:
    """Logprobs as deepseek-recipe writes them: each an f32 in its shortest digits, fixed-point when the decimal
    point falls within 13 digits left or 5 zeros right of them (-0.000001, -1500000000000.0), else -1.1920929e-7
    / -1e+13; a non-finite one is null. orjson writes numpy's f32 exactly so, in one call for a whole chunk (a
    Python search for the shortest digits costs ~4 us a value; top_logprobs=20 is 21 values a token)."""
    if not values:
        return []
    text = orjson.dumps(np.asarray(values, dtype=np.float32), option=orjson.OPT_SERIALIZE_NUMPY)
    return [orjson.Fragment(t) for t in text[1:-1].split(b",")]


def spell(raw: bytes) -> str:
    """A token's text: its bytes as UTF-8, or `\\xNN` for every byte when they are not whole characters."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"\\x{b:02x}" for b in raw)


class Speller:
    """id -> (token, bytes), cached: the top ids repeat across positions. `as_ids` (vLLM's
    return_tokens_as_token_ids): the token is spelled `token_id:N`, so a client gets the ids back exactly; the
    bytes stay the token's own (text offsets are counted from them)."""

    def __init__(self, table: TokenTable, as_ids: bool = False) -> None:
        self._table = table
        self._as_ids = as_ids
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, tid: int) -> tuple[str, bytes]:
        hit = self._cache.get(tid)
        if hit is None:
            added = self._table.added.get(tid)
            if added is not None:
                raw = added[1].encode()
            elif 0 <= tid < len(self._table.token_bytes):
                raw = bytes(self._table.token_bytes[tid])
            else:  # an id past the vocabulary (padded logits) stands for nothing
                raw = b""
            hit = self._cache[tid] = (f"token_id:{tid}" if self._as_ids else spell(raw), raw)
        return hit


class _Dropped(NamedTuple):
    """The entry of an id that makes no piece (as ids only): it goes with the next piece's entries."""

    entry: Entry


class LogprobTrack:
    """One request's entries, from the ids fed to the pieces the parser reports text for."""

    def __init__(self, table: TokenTable, pieces: TokenPieces, *, once: bool, as_ids: bool = False) -> None:
        """`pieces`: the request's detokenizer (which ids make no piece); `once`: a piece's entries go out on
        its first text delta only (see the module docstring); `as_ids`: Speller's."""
        self._spell = Speller(table, as_ids)
        # as_ids: the entries of a piece that yields no text ride on the next text delta, so every id a client
        # can see is reported (ids after the answer's last text are not: no delta carries them)
        self._carry: list[Entry] | None = [] if as_ids else None
        self._reported: set[int] = set()
        self._pieces = pieces
        self._once = once
        # entries of ids fed and not yet in a piece (a held character); None for an id that came without one
        self._pending: deque[Entry | _Dropped | None] = deque()
        self._by_piece: dict[int, list[Entry]] = {}  # parser piece index -> its entries

    def feed(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None) -> None:
        """The ids about to go to the detokenizer, with theirs (one each; None: these ids have none, which keeps
        the ids after them aligned)."""
        drops = self._pieces.drops
        if logprobs is None or len(logprobs) != len(token_ids):
            self._pending.extend(None for tid in token_ids if not drops(tid))
            return
        # as ids, an id that makes no piece is reported too: with the piece that follows it
        kept = [(tid, lp) for tid, lp in zip(token_ids, logprobs) if self._carry is not None or not drops(tid)]
        nums = iter(numbers([v for _, lp in kept for v in (lp.logprob, *lp.top_logprobs)]))
        spell_id = self._spell
        for tid, lp in kept:
            token, raw = spell_id(tid)
            value = next(nums)
            top = tuple(Alt(alt, next(nums), alt_raw)
                        for alt, alt_raw in map(spell_id, lp.top_ids[: len(lp.top_logprobs)]))
            entry = Entry(token, value, raw, top)
            self._pending.append(_Dropped(entry) if drops(tid) else entry)

    def pieces(self, first: int, counts: Sequence[int]) -> None:
        """The detokenizer made pieces `first`, `first + 1`, ... of `counts[i]` ids each."""
        pending = self._pending
        for i, n in enumerate(counts):
            taken: list[Entry] = []
            while n:  # an id that made no piece (as ids) before or among them goes with them
                e = pending.popleft()
                if isinstance(e, _Dropped):
                    taken.append(e.entry)
                    continue
                n -= 1
                if e is not None:
                    taken.append(e)
            self._by_piece[first + i] = taken

    def entries(self, piece: int) -> list[Entry]:
        """The entries a text delta of `piece` carries."""
        got = self._by_piece.pop(piece, []) if self._once else self._by_piece.get(piece, [])
        if self._carry is not None:
            self._reported.add(piece)
            if self._carry:
                got, self._carry = self._carry + got, []
        return got

    def release(self, before: int) -> None:
        """Pieces before `before` are parsed: their deltas are out."""
        for piece in [p for p in self._by_piece if p < before]:
            left = self._by_piece.pop(piece)
            if self._carry is not None and piece not in self._reported:
                self._carry += left
        self._reported = {p for p in self._reported if p >= before}


# --- the APIs' shapes -----------------------------------------------------------------------------------------


def openai_json(entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """Chat Completions' `logprobs.content` and Responses' `logprobs`: OpenAI's per-token objects."""
    return [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
             "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in e.top]}
            for e in entries]


class CompletionsLogprobs:
    """Legacy Completions' `logprobs` object: parallel lists, `text_offset` in characters of the completion
    text (the start of the character a token's first byte belongs to, for a token that begins mid-character)."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[orjson.Fragment] = []
        self.top_logprobs: list[dict[str, orjson.Fragment]] = []
        self.text_offset: list[int] = []

    def add(self, entries: Sequence[Entry], offset: int) -> dict[str, Any]:
        """The entries of a delta that starts at character `offset`; returns the delta's own object."""
        part = CompletionsLogprobs()
        run = b""
        for e in entries:
            part.tokens.append(e.token)
            part.token_logprobs.append(e.logprob)
            part.top_logprobs.append({a.token: a.logprob for a in e.top})
            part.text_offset.append(offset + len(run.decode("utf-8", "ignore")))
            run += e.bytes
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self, name).extend(getattr(part, name))
        return part.json()

    def json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
