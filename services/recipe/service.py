"""The recipe service: API request -> prompt token ids -> the mesh; engine tokens -> API events.

    gateway --recipe.prepare--> prepare(): validate, render, encode, check limits,
                                subscribe tokens.<rid>, submit GenerateRequest to work.route.prefill, reply
    prefill/decode --tokens.<rid>--> on_tokens(): Flight (reorder, detokenize, stops, format)
                                --events.<rid>--> gateway;  --requests.cancel--> workers (stop string hit)
    anyone --requests.cancel--> on_cancel(): drop the request's state

Per-request state (a Flight and its token subscription) ends on finish, on cancel, after `ttl_s` without
a token event (the client then gets a 504 and the workers a Cancel), or when the bus stays down OUTAGE_GRACE_S
(a 503 and a Cancel; a shorter outage costs nothing: shared/bus.py replays the token streams). When the worker
holding a request is lost (the balancer's "lost" event) the request resumes from the tokens streamed so far, on
another worker, up to `max_migrations` times (flight.py: an exact continuation); the client's stream goes on
where it was. When a recipe dies, the gateway hands its requests to another (or to the restarted one) with what
the client has (PrepareRequest.resume): `_take_over` goes on from there the same way. A Responses request created with `store` is kept (responses_store.py) before its last event goes
out, so the client can continue from it at once.
Questions that generate nothing (tokenize, models, stored responses) are answered by `queries.Queries`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

import orjson

from services.recipe.admission import AdmissionLimits, Ledger, Refusal
from services.recipe.config import RecipeConfig
from services.recipe.convert import APIS, ConvertOptions, convert, structured
from services.recipe.convert.fields import check_logit_bias, check_min_tokens
from services.recipe.convert.limits import check_prompt, check_token_ids, resolve_max_tokens
from services.recipe.emit.processor import OutputProcessor
from services.recipe.errors import ApiError, ConversionError, api_error, error_for, openai_error
from services.recipe.fanout import KEEPALIVE_S, FanOuts
from services.recipe.flight import Flight, Output
from services.recipe.images.fetch import FetchPolicy, HttpFetcher
from services.recipe.images.limits import ImageQuota
from services.recipe.images.resolve import ImageError, resolve
from services.recipe.formats import render, render_deepseek
from services.recipe.formats.dsml import END_THINK
from services.recipe.model import ServedModel
from services.recipe.prepared import RESPONSE_ID_PREFIXES, InferenceSpec, PreparedRequest
from services.recipe.queries import Queries
from services.recipe.responses_store import ResponseStore, StoreIntent, annotate
from shared import subjects
from shared.bus import Bus, Envelope, Subscription
from shared.bus_state import OUTAGE_GRACE_S
from shared.json_depth import depth_message
from shared.presence import announce_forever
from shared.schemas.gateway import (
    ApiEvent, CountTokensReply, CountTokensRequest, PrepareReply, PrepareRequest, Resume,
)
from shared.schemas.generate import EVERY_WORKER, Cancel, Constraint, GenerateRequest, SamplingParams, TokenEvent
from shared.schemas.responses import StoredResponse

log = logging.getLogger(__name__)

BUS_LOST = "the mesh lost its message bus connection while the request was in flight; try again"

SEED_BITS = 63  # drawn seeds fit a signed int64 everywhere they travel


def _refuse(error: ApiError) -> PrepareReply:
    return PrepareReply(ok=False, status=error.status, error_body=error.body)


def _overloaded(api: str, refusal: Refusal) -> PrepareReply:
    """A 429 as each vendor sends one: OpenAI's code `rate_limit_exceeded` with the limit as its `type`,
    Anthropic's `rate_limit_error`; both SDKs read Retry-After (and retry 429s by default)."""
    error = error_for(api, 429, refusal.message, code="rate_limit_exceeded", kind=refusal.limit)
    return PrepareReply(ok=False, status=429, error_body=error.body, retry_after_s=refusal.retry_after_s)


