"""The V4.1 image token specification: the size an image is resized to and the tokens it takes.

14-pixel patches, downsampled 3x per side into a token grid; each grid row ends in a newline token and the
image is framed by a start and an end token, so an h x w grid takes h * (w + 1) + 2 tokens (at most 1024).
An image under 544*544 pixels is first scaled up to that area; sides are then rounded up to whole patches,
and a grid over budget is solved down to the largest aspect-preserving one that fits. Fitting repeats until
the size is a fixed point (10 rounds at most, else `CalcResizeError`, as the reference reports it). WebP
(the reference's output encoding) caps a side at 16383, so an elongated fit is squeezed into that and fitted
again.

    width 100 x height 100   ->  544x544 area  ->  546 x 546  (39 x 39 patches, 13 x 13 grid) = 184 tokens
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Detail = Literal["low", "high", "original", "auto"]
DETAILS: tuple[Detail, ...] = ("low", "high", "original", "auto")

PATCH = 14
DOWNSAMPLE = 3
MAX_TOKENS = 1024
MIN_PIXELS = 544 * 544
MAX_ROUNDS = 10
WEBP_MAX_SIDE = 16383
WEBP_ROUNDS = 6
LOW_DETAIL_MAX_SIDE = 512


class CalcResizeError(ValueError):
    """Fitting did not reach a fixed point (the reference's error of the same name)."""


class TargetSizeError(ValueError):
    """No size within WebP's limit fits the specification (the reference answers 400 for the image)."""


@dataclass(frozen=True)
class Fit:
    width: int
    height: int
    rows: int  # token grid
    cols: int

    @property
    def tokens(self) -> int:
        return self.rows * (self.cols + 1) + 2


def fit(width: int, height: int) -> Fit:
    """The fixed point of one fitting step, starting from `width` x `height`."""
    result = _fit_once(width, height)
    for _ in range(1, MAX_ROUNDS):
        following = _fit_once(result.width, result.height)
        if following == result:
            return result
        result = following
    raise CalcResizeError(f"image resize did not converge after {MAX_ROUNDS} iterations, last result: {result}")


def token_count(width: int, height: int) -> int:
    return fit(width, height).tokens


def target_size(width: int, height: int) -> tuple[int, int]:
    """The preprocessed size of a decoded `width` x `height` image: the fit, kept within WebP's side limit."""
    source = (width, height)
    for _ in range(WEBP_ROUNDS):
        fitted = fit(*source)
        if fitted.width <= WEBP_MAX_SIDE and fitted.height <= WEBP_MAX_SIDE:
            return fitted.width, fitted.height
        source = _into_webp_limit(fitted.width, fitted.height)
    raise TargetSizeError(f"no V4.1 target size within {WEBP_MAX_SIDE} pixels for an image of {width}x{height} pixels")


def low_detail_size(width: int, height: int, max_side: int = LOW_DETAIL_MAX_SIDE) -> tuple[int, int]:
    """At low detail the long side is first scaled down to `max_side` (rounding half away from zero)."""
    long_side = max(width, height)
    if long_side <= max_side:
        return width, height
    ratio = max_side / long_side
    return max(1, _round_half_away(width * ratio)), max(1, _round_half_away(height * ratio))


def _fit_once(width: int, height: int) -> Fit:
    pixels = width * height
    if 0 < pixels < MIN_PIXELS:
        ratio = math.sqrt(MIN_PIXELS / pixels)
        width, height = int(width * ratio), int(height * ratio)
    best = _grid(_ceil_to(width, PATCH), _ceil_to(height, PATCH))
    if best.tokens > MAX_TOKENS:
        best = _solve_budget(width, height)
    return best


def _grid(width: int, height: int) -> Fit:
    return Fit(width, height, -(-(height // PATCH) // DOWNSAMPLE), -(-(width // PATCH) // DOWNSAMPLE))


def _solve_budget(width: int, height: int) -> Fit:
    """The largest grid of this aspect within the budget: rows * (cols + 1) + 2 <= MAX_TOKENS with
    rows = cols * ratio, so cols = sqrt((MAX_TOKENS - 2) / ratio + 1/4) - 1/2."""
    cell = PATCH * DOWNSAMPLE
    ratio = height / width
    cols_f = math.sqrt((MAX_TOKENS - 2.0) / ratio + 0.25) - 0.5
    rows_f = cols_f * ratio
    if cols_f < 1.0:  # taller than one column can hold: one column, as many rows as fit
        return _grid(cell, (MAX_TOKENS - 2) // 2 * cell)
    if rows_f < 1.0:  # wider than one row can hold
        return _grid((MAX_TOKENS - 2 - 1) * cell, cell)
    beta = min(int(cols_f) * cell / width, int(rows_f) * cell / height)
    return _grid(int(width * beta / PATCH) * PATCH, int(height * beta / PATCH) * PATCH)


def _into_webp_limit(width: int, height: int) -> tuple[int, int]:
    """The long side onto the patch grid at or below the limit, the short side scaled and rounded up onto it
    (so the area stays above the minimum, which would otherwise scale the long side back up)."""
    long_side = max(width, height)
    if long_side <= WEBP_MAX_SIDE:
        return width, height
    scaled_long = WEBP_MAX_SIDE // PATCH * PATCH
    short = max(1, int(round_half_even(min(width, height) * scaled_long / long_side)))
    short = _ceil_to(short, PATCH)
    return (scaled_long, short) if width >= height else (short, scaled_long)


def _ceil_to(value: int, step: int) -> int:
    return -(-value // step) * step


def _round_half_away(x: float) -> int:
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def round_half_even(x: float) -> int:
    return round(x)
