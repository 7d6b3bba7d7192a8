"""V4.1 image resolution as deepseek-recipe does it: the token specification, the preprocessed size and token
count of PNG / JPEG / GIF / WebP images of many shapes at every detail level, the limits and the errors
(status 400, the same message). Pixels are not compared: without an image library nothing is decoded here
(the reference's output is WebP), see .notes/i18-images.md."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.recipe.images import spec
from services.recipe.images.fetch import FetchError
from services.recipe.images.limits import ImageQuota
from services.recipe.images.resolve import ImageError, resolve
from services.recipe.images.sources import ImageSource
from tests.images import gif, jpeg, png
from tests.oracle.conftest import dr

PREPROCESSOR = dr.OpenCvImagePreprocessor()


class NoFetch:
    async def fetch(self, url: str, max_bytes: int) -> bytes:
        raise FetchError("DestinationRejected", False)


def oracle_resolve(sources: list[ImageSource]) -> Any:
    fetcher = dr.ReqwestImageFetcher().with_destination_filter(lambda host, address: False)
    resolver = dr.ImageResolver(fetcher, PREPROCESSOR)
    made = [_oracle_source(s) for s in sources]
    try:
        data = resolver.resolve(made, dr.ImageQuota())
    except dr.ImageError as exc:
        return ("error", str(exc))
    return [(i.width, i.height, dr.MultiModalData([i]).image_token_adjustment() + 1) for i in data.images]


def _oracle_source(s: ImageSource) -> Any:
    if s.kind == "bytes":
        return dr.BytesImageSource(s.data, s.detail, path=s.path)
    if s.kind == "data_url":
        return dr.DataUrlImageSource(s.value, s.detail, path=s.path)
    return dr.UrlImageSource(s.value, s.detail, path=s.path)


def our_resolve(sources: list[ImageSource]) -> Any:
    try:
        images = asyncio.run(resolve(sources, ImageQuota(), NoFetch()))
    except ImageError as exc:
        assert exc.status == 400
        return ("error", exc.message)
    return [(i.width, i.height, i.tokens) for i in images]


def webp(width: int, height: int) -> bytes:
    """A WebP of the reference's making (its preprocessing output), the nearest V4.1 size to width x height."""
    options = dr.PreprocessOptions("high", 8192, 512)
    return PREPROCESSOR.preprocess(png(np.zeros((height, width), np.uint8)), options).data


def encoded(fmt: str, width: int, height: int, channels: int) -> bytes:
    if fmt == "png":
        rng = np.random.default_rng(width * 7919 + height)
        shape = (height, width) if channels == 1 else (height, width, channels)
        return png(rng.integers(0, 256, shape, dtype=np.uint8))
    if fmt == "jpeg":
        return jpeg(width, height)
    if fmt == "gif":
        return gif(width, height)
    return webp(width, height)


# --- the token specification -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(1, 40_000), st.integers(1, 40_000))
def test_token_count_is_the_oracles(width: int, height: int) -> None:
    try:
        expected: Any = dr.MultiModalData([dr.ImageInfo(b"", width, height)]).image_token_adjustment() + 1
    except dr.CalcResizeError:
        expected = "CalcResizeError"
    try:
        got: Any = spec.token_count(width, height)
    except spec.CalcResizeError:
        got = "CalcResizeError"
    assert got == expected


def test_token_count_has_a_floor_and_a_ceiling() -> None:
    assert spec.token_count(1, 1) == 184
    assert max(spec.token_count(w, h) for w in (1, 50, 5000, 40000) for h in (1, 70, 9000)) <= spec.MAX_TOKENS


# --- preprocessed sizes and token counts ------------------------------------------------------------------

SIDES = st.one_of(st.integers(1, 64), st.integers(65, 1400), st.sampled_from([543, 544, 545, 546, 1302, 1303]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from(["png", "jpeg", "gif", "webp"]), SIDES, SIDES, st.sampled_from(spec.DETAILS),
       st.sampled_from([1, 2, 3, 4]), st.booleans())
def test_sizes_and_tokens_are_the_oracles(fmt: str, width: int, height: int, detail: str, channels: int,
                                          as_data_url: bool) -> None:
    if fmt == "gif":
        width, height = min(width, 300), min(height, 300)  # the encoder writes 6 bits a pixel
    data = encoded(fmt, width, height, channels)
    if as_data_url:
        source = ImageSource("data_url", f"data:image/{fmt};base64," + base64.b64encode(data).decode(), detail,
                             "messages[0]")
    else:
        source = ImageSource("bytes", "", detail, "messages[0]", data)
    assert our_resolve([source]) == oracle_resolve([source])


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.integers(1, 9000), st.integers(1, 9000), st.sampled_from(spec.DETAILS), st.integers(1, 16))
def test_elongated_and_large_images_are_the_oracles(long: int, short: int, detail: str, count: int) -> None:
    """Thin PNGs up to 9000 px: the 8192 px limit (4096 from 15 images on), low-detail scaling, the budget."""
    data = png(np.zeros((min(short, 40), long), np.uint8))
    sources = [ImageSource("bytes", "", detail, "input[0]", data)] * count
    assert our_resolve(sources) == oracle_resolve(sources)


