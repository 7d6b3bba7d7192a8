"""A prompt as text plus the spans that are control tokens: what makes encoding injection-safe.

The renderer appends client text with `text` (never scanned for token spellings) and the template's own control
tokens with `special`; `markup` is for the template's fixed prose, whose token spellings are known and marked.
Encoding then maps exactly the marked spans to control-token ids and encodes everything between them as plain
text, so a user who types `<｜User｜>` gets the ordinary tokens of those characters:

    prompt          <｜begin▁of▁sentence｜>hi <｜User｜><｜Assistant｜></think>
    special_ranges  [0, 21)                              [..)           [..)
                                           ^^^^^^^^ client text: plain
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from services.recipe.images.sources import ImageSource


@dataclass(frozen=True)
class RenderedPrompt:
    prompt: str
    special_ranges: tuple[tuple[int, int], ...]  # ascending, disjoint [start, end) str offsets, one token each
    images: tuple[ImageSource, ...] = ()  # V4.1: the images of the image placeholders, in prompt order

    def pieces(self) -> Iterable[tuple[str, bool]]:
        """(text, is_control_token) in order; the plain stretches are maximal (as encoding needs them)."""
        pos = 0
        for start, end in self.special_ranges:
            if pos < start:
                yield self.prompt[pos:start], False
            yield self.prompt[start:end], True
            pos = end
        if pos < len(self.prompt):
            yield self.prompt[pos:], False


class PromptBuilder:
    def __init__(self, specials: Iterable[str]) -> None:
        # Longest first, so a spelling that contains another is matched whole.
        ordered = sorted(set(specials), key=len, reverse=True)
        self._markup = re.compile("|".join(re.escape(s) for s in ordered))
        self._parts: list[str] = []
        self._ranges: list[tuple[int, int]] = []
        self._images: list[ImageSource] = []
        self._len = 0

    def text(self, value: str) -> None:
        """Client (or other untrusted) text: always plain."""
        self._parts.append(value)
        self._len += len(value)

    def special(self, token: str) -> None:
        self._ranges.append((self._len, self._len + len(token)))
        self.text(token)

    def image(self, placeholder: str, source: ImageSource) -> None:
        """An image's placeholder: a control token that stands for the image's tokens."""
        self.special(placeholder)
        self._images.append(source)

    def markup(self, template: str) -> None:
        """The template's own text: its control-token spellings are control tokens."""
        pos = 0
        for m in self._markup.finditer(template):
            self.text(template[pos : m.start()])
            self.special(m.group())
            pos = m.end()
        self.text(template[pos:])

    def build(self) -> RenderedPrompt:
        return RenderedPrompt("".join(self._parts), tuple(self._ranges), tuple(self._images))
