"""The one chained block hash: its bytes are fixed (stores on disk outlive processes), whatever the input type."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np

from shared import codec, hashing
from shared.schemas.generate import GenerateRequest, ImageInput, SamplingParams

IMAGE_ID = 129264  # deepseek-recipe's IMAGE_SPECIAL_TOKEN_ID


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


def _image(digest: bytes, start: int, length: int) -> ImageInput:
    return ImageInput(digest=digest, start=start, length=length, data=b"", format="png", width=546, height=546)


def test_prompts_that_differ_only_in_an_image_share_no_block_from_it_on() -> None:
    """Image tokens are one repeated placeholder id: only the image digests tell two such prompts apart."""
    ns = hashing.namespace("m")
    tokens = list(range(20)) + [IMAGE_ID] * 40 + list(range(30))  # the image spans [20, 60): blocks 1-3
    a = hashing.block_hashes(tokens, ns, 16, [_image(b"a" * 32, 20, 40)])
    b = hashing.block_hashes(tokens, ns, 16, [_image(b"b" * 32, 20, 40)])
    text = hashing.block_hashes(tokens, ns, 16)
    assert a[0] == b[0] == text[0]  # the block before the image is shared
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))
    assert len(set(a[1:]) & set(b[1:])) == 0
    assert a[1:] != text[1:]


def test_text_only_keys_are_unchanged_and_pieces_chain_with_an_offset() -> None:
    ns = hashing.namespace("m")
    tokens = list(range(96))
    assert hashing.block_hashes(tokens, ns, 16, []) == _by_the_definition(tokens, ns, 16)
    images = [_image(b"x" * 32, 40, 10), _image(b"y" * 32, 70, 3)]
    whole = hashing.block_hashes(tokens, ns, 16, images)
    # hashing from block 2 on with the parent key and the prompt offset gives the same keys
    assert hashing.block_hashes(tokens[32:], whole[1], 16, images, offset=32) == whole[2:]
    # an image is covered by exactly the blocks it touches: block 5 (80-95) holds none
    moved = hashing.block_hashes(tokens, ns, 16, [images[0], _image(b"z" * 32, 70, 3)])
    assert moved[:4] == whole[:4] and moved[4] != whole[4]


def test_a_request_with_images_survives_the_wire() -> None:
    request = GenerateRequest("r", "m", [1, IMAGE_ID, IMAGE_ID], SamplingParams(),
                              images=[ImageInput(b"d" * 32, 1, 2, b"\x89PNG...", "png", 546, 560, "low")])
    assert codec.decode(GenerateRequest, codec.encode(request)) == request
