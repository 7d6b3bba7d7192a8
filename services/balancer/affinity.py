"""Session affinity for decode: which worker served the turn a new prompt continues.

A follow-up turn's prompt starts with the previous turn's whole prompt (then its answer and the new message), so
the previous prompt is recognised by content, with no session id on the wire:

    anchor   = the chained hash of the previous prompt's last full block (the DecodeJob carries the hashes)
    entry    = (its length L, a digest of its last min(L, TAIL_CHECK) tokens, worker, when)

A new prompt looks for its own block hashes among the anchors, longest first; under an anchor, an entry matches
when the new prompt has the same digest at the same length. The anchor proves the blocks match, the digest the
partial block after them (exact for blocks up to TAIL_CHECK tokens), so prompts that merely share a system
prompt do not all pile onto one worker. An entry lives `ttl_s` from when its turn finished (workers.done), or
from when it was placed if no done report comes. Pure bookkeeping; `now` is passed in.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

OPEN_TTL_S = 3600.0  # a turn still running is remembered this long for its done report (the decode role's TTL)
TAIL_CHECK = 512  # tokens digested at the end of a turn's prompt: more than any engine's block
PER_ANCHOR = 16  # entries kept under one anchor (prompts that end in the same block), newest last


def tail_digest(prompt: Sequence[int], length: int) -> bytes:
    tail = prompt[max(length - TAIL_CHECK, 0) : length]
    return hashlib.blake2b(struct.pack(f"<q{len(tail)}q", length, *tail), digest_size=16).digest()


@dataclass
class _Entry:
    length: int
    digest: bytes
    worker: str
    at: float


class SessionAffinity:
    def __init__(self, ttl_s: float = 300.0, max_anchors: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self._max_anchors = max_anchors
        self._anchors: OrderedDict[bytes, list[_Entry]] = OrderedDict()  # least recently touched first
        self._open: dict[str, tuple[bytes, _Entry]] = {}  # request id -> its entry, until done

    def remember(
        self, request_id: str, prompt: Sequence[int], hashes: Sequence[bytes], worker: str, now: float
    ) -> None:
        """`worker` took the turn `prompt` (whose full blocks hash to `hashes`)."""
        if not hashes:
            return  # shorter than a block: nothing worth coming back for
        anchor = hashes[-1]
        entry = _Entry(len(prompt), tail_digest(prompt, len(prompt)), worker, now)
        entries = [e for e in self._anchors.pop(anchor, []) if (e.length, e.digest) != (entry.length, entry.digest)]
        self._anchors[anchor] = (entries + [entry])[-PER_ANCHOR:]
        while len(self._anchors) > self._max_anchors:
            self._anchors.popitem(last=False)
        self._open[request_id] = (anchor, entry)

    def done(self, request_id: str, worker: str, now: float) -> None:
        """The turn finished on `worker`: its state is freshest now, so the entry's life starts again."""
        opened = self._open.pop(request_id, None)
        if opened is None or opened[1].worker != worker:
            return
        anchor, entry = opened
        entry.at = now
        entries = self._anchors.pop(anchor, [])
        if entry not in entries:  # expired while the turn ran
            entries = (entries + [entry])[-PER_ANCHOR:]
        self._anchors[anchor] = entries

    def owner(self, prompt: Sequence[int], hashes: Sequence[bytes], now: float) -> str:
        """The worker of the longest earlier turn that `prompt` continues ("" when none is remembered)."""
        for i in range(len(hashes) - 1, -1, -1):
            entries = self._anchors.get(hashes[i])
            if not entries:
                continue
            live = [e for e in entries if e.length <= len(prompt) and now - e.at <= self.ttl_s]
            for e in sorted(live, key=lambda e: -e.length):
                if tail_digest(prompt, e.length) == e.digest:
                    return e.worker
        return ""

    def expire(self, now: float) -> None:
        # Anchors are kept least recently touched first: drop from the front while everything there is stale
        # (an old entry behind a fresh one waits for its anchor to reach the front; owner() skips it meanwhile).
        while self._anchors:
            anchor, entries = next(iter(self._anchors.items()))
            if any(now - e.at <= self.ttl_s for e in entries):
                break
            del self._anchors[anchor]
        self._open = {r: (a, e) for r, (a, e) in self._open.items() if now - e.at <= OPEN_TTL_S}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._anchors.values())
