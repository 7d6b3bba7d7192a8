"""The incremental marker matcher under every output parser: text in, (action, length) segments out.

The parser is a set of stages (reasoning, answer text, tool-call markup, ...). Each stage has an ordered list
of branches, each a pattern with its own KMP automaton, fed one character at a time; the first branch to
complete a match wins and switches the stage. Text that no branch claims gets the stage's "unmatched" action.
Characters that may still become a match are stashed until the next `feed` settles them:

    ... unmatched text (flushed as one segment) | stash: longest partial match of any branch | <- next feed

A segment is (action, n): the next n characters of the input get that action. Segments say nothing about
where the input's pieces (pushes, tokens) begin and end; stream.py maps them back onto the pieces.

Branch kinds:
- STR: a literal. NL_STR: newlines directly followed by a literal; the newlines are part of the match, so
  "text\\n\\n</think>" drops the trailing newlines of the reasoning (they stay stashed until the literal
  completes or fails). LEADING: one newline as the first character of the stage (the stage restarts, so a
  run of leading newlines is dropped one by one). QUOTE_SPACE: a space right after a closing quote (ends a
  DSML parameter name; a space inside the name is kept).

Matching is on characters, not UTF-8 bytes: every pattern starts with a whole character, so a byte-level
KMP match and a character-level one find the same occurrences and the same partial lengths.
Hot path: while every automaton is at rest, `re.search` jumps to the next character that could start a
match (a stage's trigger characters), so plain text costs one regex scan, not a Python step per character.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

STR, NL_STR, LEADING, QUOTE_SPACE = range(4)


class Act:
    """An output action. Instances are singletons compared by identity: two segments merge into one delta
    only when they carry the very same action (two labels never merge, each is its own instance)."""

    __slots__ = ("kind", "text")

    def __init__(self, kind: str, text: str = "") -> None:
        self.kind = kind
        self.text = text  # a label's output, a stop sequence

    def __repr__(self) -> str:
        return f"Act({self.kind}, {self.text!r})"


@dataclass(frozen=True)
class Branch:
    kind: int
    pattern: str
    next_stage: object  # a stage key of the Machine's table
    action: Act
    table: tuple[int, ...] = ()  # KMP failure table of `pattern`


def branch(kind: int, pattern: str, next_stage: object, action: Act) -> Branch:
    return Branch(kind, pattern, next_stage, action, _kmp_table(pattern))


@dataclass(frozen=True)
class Stage:
    branches: tuple[Branch, ...]
    unmatched: Act
    trigger: re.Pattern[str] | None  # None = step every character (a stage whose branches need context)


def stage(branches: Sequence[Branch], unmatched: Act) -> Stage:
    firsts: set[str] = set()
    for b in branches:
        if b.kind == QUOTE_SPACE:
            return Stage(tuple(branches), unmatched, None)
        if b.kind == LEADING:
            continue  # only the stage's first character, which `_resting` never skips
        firsts.add(b.pattern[0])
        if b.kind == NL_STR:
            firsts.add("\n")
    # no first characters (no branches, or only LEADING): a pattern that never matches jumps to the end
    trigger = re.compile("[" + "".join(re.escape(c) for c in sorted(firsts)) + "]" if firsts else r"(?!)")
    return Stage(tuple(branches), unmatched, trigger)


def _kmp_table(pattern: str) -> tuple[int, ...]:
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return tuple(table)


class Machine:
    """One request's matcher: feeds text through the current stage's branches. `stages` maps every stage
    key a branch can lead to onto its Stage (stages.build makes the table for a set of parsing options)."""

    def __init__(self, stages: dict[object, Stage], start: object) -> None:
        self._stages = stages
        self.stage_key = start
        self._enter(start)

    def _enter(self, key: object) -> None:
        self.stage_key = key
        st = self._stages[key]
        self._stage = st
        self._branches = st.branches
        n = len(st.branches)
        self._len = [0] * n  # STR/NL_STR: characters of the pattern matched so far
        self._nl = [0] * n  # NL_STR: newlines counted before the pattern
        # LEADING: 1 = first character still to come, 2 = matched; QUOTE_SPACE: 1 = previous char was '"'
        self._flag = [1 if b.kind == LEADING else 0 for b in st.branches]
        self._stash = 0
        self._at_start = True  # QUOTE_SPACE: the first '"' of a name is its opening quote

    def feed(self, text: str) -> list[tuple[Act, int]]:
        trigger = self._stage.trigger
        if trigger is not None and self._resting() and trigger.search(text) is None:
            # the common case (a token of plain text): nothing can start here, all of it is settled
            n = self._stash + len(text)
            self._stash = 0
            return [(self._stage.unmatched, n)] if n else []
        out: list[tuple[Act, int]] = []
        i, n = 0, len(text)
        while i < n:
            trigger = self._stage.trigger
            if trigger is not None and self._resting():
                m = trigger.search(text, i)
                j = m.start() if m else n
                self._stash += j - i
                i = j
                if i >= n:
                    break
            c = text[i]
            i += 1
            self._stash += 1
            hit = self._step(c)
            if hit is not None:
                matched = 1 if self._branches[hit].kind == QUOTE_SPACE else self._matching_len(hit)
                if matched < self._stash:
                    out.append((self._stage.unmatched, self._stash - matched))
                out.append((self._branches[hit].action, matched))
                self._enter(self._branches[hit].next_stage)
        partial = 0 if self._resting() else max(self._matching_len(k) for k in range(len(self._branches)))
        if partial < self._stash:
            out.append((self._stage.unmatched, self._stash - partial))
            self._stash = partial
        return out

    def finish(self) -> list[tuple[Act, int]]:
        """End of input: whatever is stashed was not a marker after all."""
        out = [(self._stage.unmatched, self._stash)] if self._stash else []
        self._stash = 0
        return out

    # --- automata --------------------------------------------------------------------------------------------

    def _resting(self) -> bool:
        """No automaton is inside a match and no LEADING branch awaits its first character."""
        return not (any(self._len) or any(self._nl) or 1 in self._flag)

    def _matching_len(self, k: int) -> int:
        kind = self._branches[k].kind
        if kind == LEADING:
            return 1 if self._flag[k] == 2 else 0
        if kind == QUOTE_SPACE:
            return 0
        return self._len[k] + self._nl[k]

    def _step(self, c: str) -> int | None:
        """Feed one character to every branch in order; the index of the first that completes, if any."""
        lens, nls, flags = self._len, self._nl, self._flag
        for k, b in enumerate(self._branches):
            kind = b.kind
            if kind == STR:
                ln = _kmp_next(b, lens[k], c)
                lens[k] = ln
                if ln == len(b.pattern):
                    return k
            elif kind == NL_STR:
                ln = lens[k]
                if ln == 0 and c == "\n":
                    nls[k] += 1
                else:
                    nxt = _kmp_next(b, ln, c)
                    if nxt <= ln:
                        nls[k] = 0
                    lens[k] = nxt
                    if nxt == len(b.pattern):
                        return k
            elif kind == LEADING:
                if flags[k] == 1:
                    flags[k] = 2 if c == "\n" else 0
                    if flags[k] == 2:
                        return k
            else:  # QUOTE_SPACE
                if c == " " and flags[k]:
                    return k
                flags[k] = 1 if c == '"' and not self._at_start else 0
        self._at_start = False
        return None


def _kmp_next(b: Branch, ln: int, c: str) -> int:
    pattern, table = b.pattern, b.table
    while ln and pattern[ln] != c:
        ln = table[ln - 1]
    return ln + 1 if pattern[ln] == c else ln