# --- errors -----------------------------------------------------------------------------------------------

PNG = png(np.zeros((4, 4), np.uint8))
B64 = base64.b64encode(PNG).decode()
DATA_URLS = [
    "data:image/png;base64," + B64, "data:image/jpeg;base64," + B64, "data:text/plain;base64," + B64,
    "data:;base64," + B64, "data:image/png," + B64, "data:image/png;base64,!!!", "data:image/png;base64,",
    "data:image/png;base64," + B64[:-2], "data:image/png;base64," + B64 + "==", "data:image/png;base64, " + B64,
    "notdata", "data:image/bmp;base64," + B64, "data:image/png;base64," + base64.b64encode(b"hello").decode(),
    "data:image/png;base64," + base64.b64encode(PNG[:30]).decode(), "DATA:IMAGE/PNG;BASE64," + B64,
    "data:image/png;base64," + base64.urlsafe_b64encode(b"\xfb\xff" * 9).decode(), "data:image/foo;base64," + B64,
    "data:application/octet-stream;base64," + B64, "data:image/png;charset=x;base64," + B64,
    "data:image/png;base64," + B64.rstrip("="), "data:image/png;base64," + B64[:5] + "\n" + B64[5:],
    "data:image/png;base64,%41" + B64, "data: image/png ;base64," + B64, "data:image/png;base64," + B64 + "=",
    "data:image/png;base64;x," + B64, "data:image/png," + "".join(f"%{b:02X}" for b in PNG),
    "data:image/webp;base64," + base64.b64encode(b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 20).decode(),
    "data:image/gif;base64," + base64.b64encode(b"GIF89a\0\0\0\0").decode(),
    "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff\xd9").decode(),
]


def test_data_url_errors_are_the_oracles() -> None:
    for url in DATA_URLS:
        source = ImageSource("data_url", url, "high", ".messages[1]")
        assert our_resolve([source]) == oracle_resolve([source]), url


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=%, \n;:-_.", max_size=12),
       st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/= \n\t%", max_size=12),
       st.sampled_from(["data:image/png;base64,", "data:image/gif,", "data:image/png;base64", "data:"]))
def test_mangled_data_urls_are_the_oracles(insert: str, tail: str, head: str) -> None:
    url = head + insert + B64 + tail
    source = ImageSource("data_url", url, "high", "messages.0.content[1]")
    assert our_resolve([source]) == oracle_resolve([source]), url


def test_limits_are_the_oracles() -> None:
    one = ImageSource("bytes", "", "high", "m", PNG)
    bad = ImageSource("data_url", "data:image/png;base64,!!", "high", "m")
    # (URLs the reference cannot parse cost it about 2 s of retries each: one is enough)
    urls = ["ftp://x/y", "not a url", "http://", "http://a/" + "x" * 9000, "data:image/png;base64,AAAA"]
    cases = [[one] * 601, [one, bad], [bad, one, bad], [ImageSource("bytes", "", "low", "b", b"")],
             *[[ImageSource("url", u, "high", "u")] for u in urls],
             [ImageSource("url", "http://127.0.0.1:1/a", "high", "u")]]
    for sources in cases:
        assert our_resolve(sources) == oracle_resolve(sources), sources[0]


def test_byte_limits_are_the_oracles() -> None:
    one = ImageSource("bytes", "", "high", "b", b"\x89PNG" + b"\0" * (32 * 1024 * 1024 + 1))
    assert our_resolve([one]) == oracle_resolve([one])
    part = ImageSource("bytes", "", "high", "t", b"\x89PNG" + b"\0" * (30 * 1024 * 1024))
    assert our_resolve([part] * 3) == oracle_resolve([part] * 3)


def test_a_large_png_is_read_whole() -> None:
    """Megabytes of image data inflate in bounded pieces (a 2000 x 1500 RGB noise PNG is about 9 MB)."""
    data = png(np.random.default_rng(0).integers(0, 256, (1500, 2000, 3), dtype=np.uint8))
    source = ImageSource("bytes", "", "high", "m", data)
    assert our_resolve([source]) == oracle_resolve([source])
    broken = ImageSource("bytes", "", "high", "m", data[: len(data) // 2] + data[len(data) // 2 + 10 :])
    assert our_resolve([broken]) == oracle_resolve([broken])
