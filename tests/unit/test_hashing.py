"""The one chained block hash: its bytes are fixed (stores on disk outlive processes), whatever the input type."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np

from shared import hashing


def _by_the_definition(token_ids: list[int], ns: bytes, bt: int) -> list[bytes]:
    keys, parent = [], ns
    for start in range(0, len(token_ids) - bt + 1, bt):
        h = hashlib.blake2b(parent, digest_size=hashing.DIGEST_BYTES)
        h.update(struct.pack(f"<{bt}q", *token_ids[start : start + bt]))
        parent = h.digest()
        keys.append(parent)
    return keys


def test_keys_follow_the_definition_for_lists_and_numpy_arrays() -> None:
    ns = hashing.namespace("model:layout", "tenant")
    rng = random.Random(0)
    for n in (0, 15, 16, 37, 300):
        tokens = [rng.randrange(0, 200_000) for _ in range(n)]
        for bt in (16, 128):
            want = _by_the_definition(tokens, ns, bt)
            assert hashing.block_hashes(tokens, ns, bt) == want
            assert hashing.block_hashes(np.array(tokens, dtype=np.int32), ns, bt) == want


def test_a_chain_continues_from_a_parent_and_salts_separate() -> None:
    ns = hashing.namespace("m")
    tokens = list(range(64))
    whole = hashing.block_hashes(tokens, ns)
    assert hashing.block_hashes(tokens[32:], whole[1]) == whole[2:]  # the parent key stands for the prefix
    assert hashing.block_hashes(tokens, hashing.namespace("m", "other tenant"))[0] != whole[0]
