"""Resolving a request's image sources: bytes from each source, the reference's limits, then the header read
and the V4.1 size and token count of every image, in placeholder order.

Every failure is an `ImageError` with the reference's 400 message: the source's request location, the image's
index among the sources of that location, and the reference's text (one text covers every kind of unreadable
image; `kind` names the reference's variant for logs and tests).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

from services.recipe.images import spec
from services.recipe.images.fetch import Fetcher, FetchError
from services.recipe.images.header import Format, HeaderError, read_header
from services.recipe.images.limits import MIB, ImageLimits, ImageQuota
from services.recipe.images.sources import DataUrlError, ImageSource, data_url_bytes

UNSUPPORTED = (
    "You have uploaded an unsupported image. Please make sure your image is valid and has one of the following "
    "formats: webp, png, jpeg, and gif."
)


class ImageError(Exception):
    def __init__(self, kind: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.status = 400


@dataclass(frozen=True)
class PreparedImage:
    """One image as the worker gets it: its encoded bytes (decoding waits for the encoder role, which has an
    image library), the V4.1 size it is resized to and the tokens it takes in the prompt."""

    format: Format
    data: bytes
    source_width: int
    source_height: int
    width: int  # after preprocessing
    height: int
    tokens: int
    detail: spec.Detail

    @property
    def digest(self) -> bytes:
        """Content hash: the encoded bytes and the target size (the same image at another size is another
        input to the encoder)."""
        h = hashlib.sha256(self.data)
        h.update(f"|{self.width}x{self.height}".encode())
        return h.digest()


async def resolve(
    sources: list[ImageSource], quota: ImageQuota, fetcher: Fetcher, limits: ImageLimits = ImageLimits(),
) -> list[PreparedImage]:
    if not sources:
        return []
    count = quota.images + len(sources)
    if count > limits.max_images:
        raise ImageError(
            "TooManyImages", f"{sources[0].path}: Too many images: max {limits.max_images} images per request, "
            f"got {count}")
    for source in sources:
        if source.kind == "url":
            _check_url(source, limits)
    indexed = _indexed(sources)
    remaining = limits.max_total_bytes - quota.bytes
    blobs: list[bytes] = []
    for source, where in indexed:
        data = await _bytes(source, where, fetcher, limits)
        if len(data) > remaining:
            used = limits.max_total_bytes - remaining + len(data)
            raise ImageError(
                "TotalSizeTooLarge", f"{source.path}: Total image size exceeds the limit: max "
                f"{limits.max_total_bytes // MIB} MB per request, got {used // MIB} MB")
        remaining -= len(data)
        blobs.append(data)
    images = [_prepare(data, source, where, limits.max_dimension(count), limits)
              for data, (source, where) in zip(blobs, indexed, strict=True)]
    quota.images = count
    quota.bytes += sum(len(b) for b in blobs)
    return images


def _indexed(sources: list[ImageSource]) -> list[tuple[ImageSource, str]]:
    """Each source with its error prefix: `path.image[k]`, k counting the sources of that path."""
    seen: Counter[str] = Counter()
    out = []
    for source in sources:
        out.append((source, f"{source.path}.image[{seen[source.path]}]"))
        seen[source.path] += 1
    return out


def _check_url(source: ImageSource, limits: ImageLimits) -> None:
    length = len(source.value.encode())
    if length > limits.max_url_bytes:
        raise ImageError(
            "UrlTooLong", f"{source.path}: external link length {length} too long, max link length "
                          f"{limits.max_url_bytes}")
    # The reference checks the scheme only; a URL that names no host fails when it is fetched.
    if not source.value.lower().startswith(("http://", "https://")):
        raise ImageError("InvalidUrl", f"{source.path}: invalid url: {json.dumps(source.value, ensure_ascii=False)}")


async def _bytes(source: ImageSource, where: str, fetcher: Fetcher, limits: ImageLimits) -> bytes:
    if source.kind == "bytes":
        data = source.data
    elif source.kind == "data_url":
        try:
            data = data_url_bytes(source.value)
        except DataUrlError as exc:
            raise ImageError(exc.kind, f"{where}: {UNSUPPORTED}") from None
    else:
        try:
            data = await fetcher.fetch(source.value, limits.max_image_bytes)
        except FetchError as exc:
            raise ImageError(exc.kind, f"{where}: Failed to download image from {source.value}",
                             retryable=exc.retryable) from None
    if len(data) > limits.max_image_bytes:
        raise ImageError("ImageTooLarge", f"{where}: image file size exceeds limit {limits.max_image_bytes // MIB} MB")
    return data


def _prepare(data: bytes, source: ImageSource, where: str, max_side: int, limits: ImageLimits) -> PreparedImage:
    if not data:
        raise ImageError("EmptyImage", f"{where}: {UNSUPPORTED}")
    try:
        header = read_header(data)
    except HeaderError as exc:
        raise ImageError(exc.kind, f"{where}: {UNSUPPORTED}") from None
    if header.width > max_side or header.height > max_side:
        raise ImageError("ImageDimensionsTooLarge", f"{where}: {UNSUPPORTED}")
    if header.width == 0 or header.height == 0:
        raise ImageError("EmptyImage", f"{where}: {UNSUPPORTED}")
    width, height = header.width, header.height
    if source.detail == "low":
        width, height = spec.low_detail_size(width, height, limits.low_detail_max_side)
    try:
        best_w, best_h = spec.target_size(width, height)
        tokens = spec.token_count(best_w, best_h)
    except (spec.CalcResizeError, spec.TargetSizeError):
        raise ImageError("Resize", f"{where}: {UNSUPPORTED}") from None
    return PreparedImage(header.format, data, header.width, header.height, best_w, best_h, tokens, source.detail)
