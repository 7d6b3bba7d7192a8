"""V4.1 image parts of every API -> image sources and their placeholders, with the reference's conversion-time
checks (what a source must look like; whether the bytes are an image is the resolver's question,
services/recipe/images/resolve.py).

An image part becomes the placeholder `<｜image｜>` in the message text (joined to the other parts by blank
lines, as every part is) and an `ImageSource` on the message. V4 has no image input: it keeps the text
"[Unsupported Image]" (the reference's rendering), and the request is refused later (`common.refuse_media`).
"""

from __future__ import annotations

import re

from services.recipe.conversation import Images
from services.recipe.errors import ConversionError
from services.recipe.formats.dsml import IMAGE
from services.recipe.images.resolve import UNSUPPORTED
from services.recipe.images.sources import IMAGE_MIME, DataUrlError, ImageSource, forgiving_base64
from services.recipe.images.spec import Detail

IMAGE_TOKEN = IMAGE
MAX_URL_BYTES = 8192
_DATA_URL = re.compile(r"data:(?P<mime>[^,]*?);base64,", re.IGNORECASE | re.DOTALL)
_STRICT_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")

Piece = str | ImageSource  # a text part, or an image part (its placeholder)


def join(pieces: list[Piece]) -> tuple[str, Images]:
    """Blank-line joined text with one placeholder per image, and the images with their placeholders' offsets."""
    texts: list[str] = []
    offsets: list[int] = []
    size = 0
    for n, piece in enumerate(pieces):
        if n:
            texts.append("\n\n")
            size += 2
        if isinstance(piece, ImageSource):
            offsets.append(size)
            piece = IMAGE
        texts.append(piece)
        size += len(piece)
    return "".join(texts), (tuple(p for p in pieces if isinstance(p, ImageSource)), tuple(offsets))


def image_url(url: str, detail: Detail | None, path: str, long_url: str) -> ImageSource:
    """Chat's `image_url` and Responses' `input_image`: a base64 data URL of an image type, or an http(s) URL of
    at most 8192 bytes (`long_url` is the error's start for a longer one)."""
    found = _DATA_URL.match(url)
    if found:
        if found["mime"].split(";")[0].strip().lower() not in IMAGE_MIME:
            raise ConversionError(f"{path}: {UNSUPPORTED}")
        try:
            forgiving_base64(url[found.end():])
        except DataUrlError:
            raise ConversionError(f"{path}: Invalid base64 data") from None
        return ImageSource("data_url", url, detail or "high", path)
    if url[:7].lower() == "http://" or url[:8].lower() == "https://":
        check_url_length(url, long_url)
        return ImageSource("url", url, detail or "high", path)
    raise ConversionError(f"{path}: Unsupported image_url format")


def check_url_length(url: str, where: str) -> None:
    """An external URL (anything but a data URL) of more than 8192 bytes is refused."""
    length = len(url.encode())
    if length > MAX_URL_BYTES and url[:5].lower() != "data:":
        raise ConversionError(
            f"{where} external link length {length} too long, max link length {MAX_URL_BYTES}. Consider passing "
            "file data directly with base64 data url instead.")


def base64_block(media_type: str, data: str, path: str, where: str) -> ImageSource:
    """Messages' base64 image source: strict (padded) base64, checked at conversion (`where` locates the
    block in errors, `path` the image for the resolver)."""
    if not _STRICT_BASE64.fullmatch(data):
        raise ConversionError(f"{where}: base64 decode error")
    media_type = "image/jpeg" if media_type == "image/jpg" else media_type
    return ImageSource("data_url", f"data:{media_type};base64,{data}", "high", path)


def url_block(url: str, path: str, where: str) -> ImageSource:
    """Messages' url image source: http(s) only, at most 8192 bytes."""
    if not (url[:7].lower() == "http://" or url[:8].lower() == "https://"):
        raise ConversionError(f"{where}: invalid url: {_debug(url)}")
    length = len(url.encode())
    if length > MAX_URL_BYTES:
        raise ConversionError(
            f"{where}: external link length {length} too long, max link length {MAX_URL_BYTES}. Consider passing "
            "file data directly with base64 data url instead.")
    return ImageSource("url", url, "high", path)


def _debug(text: str) -> str:
    """A string as Rust's `{:?}` prints it (the quotes and escapes of the reference's messages)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped.replace(chr(9), chr(92) + "t")}"'
