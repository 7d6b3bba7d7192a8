"""Stop strings over streamed text, with hold-back.

Text arrives in pieces that do not respect stop-string boundaries: "...<EN" then "D>...". Whatever could still
be the start of a stop string is held back, not emitted, until the next piece proves it one way or the other:

    emitted | held (longest suffix that is a prefix of some stop string) | <- next piece appended here

On a hit, the text before the earliest match is emitted and the rest (the stop string and after) is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.hit: str | None = None  # the stop string that ended the text, once one has

    def feed(self, text: str) -> str:
        """The text now safe to emit. After a hit, always ""."""
        if self.hit is not None:
            return ""
        window = self._held + text
        found = [(pos, stop) for stop in self._stops if (pos := window.find(stop)) >= 0]
        if found:
            pos, self.hit = min(found)
            self._held = ""
            return window[:pos]
        keep = self._held_length(window)
        self._held = window[len(window) - keep :]
        return window[: len(window) - keep]

    def flush(self) -> str:
        """At the end of generation without a hit: the held text was not a stop string after all."""
        held, self._held = self._held, ""
        return held

    def _held_length(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(window)), best, -1):
                if window.endswith(stop[:n]):
                    best = n
                    break
        return best
