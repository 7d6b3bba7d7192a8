"""The only module that talks to NATS. Services see publish / request / subscribe / serve / submit / work_queue.

Messages are schema dataclasses (encoded by `shared.codec`); every outgoing message carries the W3C trace
context of the span it was sent from, and the handler of a message that carries one runs inside a span whose
parent is that context, so one request is one trace across all the hops. A message sent outside any trace
(heartbeats, KV events, health polls, scrapes, snapshots) is handled in no span at all (`tracing.handling`).

Work queues are JetStream pull consumers on the `work.>` stream: a handler that returns acks the message, one
that raises `Retry` naks it with a delay (redelivered later), one that raises `Reject` or receives a payload that
fails its schema terminates it (it could never succeed). A running handler keeps its message alive with
`in_progress()` so long work is not redelivered under it; when that keeps failing (`KEEPALIVE_FAILURES` in a row)
the job is ended at once and naked, rather than run on while the server hands it to another worker.

A handler of `serve()` that raises, or a request that fails its schema, gets an error reply at once: an empty
body with the `Bus-Error` header (happy-path replies are unchanged bytes), which `request()` raises as `BusError`.
Services hold `Subscription` (this module's handle), never a nats object.

Key-value buckets (JetStream KV) hold small typed records shared by every instance of a service and kept across
restarts, each for the bucket's TTL: `key_value(bucket, Type, ttl_s=...)` gives a `KeyValueBucket[Type]`.

The connection outlives its server: a lost server is retried forever with a growing, capped, jittered delay
(`bus_state.reconnect_delay`), over every server of a comma-separated URL list (a NATS cluster). Each change of state is
one log line (lost, reconnected), never a traceback per attempt. On reconnect nats-py replays every core
subscription; a work queue whose durable consumer is gone (a server that lost its store) binds a new one.

Core NATS keeps nothing for an absent subscriber, so what was published around an outage (held by the dying
server, or sent before the receiver had subscribed again) is lost. The bus keeps what it published on the
request streams (`subjects.REPLAYED`: tokens, events, cancels) for a while (bus_state.py) and, after a reconnect,
publishes again everything from REPLAY_MARGIN_S before the loss on, twice (REPLAY_AFTER_S: once every peer has
had time to reconnect): receivers drop what they already have, so a stream resumes where the outage cut it.
A service waiting on a stream ends it with an error only when the bus stays down OUTAGE_GRACE_S, or when the
stream stays silent RESUME_S after the reconnect (its messages were lost all the same).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js.api import ConsumerConfig, KeyValueConfig, RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind

from shared import codec, subjects, tracing
from shared.bus_state import (
    BUS_DOWN_ERRORS,
    REPLAY_AFTER_S,
    REPLAY_FLUSH_EVERY,
    REPLAY_MARGIN_S,
    RECONNECT_MAX_S,
    ConnectionState,
    RecentStreams,
    describe,
    next_server,
    stream_replicas,
)
from shared.nats_urls import server_urls

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

MSG_ID_HEADER = "Nats-Msg-Id"
KV_KEY = re.compile(r"[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*")  # JetStream KV's key syntax (dots separate tokens)
MAX_KEY_LENGTH = 256
ERROR_HEADER = "Bus-Error"  # on a reply: the responder failed on the request; the value says why
KEEPALIVE_FAILURES = 3  # in_progress() failing this many times in a row ends the job (nak) before ack_wait does
STREAM_NAME_IN_USE = 10058  # JetStream's error code when add_stream loses a creation race
CONSUMER_NOT_FOUND = 10014  # JetStream's error code for a consumer the server does not know (any more)
class Retry(Exception):
    """Transient failure: redeliver the work message after `delay` seconds."""

    def __init__(self, reason: str, delay: float = 1.0) -> None:
        super().__init__(reason)
        self.delay = delay


class Reject(Exception):
    """The work message can never succeed: terminate it."""


class BusTimeout(TimeoutError):
    """A request got no reply in time (no responder, or a responder too slow)."""


class BusError(BusTimeout):
    """The responder failed on the request and said so at once (its message is the reason).

    A BusTimeout too: before error replies existed a failing responder made the caller time out, so every caller
    already treats "no answer from that responder" alike; catch BusError first to tell the two apart."""


class Subscription:
    """A service's handle on one subscription: all it may do is end it."""

    def __init__(self, sub: NatsSubscription) -> None:
        self._sub = sub

    async def unsubscribe(self) -> None:
        await self._sub.unsubscribe()


