"""Image sources as conversion finds them, and the bytes a data URL carries.

A source keeps the request location its errors name (`.messages[1]`, `input[0]`, `messages.0.content[2]`),
its detail level and either a data URL, an external URL or raw bytes, as the reference's `ImageSource` does.
A data URL is read as WHATWG fetch reads one: the MIME type before the comma (its essence must be one of the
four image types), `;base64` as the last parameter, then a forgiving base64 body (ASCII whitespace dropped,
padding optional) or else a percent-encoded one.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote_to_bytes

from services.recipe.images.spec import Detail

SourceKind = Literal["data_url", "url", "bytes"]
IMAGE_MIME = frozenset({"image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp"})
_WHITESPACE = re.compile(r"[\t\n\f\r ]")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*")


@dataclass(frozen=True)
class ImageSource:
    kind: SourceKind
    value: str  # the data URL or the external URL; "" for bytes
    detail: Detail = "high"
    path: str = ""
    data: bytes = b""  # kind "bytes" only


class DataUrlError(ValueError):
    """kind: "InvalidDataUrl" (not a data URL, bad base64) or "UnsupportedMediaType" (not an image type)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def data_url_bytes(url: str) -> bytes:
    if url[:5].lower() != "data:" or "," not in url:
        raise DataUrlError("InvalidDataUrl")
    header, body = url[5:].split(",", 1)
    params = [p.strip() for p in header.split(";")]
    is_base64 = len(params) > 1 and params[-1].lower() == "base64"
    if params[0].lower() not in IMAGE_MIME:
        raise DataUrlError("UnsupportedMediaType")
    if not is_base64:
        return unquote_to_bytes(body)
    return forgiving_base64(unquote_to_bytes(body).decode("latin-1"))


def forgiving_base64(text: str) -> bytes:
    """WHATWG's forgiving-base64 decode: whitespace goes; one or two "=" may end a body whose length is a
    multiple of 4; a body of 4k + 1 symbols, or "=" anywhere else, is invalid."""
    text = _WHITESPACE.sub("", text)
    if len(text) % 4 == 0 and text.endswith("="):
        text = text[:-2] if text.endswith("==") else text[:-1]
    if len(text) % 4 == 1 or not _BASE64.fullmatch(text):
        raise DataUrlError("InvalidDataUrl")
    stripped = text
    try:
        return base64.b64decode(stripped + "=" * (-len(stripped) % 4))
    except binascii.Error:
        raise DataUrlError("InvalidDataUrl") from None
