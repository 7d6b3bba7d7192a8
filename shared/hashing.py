"""The one block size and the one chained block hash of the mesh.

Block i's key = H(key of block i-1 || namespace || token ids of block i), where the namespace folds in the
model's cache identity (model name, KV dtype and layout) and any salt (tenant, LoRA); a block that holds
image tokens also covers those images' content hashes. Only full blocks get keys: the partial tail is never
shared. The chain makes a key identify the whole prefix, so a store
that holds key k holds exactly that prefix's KV.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Protocol

BLOCK_TOKENS = 16  # tokens per KV block (Llama family); an engine may use a multiple (DeepSeek-V4: 128)
DIGEST_BYTES = 16


def namespace(cache_id: str, salt: str = "") -> bytes:
    """Identity of what a block's bytes mean: which model/layout produced them, and for whom."""
    return hashlib.blake2b(f"{cache_id}\x00{salt}".encode(), digest_size=DIGEST_BYTES).digest()


class ImageSpan(Protocol):
    """An image's run of placeholder tokens in a prompt and its content hash (shared/schemas/generate.py
    `ImageInput` is one)."""

    @property
    def digest(self) -> bytes: ...
    @property
    def start(self) -> int: ...
    @property
    def length(self) -> int: ...


def block_hashes(
    token_ids: Sequence[int], ns: bytes, block_tokens: int = BLOCK_TOKENS, images: Sequence[ImageSpan] = (),
    offset: int = 0,
) -> list[bytes]:
    """Keys of every full block of `token_ids` (a list, or a numpy integer array), in order.

    A block that holds any token of an image also covers that image's digest (an image's tokens are all the
    same placeholder id, so the ids alone would let two prompts that differ only in an image share blocks);
    the chain carries the difference into every later block. `offset` is the prompt position of
    `token_ids[0]` (for a caller that hashes a prompt in pieces). Without images the keys are the text-only
    ones, unchanged."""
    data = _token_bytes(token_ids)
    step = 8 * block_tokens
    keys: list[bytes] = []
    parent = ns
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
        h.update(data[start : start + step])
        first = offset + start // 8
        for image in images:
            if image.start < first + block_tokens and first < image.start + image.length:
                h.update(image.digest)
        parent = h.digest()
        keys.append(parent)
    return keys


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """The ids as little-endian int64s, the bytes a block's key covers."""
    as_type = getattr(token_ids, "astype", None)
    if as_type is not None:  # numpy: one conversion, no Python ints
        return as_type("<i8", copy=False).tobytes()
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def full_blocks(num_tokens: int, block_tokens: int = BLOCK_TOKENS) -> int:
    return num_tokens // block_tokens
