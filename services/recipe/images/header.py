"""An image's format and size from its first bytes, as the reference reads them before decoding.

The format is sniffed from magic numbers (the declared MIME type does not matter); the size is the one the
header declares: PNG's IHDR, GIF's logical screen, a JPEG's frame header (SOFn), WebP's VP8 / VP8L / VP8X
chunk. Without an image library the body is never decoded, so damage past the header goes unnoticed here.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Literal

Format = Literal["png", "jpeg", "gif", "webp"]


class HeaderError(ValueError):
    """kind: "UnsupportedMediaType" (not one of the four formats) or "Decode" (a header that does not parse)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


@dataclass(frozen=True)
class Header:
    format: Format
    width: int
    height: int


def sniff(data: bytes) -> Format:
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:4] == b"\x89PNG":
        return "png"
    if data[:3] == b"GIF":
        return "gif"
    if len(data) > 11 and data[8:12] == b"WEBP":
        return "webp"
    raise HeaderError("UnsupportedMediaType")


def read_header(data: bytes) -> Header:
    fmt = sniff(data)
    try:
        width, height = _READERS[fmt](data)
    except (struct.error, IndexError):
        raise HeaderError("Decode") from None
    return Header(fmt, width, height)


def _png(data: bytes) -> tuple[int, int]:
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise HeaderError("Decode")
    width, height = struct.unpack(">II", data[16:24])
    _png_chunks(data)
    return width, height


def _png_chunks(data: bytes) -> None:
    """A PNG is whole when its chunks run, each complete, to IEND, and the critical ones pass their CRC (what
    libpng refuses to decode); the image data stream must inflate without error. Bytes after IEND are ignored,
    as libpng ignores them."""
    pos = 8
    inflate = zlib.decompressobj()
    while True:
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        end = pos + 12 + length
        if len(kind) < 4 or end > len(data):
            raise HeaderError("Decode")
        critical = kind[0] < 0x61  # an upper-case first letter
        if critical and zlib.crc32(data[pos + 4 : end - 4]) != struct.unpack(">I", data[end - 4 : end])[0]:
            raise HeaderError("Decode")
        if kind == b"IDAT":  # inflated in bounded pieces: only errors matter, never the pixels
            try:
                inflate.decompress(data[pos + 8 : end - 4], 1 << 20)
                while inflate.unconsumed_tail:
                    inflate.decompress(inflate.unconsumed_tail, 1 << 20)
            except zlib.error:
                raise HeaderError("Decode") from None
        if kind == b"IEND":
            return
        pos = end



def _gif(data: bytes) -> tuple[int, int]:
    if data[:6] not in (b"GIF87a", b"GIF89a"):
        raise HeaderError("Decode")
    width, height = struct.unpack("<HH", data[6:10])
    return width, height


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(data: bytes) -> tuple[int, int]:
    pos = 2
    while True:
        if data[pos] != 0xFF:
            raise HeaderError("Decode")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
            continue
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return width, height
        if marker in (0xD9, 0xDA):  # end of image or scan before any frame header
            raise HeaderError("Decode")
        pos += 2 + length


def _webp(data: bytes) -> tuple[int, int]:
    if data[:4] != b"RIFF":
        raise HeaderError("Decode")
    chunk = data[12:16]
    if chunk == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            raise HeaderError("Decode")
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L":
        if data[20] != 0x2F:
            raise HeaderError("Decode")
        (bits,) = struct.unpack("<I", data[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return width, height
    raise HeaderError("Decode")


_READERS = {"png": _png, "gif": _gif, "jpeg": _jpeg, "webp": _webp}
