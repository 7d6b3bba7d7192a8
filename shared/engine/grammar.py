"""Grammar-constrained decoding with xgrammar: the output of a constrained request matches its JSON schema,
regex or EBNF grammar, token by token, by masking every token that would leave the grammar before sampling.

    logits (N, V) -> processors (bias, penalties) -> grammar mask (here) -> sampler

One GrammarMatcher per constrained request follows its output: it is built at add() from the output so far (a
decode worker replays prefill's token, a continuation its whole output), so the state travels as the tokens do and
nothing else crosses the bus. Each step, the rows of constrained requests get a bitmask filled on the host (one
bit per token id, (N, ceil(V / 32)) int32, xgrammar's batch fill on its own threads) while the device still runs
the step's forward, copied over and applied to the logits in place, for the whole batch at once.

    row of a plain decode     mask from the matcher's state
    row r of a verify chunk   mask after the chunk's drafts[:r], accepted tentatively and rolled back at once
    before `after_token`      no mask (the reasoning of a thinking model is free); the marker opens the grammar

The matcher advances in accept(), from the tokens a step reported (the engine resolves them on the host).
Termination: the grammar allows the request's stop ids only once it is complete, and only them then, so a
constrained answer always ends with "stop" (or "length" when max_tokens comes first).
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from shared.engine.api import RequestError
from shared.schemas.generate import Constraint

if TYPE_CHECKING:
    import xgrammar as xgr

COMPILED_CACHE = 256  # compiled grammars kept (by kind and spec): a schema most requests share compiles once


_FREE, _MARKER, _MATCHED = 0, 1, 2  # how a taken token was taken (_State.taken)


@dataclass
class _State:
    matcher: xgr.GrammarMatcher
    after: int  # the marker that opens the grammar; -1 = open from the start
    open: bool
    taken: list[int] = field(default_factory=list)  # per token taken: _FREE, _MARKER or _MATCHED (for rollback)

    def advance(self, token: int) -> bool:
        """Take one token; False if the grammar refuses it (the state is then unchanged)."""
        if not self.open:
            self.open = token == self.after
            self.taken.append(_MARKER if self.open else _FREE)
            return True
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self.taken.append(_MATCHED)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n tokens taken."""
        if n == 0:
            return
        undone = self.taken[-n:]
        del self.taken[-n:]
        if _MARKER in undone:
            self.open = False
        matched = undone.count(_MATCHED)
        if matched:
            self.matcher.rollback(matched)


@cache
def _xgr():  # noqa: ANN202 - the module
    """xgrammar, imported at the first constrained request: it takes ~1.5 s and pulls in transformers."""
    return importlib.import_module("xgrammar")