async def _nothing_to_settle() -> None:
    return None


@dataclass(frozen=True)
class Envelope:
    """Delivery metadata a handler may need besides the decoded message. `handed_on`, for a work queue's job:
    acknowledge it now, before the handler returns, because the job lives on elsewhere (prefill handed the
    request to decode): a death after this must not have the server redeliver it to run again, and a failure
    after it is logged, not redelivered. A no-op for other messages, and after the first call."""

    subject: str
    trace: tracing.Context
    handed_on: Callable[[], Awaitable[None]] = _nothing_to_settle


class Bus:
    def __init__(self, nc: NatsClient, name: str, connection: ConnectionState | None = None, url: str = "") -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._name = name
        self._url = url
        self._connection = connection or ConnectionState(name)
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent = RecentStreams()
        self._replays: set[asyncio.Future[None]] = set()  # not waited for by drain(): a closing bus replays nothing
        self._connection.back_listeners.append(self._replay_soon)

    @classmethod
    async def connect(cls, url: str, name: str, *, connect_timeout: float = 5.0) -> Bus:
        """`url`: one server or a comma-separated list (`server_urls`). Waits until a server answers (a service
        started before its server waits for it); the connection is then kept forever."""
        connection = ConnectionState(name)
        nc = await nats.connect(
            servers=server_urls(url),
            name=name,
            connect_timeout=connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_MAX_S,  # between first-connection attempts (reconnects: next_server)
            reconnect_to_server_handler=next_server,
            disconnected_cb=connection.disconnected,
            reconnected_cb=connection.reconnected,
            error_cb=connection.error,
        )
        connection.established()
        return cls(nc, name, connection, url)

    async def sibling(self, role: str) -> Bus:
        """A second connection to the same servers, for traffic that must not queue with this one's: bulk KV bytes
        on their own socket, so heartbeats, tokens and work acks never wait behind megabytes in one write buffer
        (each NATS connection also has its own pending limit at the server). The caller drains it."""
        url = self._url
        if not url:  # a bus built around a test's own client
            connected = self._nc.connected_url
            assert connected is not None, "sibling of a bus that is not connected"
            url = connected.geturl()
        return await Bus.connect(url, f"{self._name}-{role}")

    @property
    def name(self) -> str:
        """The connection's name: the service instance (e.g. "recipe-0")."""
        return self._name

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    @property
    def replicas(self) -> int:
        """`stream_replicas` of the servers this connection knows: those given and those the cluster announced."""
        return stream_replicas(len({uri.netloc for uri in self._nc.servers}))

    @property
    def losses(self) -> int:
        """How many times the connection was lost so far."""
        return self._connection.losses

    def down_for(self) -> float:
        """Seconds the connection has been down (0 while it is up)."""
        lost_at = self._connection.lost_at
        return time.monotonic() - lost_at if lost_at is not None else 0.0

    @property
    def back_at(self) -> float:
        """Monotonic time of the last reconnect (0 if it never was lost)."""
        return self._connection.back_at

    def on_lost(self, listener: Callable[[], None]) -> None:
        """Call `listener` (synchronous, quick) each time the connection is lost, before any reconnect: whatever
        waits on messages that may now never come should end now rather than time out."""
        self._connection.lost_listeners.append(listener)

    @property
    def max_payload(self) -> int:
        return self._nc.max_payload

    # --- core NATS ---------------------------------------------------------------------------------------------

    async def publish(self, subject: str, message: Any, *, trace: tracing.Context | None = None) -> None:
        data, headers = codec.encode(message), tracing.inject(trace) or None
        if subject.startswith(subjects.REPLAYED):
            self._recent.keep(time.monotonic(), subject, data, headers)
        await self._nc.publish(subject, data, headers=headers)

    def _replay_soon(self) -> None:
        task = asyncio.ensure_future(self._replay(self._connection.last_lost_at - REPLAY_MARGIN_S))
        self._replays.add(task)
        task.add_done_callback(self._replays.discard)

    async def _replay(self, since: float) -> None:
        """Publish again what went out on the request streams since `since`, once peers are back (twice: a peer
        whose reconnect took longer gets the second)."""
        waited = 0.0
        for after in REPLAY_AFTER_S:
            await asyncio.sleep(after - waited)
            waited = after
            if not self.connected:
                return  # lost again: the next reconnect replays
            again = self._recent.since(since)
            for n, (subject, data, headers) in enumerate(again, 1):
                try:
                    await self._nc.publish(subject, data, headers=headers)
                    if n % REPLAY_FLUSH_EVERY == 0:  # stay under the client's pending-bytes limit
                        await self._nc.flush()
                except Exception as exc:  # lost again, or closing: the next reconnect replays
                    log.debug("replay stopped: %r", exc)
                    return
            if again:
                log.info("replayed %d stream messages sent since the bus outage began", len(again))

    async def request(
        self, subject: str, message: Any, reply_type: type[R], *, timeout: float = 5.0
    ) -> R:
        try:
            msg = await self._nc.request(
                subject, codec.encode(message), timeout=timeout, headers=tracing.inject() or None
            )
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise BusTimeout(f"{subject}: {type(exc).__name__}") from None
        if msg.headers and ERROR_HEADER in msg.headers:
            raise BusError(f"{subject}: {msg.headers[ERROR_HEADER]}")
        return codec.decode(reply_type, msg.data)

    async def subscribe(
        self,
        subject: str,
        message_type: type[T],
        handler: Callable[[T, Envelope], Awaitable[None]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Core subscription: the handler runs for each message, in order (in a consumer span if it is traced)."""

        async def on_msg(msg: Msg) -> None:
            try:
                message = codec.decode(message_type, msg.data)
            except codec.SchemaError as exc:
                log.warning("dropping bad message on %s: %s", msg.subject, exc)
                return
            with tracing.handling(f"{self._name} {subject}", msg.headers, SpanKind.CONSUMER):
                losses = self.losses
                try:
                    await handler(message, Envelope(msg.subject, tracing.current()))
                except Exception as exc:
                    self.handler_failed(f"handler for {msg.subject} failed", exc, losses)

        return Subscription(await self._nc.subscribe(subject, queue=queue, cb=on_msg))

    async def serve(
        self,
        subject: str,
        request_type: type[T],
        handler: Callable[[T], Awaitable[Any]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Request/reply: the handler's return value is the reply. Each request runs as its own task. A request that
        fails its schema, or a handler that raises, is answered at once with an error reply (`BusError` there)."""

        async def respond(msg: Msg) -> None:
            with tracing.handling(f"{self._name} {subject}", msg.headers, SpanKind.SERVER):
                try:
                    message = codec.decode(request_type, msg.data)
                except codec.SchemaError as exc:  # a bad internal request is a bug, not user input: say so
                    log.warning("bad request on %s: %s", msg.subject, exc)
                    await self._reply_error(msg, f"bad request: {exc}")
                    return
                losses = self.losses
                try:
                    reply = await handler(message)
                except Exception as exc:
                    self.handler_failed(f"handler for {msg.subject} failed", exc, losses)
                    await self._reply_error(msg, f"{type(exc).__name__}: {exc}")
                    return
                if msg.reply:
                    await msg.respond(codec.encode(reply))

        async def on_msg(msg: Msg) -> None:
            self.spawn(respond(msg))

        return Subscription(await self._nc.subscribe(subject, queue=queue, cb=on_msg))

    def handler_failed(self, what: str, exc: Exception, losses_before: int) -> None:
        """Log a handler's failure: with its traceback (a bug to look at), unless it failed because the bus went
        down under it (the outage is already said once; a traceback per request would bury it)."""
        if isinstance(exc, BUS_DOWN_ERRORS) or self.losses != losses_before or not self.connected:
            log.warning("%s while the bus was down: %s", what, describe(exc))
        else:
            log.exception(what)

    async def _reply_error(self, msg: Msg, reason: str) -> None:
        if not msg.reply:
            return
        # a header value is one line: keep the reason's first line, bounded
        first_line = reason.splitlines()[0] if reason else "error"
        await self._nc.publish(msg.reply, b"", headers={ERROR_HEADER: first_line[:512]})

    # --- JetStream work queues ---------------------------------------------------------------------------------

    async def ensure_work_stream(self) -> None:
        config = StreamConfig(
            name=subjects.WORK_STREAM,
            subjects=[subjects.WORK_SUBJECTS],
            retention=RetentionPolicy.WORK_QUEUE,
            duplicate_window=120.0,
            num_replicas=self.replicas,
        )
        try:
            await self._js.stream_info(subjects.WORK_STREAM)
        except NotFoundError:
            try:
                await self._js.add_stream(config)
            except BadRequestError as exc:
                if exc.err_code != STREAM_NAME_IN_USE:
                    raise
                await self._js.stream_info(subjects.WORK_STREAM)  # lost a creation race with another service

    async def submit(self, subject: str, message: Any, *, msg_id: str) -> None:
        """Durably enqueue work; a resend with the same `msg_id` inside the dedup window is dropped."""
        headers = tracing.inject()
        headers[MSG_ID_HEADER] = msg_id
        await self._js.publish(subject, codec.encode(message), headers=headers)

    async def work_queue(
        self,
        subject: str,
        durable: str,
        message_type: type[T],
        handler: Callable[[T, Envelope], Awaitable[None]],
        *,
        concurrency: int = 1,
        ack_wait: float = 30.0,
        max_deliver: int = 5,
    ) -> WorkQueue:
        await self.ensure_work_stream()
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=subject,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
            max_ack_pending=max(concurrency * 2, 16),
        )

        async def bind() -> Any:
            return await self._js.pull_subscribe(subject, durable=durable, config=config)

        queue = WorkQueue(self, await bind(), message_type, handler, concurrency, ack_wait, rebind=bind,
                          consumer=(subjects.WORK_STREAM, durable))
        queue.task = asyncio.create_task(queue.run())
        return queue

    async def delete_consumer(self, durable: str) -> None:
        try:
            await self._js.delete_consumer(subjects.WORK_STREAM, durable)
        except NotFoundError:
            pass

    # --- JetStream key-value buckets ----------------------------------------------------------------------------

    async def key_value(self, bucket: str, value_type: type[T], *, ttl_s: float) -> KeyValueBucket[T]:
        """The bucket, created if missing; an existing one gets `ttl_s` (the newest setting wins, so a service
        restarted with another TTL applies it). Every entry expires `ttl_s` after its last write."""
        try:
            kv = await self._js.create_key_value(
                KeyValueConfig(bucket=bucket, ttl=ttl_s, history=1, replicas=self.replicas))
        except BadRequestError:  # it exists with another configuration: keep its entries, change its max age
            stream = f"KV_{bucket}"
            info = await self._js.stream_info(stream)
            if info.config.max_age != ttl_s:
                await self._js.update_stream(info.config.evolve(max_age=ttl_s))
            kv = await self._js.key_value(bucket)
        return KeyValueBucket(kv, value_type)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run `coro` as a task that drain() waits for."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Stop taking messages, let handlers in flight finish, flush, close."""
        if self._connection.closing:
            return
        self._connection.closing = True
        for replay in list(self._replays):
            replay.cancel()
        try:
            await self._nc.drain()
        except Exception as exc:  # already closed or disconnected: nothing left to drain
            log.debug("drain: %s", exc)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)


