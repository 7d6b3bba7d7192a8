"""Short-term snapshots: what a token sequence needs besides its full blocks, at one point of it.

A snapshot at `length` tokens holds the partial block at that point (the KV of tokens past the last full block;
empty when `length` is block-aligned) and the model's per-request state there (DeepSeek-V4's sliding-window rings
and compressor tails; nothing for Llama). Prefill saves one at the end of the prompt (decode continues from it)
and decode saves one at the end of the output, next to the output's full blocks: a multi-turn follow-up, whose
prompt starts with the previous prompt and answer, finds it and computes only its new turn. Snapshots live in
the kvcache service's short-term tier (TTL ~180 s); a miss falls back to the full blocks (and, for V4, bounded
replay), never to an error.

Content-addressed, so any worker finds one without knowing who wrote it:

    anchor(length)  = chained hash of the last full block before `length` (the namespace when there is none)
    key(length)     = H(anchor, the tokens from that block boundary to `length`)
    anchor index    = for each anchor, the tail lengths of the snapshots saved under it

A prompt looks up the anchor index of its block boundaries (one request for all of them), then the keys its own
tokens give for the lengths listed there, longest first: the key already proves the tokens match.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from shared import hashing
from shared.worker.kvclient import SHORT_TERM_TTL_S, KvClient, get_parts, put_parts

MAX_LENGTHS_PER_ANCHOR = 16  # an anchor shared by many conversations keeps its newest snapshots' lengths


@dataclass(frozen=True)
class Snapshot:
    length: int  # tokens of the sequence it covers
    tail: bytes  # the partial block at `length` (b"" when block-aligned)
    state: bytes  # the model's per-request state after `length` tokens (b"" for models without one)


def anchor_of(ns: bytes, hashes: Sequence[bytes], length: int, block_tokens: int) -> bytes:
    full = length // block_tokens
    return hashes[full - 1] if full else ns


def snapshot_key(anchor: bytes, tail_tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(b"snapshot\x00" + anchor, digest_size=hashing.DIGEST_BYTES)
    h.update(struct.pack(f"<{len(tail_tokens)}q", *tail_tokens))
    return b"snap:" + h.digest()


def anchor_key(anchor: bytes) -> bytes:
    return b"anchor:" + anchor


def key_for(tokens: Sequence[int], ns: bytes, hashes: Sequence[bytes], length: int, block_tokens: int) -> bytes:
    """The key of a snapshot of `tokens[:length]`; `hashes` are the chained hashes of tokens' full blocks."""
    start = length // block_tokens * block_tokens
    return snapshot_key(anchor_of(ns, hashes, length, block_tokens), tokens[start:length])


async def save(kv: KvClient, tokens: Sequence[int], ns: bytes, hashes: Sequence[bytes], block_tokens: int,
               snap: Snapshot, part_bytes: int) -> bytes:
    """Store `snap` (of tokens[:snap.length]) and list it under its anchor; returns its key ("" if not stored)."""
    key = key_for(tokens, ns, hashes, snap.length, block_tokens)
    blob = msgpack.packb([snap.length, snap.tail, snap.state])
    if not await put_parts(kv, key, blob, part_bytes):
        return b""
    anchor = anchor_key(anchor_of(ns, hashes, snap.length, block_tokens))
    (listed,) = await kv.get_many([anchor])
    lengths = [t for t in (msgpack.unpackb(listed) if listed else []) if t != snap.length % block_tokens]
    lengths = (lengths + [snap.length % block_tokens])[-MAX_LENGTHS_PER_ANCHOR:]
    await kv.put_many([(anchor, msgpack.packb(lengths))], ttl_s=SHORT_TERM_TTL_S)
    return key


async def load(kv: KvClient, key: bytes) -> Snapshot | None:
    blob, _ = await get_parts(kv, key)
    if not blob:
        return None
    length, tail, state = msgpack.unpackb(blob)
    return Snapshot(length, tail, state)


async def find(kv: KvClient, tokens: Sequence[int], ns: bytes, hashes: Sequence[bytes], block_tokens: int,
               limit: int) -> tuple[Snapshot, bytes] | None:
    """The longest stored snapshot of tokens[:L] with L <= limit whose full blocks are among `hashes` (the run
    the caller will fetch), and its key."""
    full = min(len(hashes), limit // block_tokens)
    anchors = [ns, *hashes[:full]]  # anchors[b] = anchor of a snapshot in block b
    listed = await kv.get_many([anchor_key(a) for a in anchors])
    candidates = []
    for b, entry in enumerate(listed):
        if entry:
            for tail in msgpack.unpackb(entry):
                length = b * block_tokens + tail
                if 0 < length <= limit:
                    candidates.append((length, snapshot_key(anchors[b], tokens[b * block_tokens : length])))
    for length, key in sorted(candidates, reverse=True):
        snap = await load(kv, key)
        if snap is not None and snap.length == length:
            return snap, key
    return None
