"""Small image encoders for tests, in numpy and the standard library (no image library is installed):
PNG (any channel count), a flat grey baseline JPEG and a flat GIF of any size. WebP images come from the
reference, whose preprocessing writes WebP."""

from __future__ import annotations

import struct
import zlib

import numpy as np

_PNG_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type


def png(pixels: np.ndarray) -> bytes:
    """(H, W) or (H, W, C) uint8 -> PNG."""
    a = np.ascontiguousarray(pixels, dtype=np.uint8)
    h, w = a.shape[:2]
    channels = 1 if a.ndim == 2 else a.shape[2]
    rows = a.reshape(h, w * channels)
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1).tobytes()  # filter byte 0 per row
    ihdr = struct.pack(">IIBBBBB", w, h, 8, _PNG_TYPES[channels], 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 1)) + _chunk(b"IEND", b"")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def jpeg(width: int, height: int) -> bytes:
    """A grey baseline JPEG: one component, every coefficient zero, one-code Huffman tables (each 8x8 block
    is two 0 bits: DC category 0, then end of block)."""
    blocks = -(-width // 8) * -(-height // 8)
    bits = 2 * blocks
    scan = b"\x00" * (bits // 8) + (bytes([0xFF >> (bits % 8)]) if bits % 8 else b"")
    scan = scan.replace(b"\xff", b"\xff\x00")
    dqt = b"\x00" + b"\x01" * 64
    sof = struct.pack(">BHHB", 8, height, width, 1) + b"\x01\x11\x00"
    table = bytes([1] + [0] * 15) + b"\x00"  # one code of length 1 for symbol 0
    sos = b"\x01\x01\x00\x00\x3f\x00"
    return (b"\xff\xd8" + _segment(0xDB, dqt) + _segment(0xC0, sof) + _segment(0xC4, b"\x00" + table)
            + _segment(0xC4, b"\x10" + table) + _segment(0xDA, sos) + scan + b"\xff\xd9")


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def gif(width: int, height: int, color: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    """A one-colour GIF89a. Its LZW stream sends a clear code before every pixel, so the code width stays
    3 bits and no table is built."""
    n = width * height
    codes = np.empty(2 * n + 2, np.uint32)
    codes[0:-2:2], codes[1:-2:2] = 4, 0  # clear, pixel index 0
    codes[-2:] = (4, 5)  # clear, end of information
    bits = ((codes[:, None] >> np.arange(3)) & 1).astype(np.uint8).ravel()  # LSB first
    data = np.packbits(bits, bitorder="little").tobytes()
    blocks = b"".join(bytes([len(data[i:i + 255])]) + data[i:i + 255] for i in range(0, len(data), 255))
    screen = struct.pack("<6sHHBBB", b"GIF89a", width, height, 0x80, 0, 0)  # global table of 2 colours
    palette = bytes(color) + b"\x00\x00\x00"
    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
    return screen + palette + image + b"\x02" + blocks + b"\x00\x3b"