class WorkQueue:
    """A pull loop over one durable consumer, running up to `concurrency` handlers at once."""

    def __init__(
        self,
        bus: Bus,
        psub: Any,
        message_type: type[Any],
        handler: Callable[[Any, Envelope], Awaitable[None]],
        concurrency: int,
        ack_wait: float,
        rebind: Callable[[], Awaitable[Any]] | None = None,
        consumer: tuple[str, str] | None = None,
    ) -> None:
        self._bus = bus
        self._psub = psub
        self._rebind = rebind  # a new pull subscription on a consumer made again (the server lost the old one)
        self._consumer = consumer  # (stream, durable) of that consumer
        self._losses = bus.losses  # connection losses seen: after each, check the consumer is still there
        self._failing = ""  # the fetch failure being reported (logged once until fetches work again)
        self._type = message_type
        self._handler = handler
        self._slots = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._running = 0  # handlers holding a slot (the semaphore's own count is private)
        self._ack_wait = ack_wait
        self._stopped = False
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while not self._stopped:
            free = self._concurrency - self._running  # fetch no more than we can start now
            if free == 0:
                await self._slots.acquire()
                self._slots.release()
                continue
            if not self._bus.connected:  # reconnecting: a fetch now would only time out, or fail, again and again
                await asyncio.sleep(0.1)
                continue
            if self._losses != self._bus.losses:
                if not await self._check_consumer():
                    await asyncio.sleep(0.2)
                    continue
                self._losses = self._bus.losses
            try:
                msgs = await self._psub.fetch(batch=free, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                self._recovered()
                continue  # nothing to do (a busy process may see the plain asyncio timeout instead)
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                return
            except Exception as exc:
                if self._stopped:
                    return
                await self._fetch_failed(exc)
                continue
            self._recovered()
            for msg in msgs:
                await self._slots.acquire()
                self._running += 1
                self._bus.spawn(self._handle(msg))

    async def _fetch_failed(self, exc: Exception) -> None:
        """A fetch that failed with the connection up: JetStream not ready yet (a server just restarted), or the
        consumer gone (a server restarted without its store, or someone deleted it), which `_check_consumer`
        tells apart."""
        what = f"{type(exc).__name__}: {exc}"
        if what != self._failing:
            log.warning("fetch failed: %s", what)
            self._failing = what
        if not await self._check_consumer():
            await asyncio.sleep(0.5)

    async def _check_consumer(self) -> bool:
        """After a reconnect or a failed fetch: bind a new consumer if the server no longer has ours. True once
        the consumer is known to be there (or bound again), False if JetStream cannot tell yet."""
        if self._consumer is None or self._rebind is None:
            return True
        stream, durable = self._consumer
        try:
            await self._bus._js.consumer_info(stream, durable)
            return True
        except NotFoundError:  # the stream or the consumer
            pass
        except Exception as exc:  # JetStream not answering yet
            log.debug("consumer_info: %r", exc)
            return False
        try:
            await self._bus.ensure_work_stream()
            old, self._psub = self._psub, await self._rebind()
        except Exception as exc:
            log.debug("rebind failed: %r", exc)
            return False
        log.warning("bound the work queue to a new consumer %s", durable)
        try:
            await old.unsubscribe()
        except Exception as exc:
            log.debug("unsubscribe: %s", exc)
        return True

    def _recovered(self) -> None:
        if self._failing:
            log.warning("fetch works again")
            self._failing = ""

    async def _handle(self, msg: Msg) -> None:
        work = asyncio.ensure_future(self._process(msg))
        keepalive = asyncio.create_task(self._keepalive(msg))
        try:
            await asyncio.wait({work, keepalive}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the keepalive gave up: the server will soon hand the message to another worker
                log.error("ending work on %s: keepalive failed %d times; naking it", msg.subject, KEEPALIVE_FAILURES)
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                try:
                    await msg.nak()
                except Exception as exc:  # the connection is gone: the server redelivers after ack_wait anyway
                    log.warning("could not nak %s: %r", msg.subject, exc)
        finally:
            keepalive.cancel()
            work.cancel()  # (a no-op once it finished; stops it when we are cancelled ourselves)
            self._running -= 1
            self._slots.release()

    async def _process(self, msg: Msg) -> None:
        settled = False

        async def handed_on() -> None:
            nonlocal settled
            if not settled:
                settled = True
                await msg.ack()

        try:
            with tracing.handling(f"{self._bus.name} {msg.subject}", msg.headers, SpanKind.CONSUMER):
                losses = self._bus.losses
                try:
                    message = codec.decode(self._type, msg.data)
                    await self._handler(message, Envelope(msg.subject, tracing.current(), handed_on))
                except (codec.SchemaError, Reject) as exc:
                    log.warning("terminating work message on %s: %s", msg.subject, exc)
                    if not settled:
                        await msg.term()
                except Retry as exc:
                    if settled:  # a handler bug: nothing is left here to try again
                        log.error("work handler on %s asked to retry after handing the job on: %s", msg.subject, exc)
                        return
                    log.info("retrying work message on %s in %.1fs: %s", msg.subject, exc.delay, exc)
                    await msg.nak(delay=exc.delay)
                except Exception as exc:
                    if settled:  # the job lives on elsewhere: what failed here was its aftermath (e.g. a store)
                        self._bus.handler_failed(f"work handler on {msg.subject} failed after handing on", exc,
                                                 losses)
                    else:
                        self._bus.handler_failed(f"work handler on {msg.subject} failed (redelivering)", exc,
                                                 losses)
                        await msg.nak(delay=1.0)
                else:
                    if not settled:
                        await msg.ack()
        except Exception as exc:  # ack/nak on a closed connection: the message will be redelivered
            log.debug("could not settle work message: %s", exc)

    async def _keepalive(self, msg: Msg) -> None:
        """Tell the server the job is alive every ack_wait / 3; return once KEEPALIVE_FAILURES beats in a row failed
        (the server cannot hear us, so it will redeliver the message while we still run it)."""
        failures = 0
        while failures < KEEPALIVE_FAILURES:
            await asyncio.sleep(self._ack_wait / 3)
            try:
                await msg.in_progress()
                failures = 0
            except Exception as exc:
                failures += 1
                log.warning("keepalive %d/%d for %s failed: %r", failures, KEEPALIVE_FAILURES, msg.subject, exc)

    async def stop(self) -> None:
        self._stopped = True
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        # fetch() leaves expired pull-request statuses unprocessed, which would make drain() wait out its whole
        # timeout on an idle queue: unsubscribe first so drain has nothing of ours to wait for.
        try:
            await self._psub.unsubscribe()
        except Exception as exc:
            log.debug("unsubscribe: %s", exc)


class KeyValueBucket(Generic[T]):
    """One JetStream KV bucket of `T` records. Keys must be KV keys (letters, digits, `-_=/.`); callers check
    keys that come from clients with `valid_key` first."""

    def __init__(self, kv: KeyValue, value_type: type[T]) -> None:
        self._kv = kv
        self._type = value_type

    @staticmethod
    def valid_key(key: str) -> bool:
        return len(key) <= MAX_KEY_LENGTH and KV_KEY.fullmatch(key) is not None

    async def get(self, key: str) -> T | None:
        """The record, or None if there is none (never written, deleted, expired, or not decodable)."""
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:  # KeyDeletedError is one too
            return None
        if entry.value is None:
            return None
        try:
            return codec.decode(self._type, entry.value)
        except codec.SchemaError as exc:  # written by an incompatible version: as good as absent
            log.warning("dropping unreadable %s record %s: %s", self._type.__name__, key, exc)
            return None

    async def ttl_s(self) -> float | None:
        """The bucket's current time to live (the newest `key_value` setting), None if entries never expire."""
        return (await self._kv.status()).ttl

    async def put(self, key: str, value: T) -> None:
        await self._kv.put(key, codec.encode(value))

    async def delete(self, key: str) -> None:
        await self._kv.delete(key)
