"""Image URLs fetched by the recipe (aiohttp) from a local aiohttp server: the allow-list, the size limit, the
timeout and HTTP errors, each failure worded as deepseek-recipe words it for the same URL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from aiohttp import web

from services.recipe.images.fetch import FetchPolicy, HttpFetcher, fetch_policy
from services.recipe.images.limits import ImageQuota
from services.recipe.images.resolve import ImageError, resolve
from services.recipe.images.sources import ImageSource
from tests.images import png

PNG = png(np.full((30, 50, 3), 7, np.uint8))


async def _ok(_: web.Request) -> web.Response:
    return web.Response(body=PNG, content_type="image/png")


async def _slow(_: web.Request) -> web.Response:
    await asyncio.sleep(1.5)  # past the 0.3 s timeout the test sets, short enough for teardown
    return web.Response(body=PNG, content_type="image/png")


async def _missing(_: web.Request) -> web.Response:
    return web.Response(status=404)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """An aiohttp server on a free loopback port, on its own loop in a thread (the reference's fetch blocks)."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes([web.get("/ok.png", _ok), web.get("/slow.png", _slow), web.get("/missing.png", _missing)])
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def ours(url: str, policy: FetchPolicy) -> object:
    try:
        images = asyncio.run(resolve([ImageSource("url", url, "high", "u")], ImageQuota(), HttpFetcher(policy)))
    except ImageError as exc:
        return ("error", exc.message)
    return [(i.width, i.height, i.tokens, i.data == PNG) for i in images]


def oracle(url: str, max_bytes: int = 32 * 1024 * 1024, allow: bool = True) -> object:
    dr = pytest.importorskip("deepseek_recipe")
    fetcher = dr.ReqwestImageFetcher.with_max_bytes(max_bytes).with_destination_filter(lambda h, a: allow)
    try:
        data = dr.ImageResolver(fetcher, dr.OpenCvImagePreprocessor()).resolve(
            [dr.UrlImageSource(url, "high", path="u")], dr.ImageQuota())
    except dr.ImageError as exc:
        return ("error", str(exc))
    return [(i.width, i.height, dr.MultiModalData([i]).image_token_adjustment() + 1, True) for i in data.images]


def test_an_allowed_host_is_fetched_and_resolved_as_the_reference(server: str) -> None:
    url = f"{server}/ok.png"
    got = ours(url, fetch_policy("127.0.0.1", 1 << 20, 10))
    assert got == oracle(url)
    assert got == ours(url, fetch_policy("*", 1 << 20, 10))


def test_fetching_is_off_by_default_and_other_hosts_are_refused(server: str) -> None:
    url = f"{server}/ok.png"
    refused = oracle(url, allow=False)
    assert refused == ("error", f"u.image[0]: Failed to download image from {url}")
    assert ours(url, FetchPolicy()) == refused
    assert ours(url, fetch_policy("localhost, example.com", 1 << 20, 10)) == refused


def test_a_body_over_the_size_limit_fails(server: str) -> None:
    url = f"{server}/ok.png"
    assert ours(url, fetch_policy("127.0.0.1", len(PNG) - 1, 10)) == oracle(url, max_bytes=len(PNG) - 1)
    assert ours(url, fetch_policy("127.0.0.1", len(PNG), 10)) == oracle(url, max_bytes=len(PNG))


def test_a_slow_server_times_out_and_a_missing_image_fails(server: str) -> None:
    slow = f"{server}/slow.png"
    failed = ("error", f"u.image[0]: Failed to download image from {slow}")
    assert ours(slow, fetch_policy("127.0.0.1", 1 << 20, 0.3)) == failed
    missing = f"{server}/missing.png"
    assert ours(missing, fetch_policy("127.0.0.1", 1 << 20, 10)) == oracle(missing)


def test_the_policy_refuses_nonsense_limits() -> None:
    with pytest.raises(ValueError):
        fetch_policy("*", 0, 10)
    with pytest.raises(ValueError):
        fetch_policy("*", 10, 0)