class RecipeService:
    name = "recipe"
    outage_grace_s = OUTAGE_GRACE_S  # a bus down this long ends the requests in flight

    def __init__(
        self, model_specs: Sequence[str], *, ttl_s: float = RecipeConfig.request_ttl_s,
        stop_grace_s: float = RecipeConfig.stop_grace_s, response_ttl_s: float = RecipeConfig.response_ttl_s, served_names: Sequence[str] = (), max_model_len: int | None = None,
        trust_client_control_tokens: bool = False, admission: AdmissionLimits | None = None,
        max_migrations: int = 2, image_fetch: FetchPolicy | None = None,
    ) -> None:
        """`model_specs`: what `shared.models.resolve` accepts (packaged name, .gguf path, HF dir). Models load
        in `start`, off the event loop. `response_ttl_s`: how long a stored response is kept. `served_names` (one
        model only): the names clients call it by, the first also the name the workers serve it under;
        `max_model_len`: every model's context, capped. `trust_client_control_tokens`: chat templates read control
        tokens spelled in client text as control tokens (--allow-control-tokens-in-user-text; unsafe).
        `admission`: the bound on each model's requests in flight (admission.py); None = unbounded.
        `max_migrations`: how many times one request may resume after losing its worker (0 = never).
        `image_fetch`: which image URLs V4.1 requests may have fetched (None = none: data URLs only)."""
        if not model_specs:
            raise ValueError("the recipe needs at least one model")
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        self._max_migrations = max_migrations
        self._fetcher = HttpFetcher(image_fetch or FetchPolicy())
        self.migrations = 0  # continuations submitted since start
        self.forks = 0  # requests where a repeated position brought another token (Flight.forked_at)
        if served_names and len(model_specs) != 1:
            raise ValueError("served names name one model")
        self._specs = list(model_specs)
        self._served_names = list(served_names)
        self._max_model_len = max_model_len
        self._trust_client_control_tokens = trust_client_control_tokens
        self._ttl_s = ttl_s
        self._stop_grace_s = stop_grace_s
        self._response_ttl_s = response_ttl_s
        self._responses: ResponseStore | None = None
        self._query_subs: list[Subscription] = []
        self._models: dict[str, ServedModel] = {}
        self._options = ConvertOptions(models={})  # the served models' names and formats, once loaded
        self._flights: dict[str, Flight] = {}  # by mesh request id (a fan-out's candidates by theirs)
        self._fans = FanOuts(self)  # requests of several choices (fanout.py: their I/O too)
        self._ledger = Ledger(admission or AdmissionLimits())
        self._token_subs: dict[str, Subscription] = {}
        self._prepare_sub: Subscription | None = None
        self._count_sub: Subscription | None = None
        self._cancel_sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._presence: asyncio.Task[None] | None = None
        self._bus: Bus | None = None
        self._status = "not started"
        # this process, in its presence and in every PrepareReply: the gateway watches that the recipe which took
        # a request is still there, and hands the request to another one if it dies (PrepareRequest.resume)
        self.boot = secrets.token_hex(8)
        self.takeovers = 0  # requests taken over from a recipe that died

    # --- what the fan-outs use (fanout.Host) ------------------------------------------------------------------

    @property
    def bus(self) -> Bus:
        assert self._bus is not None, "started"
        return self._bus

    @property
    def max_migrations(self) -> int:
        return self._max_migrations

    async def track(self, flight: Flight, model: str, prompt_tokens: int) -> None:
        """A request's state: its flight, its admission place (left in _drop) and its token subscription."""
        rid = flight.request_id
        self._flights[rid] = flight
        self._ledger.enter(rid, model, prompt_tokens, time.monotonic())
        self._token_subs[rid] = await self.bus.subscribe(subjects.tokens(rid), TokenEvent, self._on_tokens)

    def drop(self, request_id: str) -> bool:
        return self._drop(request_id)

    async def emit(self, flight: Flight, out: Output) -> None:
        await self._emit(flight, out)

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        self._status = f"loading {', '.join(self._specs)}"
        name = self._served_names[0] if self._served_names else None
        models = await asyncio.gather(
            *(asyncio.to_thread(ServedModel.load, s, name=name, max_len=self._max_model_len,
                                trusts_client_text=self._trust_client_control_tokens) for s in self._specs)
        )
        self._models = {m.name: m for m in models} | {alias: models[0] for alias in self._served_names[1:]}
        self._options = ConvertOptions(models={alias: m.encoding for alias, m in self._models.items()})
        await bus.ensure_work_stream()  # submits must not fail while no balancer has created it yet
        bucket = await bus.key_value(subjects.RESPONSES_BUCKET, StoredResponse, ttl_s=self._response_ttl_s)
        self._responses = ResponseStore(bucket)
        self._cancel_sub = await bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel)
        bus.on_lost(self._on_bus_lost)
        self._prepare_sub = await bus.serve(
            subjects.RECIPE_PREPARE, PrepareRequest, self.prepare, queue=subjects.RECIPE_GROUP
        )
        self._count_sub = await bus.serve(
            subjects.RECIPE_COUNT_TOKENS, CountTokensRequest, self.count_tokens, queue=subjects.RECIPE_GROUP
        )
        self._query_subs = await Queries(self._models, self._options, self._responses).subscribe(bus)
        self._reaper = asyncio.create_task(self._reap())
        aliases = {alias: m.name for alias, m in self._models.items() if alias != m.name}
        self._presence = asyncio.create_task(
            announce_forever(bus, self.name, bus.name, list(self._models), aliases=aliases, boot=self.boot)
        )
        self._status = "ready"
        log.info("serving %s", ", ".join(f"{m.name} ({m.encoding}, context {m.context_length})" for m in models))

    async def stop(self) -> None:
        """Take no new requests, let those in flight finish for a grace period, then fail the rest."""
        self._status = "stopping"
        if self._presence is not None:  # the gateway stops counting on this recipe first
            self._presence.cancel()
        for sub in (self._prepare_sub, self._count_sub, *self._query_subs):
            if sub is not None:
                await _unsubscribe(sub)
        deadline = time.monotonic() + self._stop_grace_s
        while self._flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for flight in list(self._flights.values()):
            if self._flights.get(flight.request_id) is flight:  # (a failed candidate ends its siblings too)
                await self._emit(flight, flight.fail(503, "the service is restarting", "shutdown"))
        if self._reaper is not None:
            self._reaper.cancel()
        if self._cancel_sub is not None:
            await _unsubscribe(self._cancel_sub)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)

    def health(self) -> tuple[bool, str]:
        ready = self._status == "ready"
        return ready, f"{len(self._flights)} in flight" if ready else self._status

    # --- prepare: API request -> GenerateRequest -----------------------------------------------------------

    async def prepare(self, req: PrepareRequest) -> PrepareReply:
        if req.api not in APIS:
            return _refuse(openai_error(404, f"API {req.api!r} is not supported", code="unsupported_api"))
        if req.request_id in self._flights or req.request_id in self._fans:
            if req.resume is None:
                return _refuse(error_for(req.api, 409, f"request id {req.request_id} is already in flight"))
            # the gateway took this recipe for dead (silent, not gone): its copy goes, the takeover starts afresh
            self._drop(req.request_id)
            if (fan := self._fans.get(req.request_id)) is not None:
                await self._fans.cancel(fan, "recipe lost")
        body: bytes | dict = req.body
        intent: StoreIntent | None = None
        if req.api == "responses":
            try:
                body, intent = await self._expand(req)
            except ApiError as exc:
                return _refuse(exc)
        try:
            prepared = await asyncio.to_thread(convert, req.api, body, self._options)
            await self._images(prepared)
            prepared, model, prompt_ids, max_tokens = await asyncio.to_thread(self._encode, prepared)
        except ConversionError as exc:
            return _refuse(api_error(req.api, exc))
        except RecursionError:  # a walk the depth limit did not bound: still the client's nesting, not our bug
            log.warning("%s: prepare recursed too deeply", req.request_id)
            return _refuse(api_error(req.api, ConversionError(depth_message())))
        except Exception:  # a codec bug: the client still gets an answer in its API's format, not a timeout
            log.exception("%s: prepare failed", req.request_id)
            return _refuse(error_for(req.api, 500, "internal error while preparing the request"))
        # No await from this check to the ledger's enter in _launch: concurrent prepares cannot both take the
        # last place.
        if (refusal := self._ledger.check(model.name, len(prompt_ids))) is not None:
            log.info("%s refused (%s bound): %s", req.request_id, refusal.limit, refusal.message)
            return _overloaded(req.api, refusal)
        if intent is not None:
            prepared = annotate(prepared, intent)
        return await self._launch(req, prepared, model, prompt_ids, max_tokens)

    async def _expand(self, req: PrepareRequest) -> tuple[bytes | dict, StoreIntent | None]:
        """A Responses request's store settings, and its body with the stored conversation before its new input
        when it names a previous_response_id. Raises ApiError (400, 404, 503)."""
        assert self._responses is not None
        try:
            return await self._responses.expand(req.body, req.tenant)
        except ApiError:
            raise
        except Exception as exc:  # the KV bucket is unreachable: the request cannot be continued now
            log.warning("%s: response store unavailable: %s", req.request_id, exc)
            raise error_for(req.api, 503, "stored responses are not available right now, try again") from None

    async def _images(self, prepared: PreparedRequest) -> None:
        """A V4.1 request's images are resolved as the reference resolves them (a bad image, source or limit is
        its 400); then, while no served model can see images (no vision encoder yet), the request is refused
        with a 400 that says so. Raises ConversionError."""
        sources = [s for m in prepared.conversation.messages for s in m.images]
        if not sources:
            return
        try:
            await resolve(render_deepseek(prepared).images, ImageQuota(), self._fetcher)
        except ImageError as exc:
            raise ConversionError(exc.message, exc.status) from None
        raise ConversionError(
            f"image input is not supported: model {prepared.model} has no vision encoder serving it (the images "
            "were read; no worker can see them)", 400)

    def _prepare(self, api: str, body: bytes | dict) -> tuple[PreparedRequest, ServedModel, list[int], int]:
        """Convert, render, encode, size (a request without images: `prepare` puts image resolution between
        the conversion and the rest). Off the event loop."""
        return self._encode(convert(api, body, self._options))

    def _encode(self, prepared: PreparedRequest) -> tuple[PreparedRequest, ServedModel, list[int], int]:
        """Render, encode, size: everything the reference checks after conversion, in its order. Off the event
        loop."""
        model = self._models[prepared.model]  # the options name only served models
        if prepared.prompt_token_ids is not None:  # before render: decoding ids past 2^32 overflows the tokenizer
            check_token_ids(prepared.prompt_token_ids, model.vocab_size)
        _, prompt_ids = render(prepared, model)
        if prompt_ids is None:
            raise ConversionError(f"model {model.name} has no tokenizer for its prompt format", 400)
        check_prompt(prompt_ids)
        max_tokens = resolve_max_tokens(prepared, len(prompt_ids), model.context_length)
        check_min_tokens(prepared, max_tokens)
        check_logit_bias(prepared, model.vocab_size)
        structured.check(prepared)
        # (a FieldRefusal now rather than at launch)
        structured.wire(prepared, _end_think(model), model.tokenizer.token_id)
        return prepared, model, prompt_ids, max_tokens

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensReply:
        """/v1/messages/count_tokens: the prompt size of a Messages request (which needs no max_tokens here)."""
        try:
            body = orjson.loads(req.body)
            if isinstance(body, dict):
                body.setdefault("max_tokens", 1)
            prepared = await asyncio.to_thread(convert, req.api, body, self._options)
            await self._images(prepared)
            prepared, _, prompt_ids, _ = await asyncio.to_thread(self._encode, prepared)
        except orjson.JSONDecodeError as exc:
            return CountTokensReply(400, api_error(req.api, ConversionError(f"invalid JSON request: {exc}")).body)
        except ConversionError as exc:
            return CountTokensReply(exc.status, api_error(req.api, exc).body)
        except RecursionError:
            return CountTokensReply(400, api_error(req.api, ConversionError(depth_message())).body)
        except Exception:  # a codec bug: an answer all the same, never a gateway left waiting for its timeout
            log.exception("count_tokens failed")
            return CountTokensReply(500, error_for(req.api, 500, "internal error while counting the tokens").body)
        return CountTokensReply(200, orjson.dumps({"input_tokens": len(prompt_ids)}))

    async def _launch(
        self, req: PrepareRequest, prepared: PreparedRequest, model: ServedModel, prompt_ids: list[int],
        max_tokens: int,
    ) -> PrepareReply:
        assert self._bus is not None
        rid = req.request_id
        inference = prepared.inference
        resume = req.resume
        if resume is not None:
            seed, created = resume.seed, resume.created  # the lost recipe's: the same draws, the same response
        else:
            seed = inference.seed if inference.seed is not None else secrets.randbits(SEED_BITS)
            created = int(time.time())
        sampling = sampling_params(inference, max_tokens, seed, model.tokenizer.eos_ids,
                                   structured.wire(prepared, _end_think(model), model.tokenizer.token_id),
                                   _budget_end(prepared, model))
        # tenants never share cached prefixes; within one, only requests with the same cache_salt do
        salt = req.tenant if not prepared.cache_salt else f"{req.tenant}\x00{prepared.cache_salt}"
        if inference.best_of > 1:
            return await self._fans.launch(req, prepared, model, prompt_ids, sampling, salt, created,
                                           _response_id(req, prepared))
        processor = OutputProcessor(
            prepared, response_id=_response_id(req, prepared), created=created, tokens=model.tokens,
            count_tokens=model.count_tokens,
        )
        generate = GenerateRequest(rid, model.name, prompt_ids, sampling, cache_salt=salt, arrival=time.time())
        flight = Flight(rid, prepared, processor, time.monotonic(), generate, self._max_migrations,
                        epoch=resume.epoch if resume is not None else 0)
        await self.track(flight, model.name, len(prompt_ids))  # subscribed before submitting: the first token can
        # come back before this reply does
        try:
            if resume is not None:
                await self._take_over(flight, resume, len(prompt_ids))
            else:
                await self._bus.submit(subjects.ROUTE_PREFILL, generate, msg_id=rid)
        except Exception as exc:  # JetStream unavailable: nothing was queued, nothing to cancel
            log.warning("%s: submit failed: %s", rid, exc)
            self._drop(rid)
            return _refuse(error_for(prepared.api, 503, "the model is not available right now, try again"))
        if rid not in self._flights:  # cancelled while being submitted: the workers must drop it too
            await self._bus.publish(subjects.CANCEL, Cancel(rid, reason="cancelled"))
        log.info(
            "%s %s model=%s prompt=%d max_tokens=%d seed=%d temperature=%g top_p=%g top_k=%d min_p=%g "
            "repetition_penalty=%g min_tokens=%d ignore_eos=%s constraint=%s stream=%s",
            rid, prepared.api, model.name, len(prompt_ids), max_tokens, seed, sampling.temperature,
            sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty, sampling.min_tokens,
            sampling.ignore_eos, sampling.constraint.kind if sampling.constraint else "none", prepared.stream,
        )
        return PrepareReply(ok=True, stream=prepared.stream, prompt_tokens=len(prompt_ids), recipe=self.boot,
                            seed=seed, created=created)

    async def _take_over(self, flight: Flight, resume: Resume, prompt_tokens: int) -> None:
        """Go on with a request whose recipe died (the gateway noticed): its output side replays what the client
        has; every worker lets go of the runs the lost recipe started (nobody reads them: their tokens before
        this recipe subscribed are gone); the continuation goes on from the client's last token, as a migration
        past any of those runs (the lost recipe started at most max_migrations after the last it reported)."""
        assert self._bus is not None
        rid = flight.request_id
        assert flight.request is not None
        if len(resume.token_ids) >= flight.request.sampling.max_tokens:
            raise ValueError("nothing left to generate")  # its last event was lost with the recipe: a 503
        past = resume.migration + self._max_migrations
        flight.replay(list(resume.token_ids), prompt_tokens, resume.cached_tokens, past)
        self.takeovers += 1
        log.warning("%s: taken over from a recipe that died; resuming from %d tokens (recipe %d of the request)",
                    rid, len(resume.token_ids), resume.epoch + 1)
        continuation = flight.resume(time.time())  # first: the Cancel below must find this flight past it
        await self._bus.publish(subjects.CANCEL, Cancel(rid, "recipe lost", worker_id=EVERY_WORKER, migration=past))
        await self._bus.submit(subjects.ROUTE_PREFILL, continuation, msg_id=f"{rid}:m{continuation.migration}")

    # --- the output side -----------------------------------------------------------------------------------

    async def _on_tokens(self, ev: TokenEvent, _: Envelope) -> None:
        flight = self._flights.get(ev.request_id)
        if flight is None:
            return  # finished, cancelled or expired: late tokens are dropped
        forked = flight.forked_at
        try:
            out = flight.on_event(ev, time.monotonic())
        except Exception:  # a codec bug must still end the client's request
            log.exception("%s: formatting failed", ev.request_id)
            out = flight.fail(500, "internal error while formatting the response", "error")
        if forked is None and flight.forked_at is not None:
            self.forks += 1
            log.warning("%s: a repeat of output position %d (migration %d) differs from what was streamed: the "
                        "stream keeps the first; what follows comes from the other run", ev.request_id,
                        flight.forked_at, ev.migration)
        await self._fans.on_progress(flight)
        if out is not None and out.resume:
            await self._resume(flight)
        elif out is not None:
            await self._emit(flight, out)

    async def _resume(self, flight: Flight) -> None:
        """The request's worker was lost: submit its continuation (from every token streamed so far) to prefill.
        The lost worker was told to let go by the balancer; nothing else held the request."""
        assert self._bus is not None
        rid = flight.request_id
        continuation = flight.resume(time.time())
        self.migrations += 1
        log.warning("%s: its worker was lost; resuming from %d tokens (migration %d of at most %d)", rid,
                    continuation.output_offset, continuation.migration, self._max_migrations)
        try:
            await self._bus.submit(subjects.ROUTE_PREFILL, continuation, msg_id=f"{rid}:m{continuation.migration}")
        except Exception as exc:  # JetStream unavailable: nothing queued; end it as the loss would have
            log.warning("%s: submitting the continuation failed: %s", rid, exc)
            await self._emit(flight, flight.fail(503, "worker lost, and the request could not be resumed", "error"))
            return
        if rid not in self._flights:  # cancelled while being submitted: the workers must drop it too
            await self._bus.publish(subjects.CANCEL, Cancel(rid, reason="cancelled"))

    async def _emit(self, flight: Flight, out: Output) -> None:
        assert self._bus is not None
        rid = flight.request_id
        fan = self._fans.of_choice(rid)
        if fan is not None:
            await self._fans.emit(fan, flight, out)
            return
        if out.done:
            # A stored response is kept before the client sees its end (so it can continue from it at once), and
            # before _drop: the unsubscribe it schedules would cancel this handler at its first real wait.
            if out.status == 200 and flight.prepared.api == "responses" and self._responses is not None:
                await self._responses.keep(flight.prepared, flight.response())
            self._drop(rid)
        now = time.monotonic()
        # A non-streaming answer sends nothing until it is done: an empty event now and then tells the gateway
        # the request is alive, so a long generation is not mistaken for a silent one.
        if out.frames or out.done or now - flight.last_published > KEEPALIVE_S:
            flight.last_published = now
            event = ApiEvent(
                rid, flight.next_seq(), out.frames, out.done, out.status, out.body,
                output_tokens=flight.output_tokens, cached_tokens=flight.cached_tokens,
                finish_reason=flight.finish_reason if out.done and out.status == 200 else "",
                token_ids=flight.unpublished(), migration=flight.migration, epoch=flight.epoch,
            )
            await self._bus.publish(subjects.events(rid), event)
        if out.cancel:
            await self._bus.publish(subjects.CANCEL, Cancel(rid, reason=out.cancel))

    async def _on_cancel(self, cancel: Cancel, _: Envelope) -> None:
        if cancel.worker_id == EVERY_WORKER:
            # another recipe took the request over from this one (taken for dead while only silent): this copy
            # goes quietly; the one that took over is past the migration named and stays
            flight = self._flights.get(cancel.request_id)
            if flight is not None and flight.migration <= cancel.migration and self._drop(cancel.request_id):
                log.warning("%s: taken over by another recipe", cancel.request_id)
            return
        if cancel.worker_id:
            return  # one worker letting go of a request that moved on: the request itself goes on
        fan = self._fans.get(cancel.request_id)
        if fan is not None:  # the client went: every candidate goes (the workers know only their ids)
            await self._fans.cancel(fan, cancel.reason)
            log.info("%s cancelled: %s", cancel.request_id, cancel.reason)
            return
        if self._drop(cancel.request_id):
            log.info("%s cancelled: %s", cancel.request_id, cancel.reason)

    def _on_bus_lost(self) -> None:
        """A short outage costs the flights nothing (their tokens are replayed once the bus is back); one that
        lasts `outage_grace_s` ends those that were waiting, freeing their admission places rather than after
        ttl_s (their errors reach a gateway that still waits, their Cancels the workers, once reconnected)."""
        if self._flights:
            self._spawn(self._end_if_still_down(list(self._flights)))

    async def _end_if_still_down(self, rids: list[str]) -> None:
        await asyncio.sleep(self.outage_grace_s)
        if self._bus is not None and not self._bus.connected:
            self._end_flights(rids)

    def _end_flights(self, rids: list[str]) -> None:
        flights = [f for rid in rids if (f := self._flights.get(rid)) is not None]
        if flights:
            log.warning("ending %d requests in flight: the bus is still down", len(flights))
        for flight in flights:
            self._spawn(self._end_lost(flight))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _end_lost(self, flight: Flight) -> None:
        if self._flights.get(flight.request_id) is not flight:
            return  # it ended meanwhile
        try:
            await self._emit(flight, flight.fail(503, BUS_LOST, "bus lost"))
        except Exception as exc:  # the reconnect buffer is full or the connection closed: the state is gone anyway
            log.debug("%s: could not send its end: %r", flight.request_id, exc)

    def _drop(self, rid: str) -> bool:
        """End a request's state. Unsubscribing runs as its own task: it may be called from inside the token
        subscription's handler, and unsubscribing there would cancel the handler mid-way."""
        flight = self._flights.pop(rid, None)
        self._ledger.leave(rid, time.monotonic())
        sub = self._token_subs.pop(rid, None)
        if sub is not None:
            task = asyncio.create_task(_unsubscribe(sub))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return flight is not None

    async def _reap(self) -> None:
        interval = max(0.05, min(self._ttl_s / 4, 5.0))
        while True:
            await asyncio.sleep(interval)
            cutoff = time.monotonic() - self._ttl_s
            for flight in [f for f in self._flights.values() if f.last_seen < cutoff]:
                if self._flights.get(flight.request_id) is not flight:
                    continue  # a sibling's expiry ended it
                log.warning("%s: no tokens for %.0f s, expiring", flight.request_id, self._ttl_s)
                await self._emit(flight, flight.fail(504, "timed out waiting for the model", "timeout"))


