"""Image placeholders -> image tokens: the prompt a worker gets, with each image's run of tokens and its record.

A rendered V4.1 prompt holds one placeholder token per image (client text that spells `<｜image｜>` is encoded
as plain text, never as the token, so every placeholder id is a real image). Each placeholder becomes the
image's token count of that same id, as the inference backend expects it after deepseek-recipe
(`image_token_adjustment` is exactly the growth):

    [.., q, IMG, a, ..]  ->  [.., q, IMG x 184, a, ..]      ImageInput(start=2, length=184, ...)
"""

from __future__ import annotations

from services.recipe.images.resolve import PreparedImage
from shared.schemas.generate import ImageInput


def expand(prompt_ids: list[int], images: list[PreparedImage], image_id: int) -> tuple[list[int], list[ImageInput]]:
    """(prompt ids with every placeholder expanded, the image records in prompt order)."""
    slots = [i for i, token in enumerate(prompt_ids) if token == image_id]
    assert len(slots) == len(images), f"{len(slots)} image placeholders for {len(images)} images"
    out: list[int] = []
    records: list[ImageInput] = []
    pos = 0
    for slot, image in zip(slots, images, strict=True):
        out.extend(prompt_ids[pos:slot])
        records.append(ImageInput(image.digest, len(out), image.tokens, image.data, image.format, image.width,
                                  image.height, image.detail))
        out.extend([image_id] * image.tokens)
        pos = slot + 1
    out.extend(prompt_ids[pos:])
    return out, records
