"""The bus connection's state, apart from its I/O (shared/bus.py): the reconnect backoff, the log line per change
of state, the listeners told of a loss and a reconnect, and the stream messages kept for a replay. No I/O here:
nats-py calls the `ConnectionState` callbacks, the bus reads and acts on the rest.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Server

log = logging.getLogger("shared.bus")  # one logger for the bus, however its code is split

RECONNECT_FIRST_S = 0.1  # delay before the 2nd attempt at one server; doubles each failure up to RECONNECT_MAX_S
RECONNECT_MAX_S = 2.0  # a restarted server is found within about this much of being back
REPLAY_WINDOW_S = 20.0  # how long published stream messages are kept for a replay
REPLAY_MAX_BYTES = 16 * 1024 * 1024  # and at most this many bytes of them (the oldest go first)
REPLAY_MARGIN_S = 2.0  # replay from this long before the loss: what the dying server may still have held
REPLAY_AFTER_S = (1.0, 4.0)  # after a reconnect: peers reconnect within about RECONNECT_MAX_S of the server
REPLAY_FLUSH_EVERY = 256  # messages replayed between flushes (the client's pending buffer is bounded)
OUTAGE_GRACE_S = 10.0  # a bus down longer than this ends the requests in flight (503): nothing can reach them
RESUME_S = 10.0  # a stream still silent this long after the reconnect (and its replays) lost its messages
MAX_REPLICAS = 3  # what a NATS cluster usually runs: R3 keeps a quorum with one server down
# errors that mean the connection itself broke (nats-py reconnects after them)
CONNECTION_ERRORS = (nats.errors.UnexpectedEOF, nats.errors.StaleConnectionError, OSError, asyncio.TimeoutError)
# what a publish or request raises while its connection is down: a handler failing with one failed for the bus
BUS_DOWN_ERRORS = (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                   nats.errors.ConnectionDrainingError, nats.errors.OutboundBufferLimitError,
                   nats.errors.NoServersError, nats.errors.StaleConnectionError, nats.errors.UnexpectedEOF)


def stream_replicas(servers: int) -> int:
    """Copies JetStream keeps of each stream and bucket this bus creates: 3 where the cluster has 3 servers or
    more (a stream then survives the loss of any one), else 1 (a single server holds one copy)."""
    return MAX_REPLICAS if servers >= MAX_REPLICAS else 1


def reconnect_delay(failures: int, jitter: float) -> float:
    """Seconds to wait before trying a server that failed `failures` times in a row: none before the first retry,
    then RECONNECT_FIRST_S doubling up to RECONNECT_MAX_S, each scaled by `jitter` in [0.5, 1] so a fleet of
    clients does not knock on a restarted server all in the same instant."""
    if failures <= 0:
        return 0.0
    return min(RECONNECT_FIRST_S * 2 ** (failures - 1), RECONNECT_MAX_S) * jitter


def next_server(servers: list[Server], _info: dict[str, Any]) -> tuple[Server | None, float]:
    """nats-py's reconnect hook: the server with the fewest failed attempts in a row, and the backoff before it."""
    chosen = min(servers, key=lambda s: s.reconnects)
    return chosen, reconnect_delay(chosen.reconnects, random.uniform(0.5, 1.0))


class ConnectionState:
    """The connection's state changes, each logged once, and the `on_lost` listeners. nats-py calls these from
    its reading and reconnecting tasks."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.closing = False
        self.connected_once = False
        self.lost_at: float | None = None  # monotonic time the connection went down; None while up
        self.losses = 0
        self.lost_listeners: list[Callable[[], None]] = []
        self.back_listeners: list[Callable[[], None]] = []
        self.back_at = 0.0  # monotonic time of the last reconnect
        self.last_lost_at = 0.0  # monotonic time of the last loss
        self._said_why = False
        self._cause: Exception | None = None  # what broke the connection, said in the "lost" line

    def established(self) -> None:
        self.connected_once, self._said_why = True, False

    async def disconnected(self) -> None:
        if self.closing or self.lost_at is not None:
            return
        self.lost_at, self._said_why = time.monotonic(), False
        self.last_lost_at = self.lost_at
        self.losses += 1
        why = f" ({describe(self._cause)})" if self._cause is not None else ""
        self._cause = None
        log.warning("%s: lost the NATS connection%s; reconnecting", self.name, why)
        for listener in list(self.lost_listeners):
            try:
                listener()
            except Exception:  # one broken listener must not keep the others from ending their requests
                log.exception("%s: on_lost listener failed", self.name)

    async def reconnected(self) -> None:
        down = time.monotonic() - self.lost_at if self.lost_at is not None else 0.0
        self.lost_at, self.back_at = None, time.monotonic()
        log.warning("%s: reconnected to NATS after %.1f s", self.name, down)
        for listener in list(self.back_listeners):
            listener()

    async def error(self, exc: Exception) -> None:
        # nats-py reports here what broke the connection, then every failed reconnect attempt (its default logs
        # each with a traceback): the cause goes into the "lost" line, the first failed attempt is said once,
        # the rest at debug. Other errors (a slow consumer, a permission) are logged as they come.
        if self.closing:
            return
        if not self.connected_once:  # the first connection, retried until a server answers
            if not self._said_why:
                self._said_why = True
                log.warning("%s: NATS unreachable (%s); retrying", self.name, describe(exc))
            else:
                log.debug("%s: NATS still unreachable: %r", self.name, exc)
            return
        if self.lost_at is None and isinstance(exc, CONNECTION_ERRORS):
            self._cause = exc
            log.debug("%s: NATS connection failing: %r", self.name, exc)
        elif self.lost_at is not None and self._said_why:
            log.debug("%s: NATS still unreachable: %r", self.name, exc)
        elif self.lost_at is not None:
            self._said_why = True
            log.warning("%s: NATS unreachable (%s); retrying every %g s at most", self.name, describe(exc),
                        RECONNECT_MAX_S)
        else:
            log.warning("%s: NATS: %s", self.name, describe(exc))


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class RecentStreams:
    """What a bus published on the request streams lately: (time, subject, data, headers), oldest first,
    bounded by REPLAY_WINDOW_S and REPLAY_MAX_BYTES."""

    def __init__(self) -> None:
        self._items: deque[tuple[float, str, bytes, dict[str, str] | None]] = deque()
        self._bytes = 0

    def keep(self, now: float, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        self._items.append((now, subject, data, headers))
        self._bytes += len(data)
        while self._items and (now - self._items[0][0] > REPLAY_WINDOW_S or self._bytes > REPLAY_MAX_BYTES):
            self._bytes -= len(self._items.popleft()[2])

    def since(self, t: float) -> list[tuple[str, bytes, dict[str, str] | None]]:
        return [(subject, data, headers) for at, subject, data, headers in self._items if at >= t]