def _response_id(req: PrepareRequest, prepared: PreparedRequest) -> str:
    """The id the client sees. With an X-Request-Id it derives from the client's id, as vLLM's do; a Responses
    id is a storage key (and OpenAI's are server-made), so it stays ours, unique."""
    own = req.client_request_id if req.client_request_id and prepared.api != "responses" else req.request_id
    return f"{RESPONSE_ID_PREFIXES[prepared.api]}{own}"


def _end_think(model: ServedModel) -> int | None:
    """The end-of-thinking token that opens a constrained answer in thinking mode (DeepSeek formats)."""
    return model.tokenizer.token_id(END_THINK) if model.encoding != "chat_template" else None


def _budget_end(prepared: PreparedRequest, model: ServedModel) -> int | None:
    """The token a reasoning budget forces: the format's end-of-thinking token, when the answer starts in the
    reasoning (None: no budget applies; chat templates refuse thinking mode, so only DeepSeek formats get here)."""
    thinking = prepared.parsing.thinking_initial_stage in ("reasoning_start", "reasoning_continuation")
    if prepared.inference.reasoning_budget is None or not thinking:
        return None
    return _end_think(model)


def sampling_params(inference: InferenceSpec, max_tokens: int, seed: int, eos_ids: Iterable[int],
                    constraint: Constraint | None = None, reasoning_end: int | None = None) -> SamplingParams:
    """What the engine samples with. The model's end-of-sentence ids stop it, unless the client set ignore_eos
    (then they are ordinary tokens and only max_tokens ends the answer). `reasoning_end`: the token that closes
    the reasoning, when the request's reasoning budget applies (a budget of max_tokens or more never acts)."""
    budget = inference.reasoning_budget
    if reasoning_end is None or budget is None or budget >= max_tokens:
        budget, reasoning_end = -1, -1
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if inference.temperature is None else inference.temperature,
        top_p=1.0 if inference.top_p is None else inference.top_p,
        top_k=inference.top_k or 0,
        min_p=inference.min_p,
        repetition_penalty=inference.repetition_penalty,
        min_tokens=inference.min_tokens,
        presence_penalty=inference.presence_penalty,
        frequency_penalty=inference.frequency_penalty,
        logit_bias=dict(inference.logit_bias),
        logprobs=(inference.top_logprobs or 0) if inference.logprobs else None,
        seed=seed,
        stop_token_ids=[] if inference.ignore_eos else sorted(eos_ids),
        ignore_eos=inference.ignore_eos,
        constraint=constraint,
        reasoning_budget=budget,
        reasoning_end=reasoning_end,
    )


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception as exc:  # already closed or the connection is draining: nothing left to remove
        log.debug("unsubscribe: %s", exc)