class Grammars:
    """The constrained requests of one engine: compile, follow, mask. Single-threaded, as the engine is."""

    def __init__(self, vocab_size: int, vocabulary: Callable[[], Sequence[bytes]], device: torch.device,
                 max_rows: int = 64, threads: int = min(4, os.cpu_count() or 1)) -> None:
        """vocab_size: the logits' width (the model's vocabulary, maybe padded past the tokenizer's);
        vocabulary(): each token id's bytes, b"" for a special token (never allowed, but as a stop id), called
        once, at the first constrained request."""
        self.vocab_size = vocab_size
        self.device = device
        self._vocabulary = vocabulary
        self._threads = threads
        self._max_rows = max_rows
        self._compiler: xgr.GrammarCompiler | None = None  # these three are made at the first constrained request
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._mask = torch.empty(0, 0, dtype=torch.int32)  # (rows, ceil(V / 32)) host bitmask
        self._compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self.states: dict[str, _State] = {}

    # --- requests ---------------------------------------------------------------------------------------------

    def add(self, request_id: str, constraint: Constraint, stop_ids: Iterable[int], output: list[int]) -> None:
        """Follow a request from its output so far (replayed into a fresh matcher). RequestError for a constraint
        xgrammar cannot compile, or an output it does not match (a continuation that was never constrained)."""
        grammar = self.compile(constraint)
        stops = sorted(stop_ids)
        if not stops:
            raise RequestError("a constrained output needs a stop token to end (every stop id was switched off)")
        matcher = _xgr().GrammarMatcher(grammar, override_stop_tokens=stops)
        state = _State(matcher, constraint.after_token, constraint.after_token < 0)
        for at, token in enumerate(output):
            if not state.advance(token):
                raise RequestError(f"output token {at} ({token}) does not match the request's {constraint.kind}")
        self.states[request_id] = state

    def accept(self, request_id: str, tokens: list[int]) -> None:
        """A step's reported tokens of a request. A token the grammar refuses is a bug here (the mask allowed
        only what it accepts), so it is asserted, not answered."""
        state = self.states.get(request_id)
        if state is not None:
            for token in tokens:
                ok = state.advance(token)
                assert ok, f"{request_id}: sampled token {token} outside its grammar"

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    # --- the mask ---------------------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, rows: list[tuple[str, tuple[int, ...]]]) -> torch.Tensor:
        """logits (N, V) float32, rows[i] = (request id, the drafts row i comes after) -> logits with every row of
        a constrained request masked (in place: the caller passes a tensor it owns). Other rows are untouched."""
        plain = [(i, s) for i, (rid, drafts) in enumerate(rows) if (s := self.states.get(rid)) and s.open
                 and not drafts]
        drafted = [(i, s, d) for i, (rid, d) in enumerate(rows) if d and (s := self.states.get(rid))]
        if not plain and not drafted:
            return logits
        if len(rows) > self._mask.shape[0]:
            self._mask = self._host_mask(max(len(rows), self._max_rows))
        mask = self._mask[: len(rows)]
        masked = [i for i, _ in plain]
        if plain:
            assert self._batch is not None  # made with the compiler, before any state
            self._batch.batch_fill_next_token_bitmask([s.matcher for _, s in plain], mask, masked)
        for i, state, drafts in drafted:
            if self._fill_after(state, drafts, mask, i):
                masked.append(i)
        if masked:
            # the host buffer is reused next step: a constrained step is synchronous (engine.step), so this copy
            # has run by then
            _xgr().apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), indices=masked)
        return logits

    def _fill_after(self, state: _State, drafts: tuple[int, ...], mask: torch.Tensor, row: int) -> bool:
        """Row `row` of a verify chunk: the mask after its drafts, taken tentatively and rolled back. False when
        no mask applies (the grammar is not open there, or a draft leaves it: that row is thrown away anyway)."""
        taken = 0
        for d in drafts:
            if not state.advance(d):
                break
            taken += 1
        usable = taken == len(drafts) and state.open and not state.matcher.is_terminated()
        if usable:
            state.matcher.fill_next_token_bitmask(mask, row)
        state.rollback(taken)
        return usable

    # --- compiling --------------------------------------------------------------------------------------------

    def compile(self, c: Constraint) -> xgr.CompiledGrammar:
        key = (c.kind, c.spec)
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            return hit
        compiler = self._compiler or self._make_compiler()
        try:
            if c.kind == "json_schema":
                # compact JSON (no free whitespace): a small model otherwise pads with newlines until max_tokens
                grammar = compiler.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
            elif c.kind == "json_object":  # OpenAI's JSON mode: any JSON object, compact as above
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif c.kind == "regex":
                grammar = compiler.compile_regex(c.spec)
            elif c.kind == "structural_tag":
                grammar = compiler.compile_structural_tag(c.spec)
            else:
                grammar = compiler.compile_grammar(c.spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors
            tool = _failing_tool(compiler, c) if c.kind == "structural_tag" else None
            where = f"tool {tool!r} has a parameter schema the grammar engine cannot use" if tool else \
                f"invalid {c.kind} constraint"
            raise RequestError(f"{where}: {_first_line(exc)}") from None
        self._compiled[key] = grammar
        if len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return grammar

    def _make_compiler(self) -> xgr.GrammarCompiler:
        xgr = _xgr()
        vocab = list(self._vocabulary())[: self.vocab_size]
        vocab += [b""] * (self.vocab_size - len(vocab))  # ids the model has past its tokenizer: never allowed
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads)
        self._batch = xgr.BatchGrammarMatcher(max_threads=self._threads)
        return self._compiler

    def _host_mask(self, rows: int) -> torch.Tensor:
        mask = _xgr().allocate_token_bitmask(rows, self.vocab_size)  # (rows, ceil(V / 32)) int32, all allowed
        return mask.pin_memory() if self.device.type == "cuda" else mask


_NATIVE_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")  # xgrammar's C++ log: "[21:29:03] /x/y.cc:94: "


def _first_line(exc: Exception) -> str:
    """The error's first line, without the native library's timestamp and source location (a client reads it)."""
    text = str(exc).strip().splitlines()
    return _NATIVE_PREFIX.sub("", text[0]) if text else type(exc).__name__


def _failing_tool(compiler: xgr.GrammarCompiler, c: Constraint) -> str | None:
    """The first part of a structural tag labelled {"tool": name} that does not compile alone (None: no such)."""
    try:
        spec = json.loads(c.spec)
    except json.JSONDecodeError:
        return None
    for part in _labelled(spec):
        try:
            compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": part}))
        except (RuntimeError, ValueError, TypeError):
            return str(part["tool"])
    return None


def _labelled(node: object) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "tool" in node:
            yield node
        else:
            for value in node.values():
                yield from _labelled(value)
    elif isinstance(node, list):
        for value in node:
            yield from _labelled(value)


# An added token the output parser reads by id (DeepSeek's ｜DSML｜, </think>) is markup, not text: under a grammar
# it may come only where the constraint names it by id ({"type": "token"} in a structural tag). Its bytes here start
# with 0xFF, never valid UTF-8, so no literal or character class of a grammar matches it, and no run of ordinary
# tokens can spell it (which the parser would read as text).
MARKUP_PREFIX = b"\xff\xfe"


def vocabulary(token_bytes: Callable[[int], bytes], is_special: Callable[[int], bool], size: int,
               markup: Collection[int] = ()) -> list[bytes]:
    """Each token id's bytes for xgrammar (a RAW vocabulary); special tokens as b"": their text is no output;
    `markup` ids (added tokens that are not special) as MARKUP_PREFIX + the id."""
    return [b"" if is_special(i) else MARKUP_PREFIX + str(i).encode() if i in markup else token_bytes(i)
            for i in range(size)]
