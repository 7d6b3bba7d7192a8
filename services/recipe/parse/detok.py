"""Token ids -> text pieces for the stream parser, UTF-8 safe, the way deepseek-recipe cuts them.

A push of token ids becomes a list of pieces: each run of ordinary tokens is one piece (its bytes decoded
together), and each added-vocabulary token (`</think>`, `<｜User｜>`, `｜DSML｜`, ...) is a piece of its own,
its text as is. Pieces matter: the parser never merges two pieces into one delta, so the events a client sees
depend on them.

Byte-level BPE splits characters across tokens (an emoji is often two). The bytes of ordinary tokens collect
until their decoding no longer ends in U+FFFD, i.e. the run ends on a whole character:

    [a, <F0 9F>] -> held (decodes to "a\\ufffd") | [<98 80>, b] -> one piece "a😀b"

An added token comes as the pair (symbol, spelling): the symbol is what the matcher sees (stages.py, token
mode), the spelling what a client gets. It flushes what is held, broken or not (as deepseek-recipe does). At
the end, held bytes are flushed with U+FFFD for the broken tail; deepseek-recipe 0.2.0 drops them, and with
them every whole character held alongside (a deliberate deviation: we never lose text the model wrote).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.recipe.parse.stages import OPAQUE_SYM, SYMBOLS
from shared.tokenizer import Tokenizer

Piece = str | tuple[str, str]  # ordinary text, or an added token's (symbol, spelling)


@dataclass(frozen=True, eq=False)
class TokenTable:
    """What detokenizing needs of a tokenizer; build it once per model (it walks the whole vocabulary)."""

    token_bytes: Sequence[bytes]  # id -> the bytes an ordinary token stands for
    added: Mapping[int, tuple[str, str]]  # added-vocabulary id -> (matcher symbol, spelling)
    eos_ids: frozenset[int]  # ids that end the turn (end-of-sentence): never text
    special_ids: frozenset[int] = frozenset()  # control tokens: not text for chat-template models

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> TokenTable:
        decoder = tokenizer.tk.get_added_tokens_decoder()
        added = {i: (SYMBOLS.get(t.content, OPAQUE_SYM), t.content) for i, t in decoder.items()}
        table = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        return cls(tuple(table), added, tokenizer.eos_ids, tokenizer.special_ids)


class TokenPieces:
    def __init__(self, table: TokenTable, *, skip_special: bool = False) -> None:
        """`skip_special`: control tokens stand for no text (chat-template models, as HF and vLLM decode by
        default); DeepSeek's parser sees every added token, as deepseek-recipe does."""
        self._bytes = table.token_bytes
        self._added = table.added
        if skip_special:  # an empty spelling: the piece is dropped below
            self._added = {i: ("", "") if i in table.special_ids else a for i, a in table.added.items()}
        self._n = len(table.token_bytes)
        self._held = bytearray()
        self._held_ids = 0
        self.counts: list[int] = []  # token ids behind each piece of the last feed / flush

    def drops(self, tid: int) -> bool:
        """Whether id `tid` stands for no piece at all (a control token of a chat-template model)."""
        added = self._added.get(tid)
        return added is not None and not added[1]

    def feed(self, token_ids: Sequence[int]) -> list[Piece]:
        """The pieces these ids complete; `counts[i]` is how many ids piece i stands for (the usage counts
        the ids of the pieces parsed, as deepseek-recipe does: held ids count once their piece is out)."""
        pieces: list[Piece] = []
        counts: list[int] = []
        held, added, table, n = self._held, self._added, self._bytes, self._n
        run = self._held_ids  # ids behind the held bytes
        for tid in token_ids:
            special = added.get(tid)
            if special is None:
                if 0 <= tid < n:  # ids past the vocabulary (padded logits) stand for nothing
                    held += table[tid]
                run += 1
                continue
            if run:
                pieces.append(held.decode("utf-8", "replace"))
                counts.append(run)
                held.clear()
                run = 0
            if special[1]:
                pieces.append(special)
                counts.append(1)
        if run:
            text = held.decode("utf-8", "replace")
            if not text.endswith("\ufffd"):
                pieces.append(text)
                counts.append(run)
                held.clear()
                run = 0
        self._held_ids = run
        self.counts = counts
        return pieces

    def flush(self) -> list[Piece]:
        if not self._held_ids:
            self.counts = []
            return []
        text = self._held.decode("utf-8", "replace")
        self.counts = [self._held_ids]
        self._held.clear()
        self._held_ids = 0
        return [text]
