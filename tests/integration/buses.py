"""Small helpers for tests that talk over a real NATS server themselves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats

from shared.bus import Bus


async def connect(url: str, name: str) -> Bus:
    """A bus that drains fast on close (tests open and close many)."""
    return Bus(await nats.connect(url, name=name, drain_timeout=1), name)


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
