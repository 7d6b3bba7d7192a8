"""External image URLs, fetched by the recipe with aiohttp: a host allow-list, a size limit and a timeout.

Fetching is off unless hosts are allowed (`--image-fetch-hosts`): a recipe that fetches any URL a client names
can be pointed at the mesh's own network (SSRF), so the default reads only data URLs and base64. A host is
allowed by its exact name or by "*". Every failure is a `FetchError`; the resolver reports it as the reference
does ("Failed to download image from ...").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import aiohttp
import yarl


class FetchError(Exception):
    """kind: "DestinationRejected", "FetchStatus" or "Fetch" (transport, timeout, size); retryable as the
    reference classifies it."""

    def __init__(self, kind: str, retryable: bool) -> None:
        super().__init__(kind)
        self.kind = kind
        self.retryable = retryable


class Fetcher(Protocol):
    async def fetch(self, url: str, max_bytes: int) -> bytes: ...


@dataclass(frozen=True)
class FetchPolicy:
    hosts: frozenset[str] = frozenset()  # empty = fetching off; "*" = any host
    max_bytes: int = 32 * 1024 * 1024
    timeout_s: float = 60.0

    def allows(self, host: str) -> bool:
        return "*" in self.hosts or host.lower() in self.hosts


def fetch_policy(hosts: str, max_bytes: int, timeout_s: float) -> FetchPolicy:
    """The policy of the comma-separated host list the option holds."""
    names = frozenset(h.strip().lower() for h in hosts.split(",") if h.strip())
    if max_bytes <= 0 or timeout_s <= 0:
        raise ValueError(f"image fetch limits must be positive, got {max_bytes} bytes, {timeout_s} s")
    return FetchPolicy(names, max_bytes, timeout_s)


class HttpFetcher:
    """One aiohttp session per fetch: image URLs are rare and a pooled session would outlive its loop in tests."""

    def __init__(self, policy: FetchPolicy) -> None:
        self._policy = policy

    async def fetch(self, url: str, max_bytes: int) -> bytes:
        try:
            host = yarl.URL(url).host or ""
        except ValueError:
            raise FetchError("Fetch", False) from None
        if not self._policy.allows(host):
            raise FetchError("DestinationRejected", False)
        limit = min(max_bytes, self._policy.max_bytes)
        timeout = aiohttp.ClientTimeout(total=self._policy.timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(url, allow_redirects=False) as response:
                    if response.status != 200:
                        raise FetchError("FetchStatus", response.status >= 500)
                    return await _body(response, limit)
        except (aiohttp.ClientError, TimeoutError):
            raise FetchError("Fetch", True) from None


async def _body(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, given up on as soon as it passes `limit` (a Content-Length that says so is not even read)."""
    if response.content_length is not None and response.content_length > limit:
        raise FetchError("Fetch", True)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise FetchError("Fetch", True)
        chunks.append(chunk)
    return b"".join(chunks)
