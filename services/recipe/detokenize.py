"""Incremental detokenization: token ids in, text out, never half a character.

Byte-level BPE splits multi-byte UTF-8 characters across tokens (an emoji is often 2-3 tokens). Each token's
raw bytes go through an incremental UTF-8 decoder, which emits every complete character and holds back an
unfinished trailing sequence (at most 3 bytes) until the next token completes it. Invalid bytes become U+FFFD,
as `tokenizers` decode does, so the concatenation of everything emitted equals a full decode.
"""

from __future__ import annotations

import codecs

from shared.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still partial, or for a skipped token)."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (a truncated character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
