"""The recipe service on a real nats-server. The test plays the gateway (prepare, events.<rid>) and the engine
(takes the GenerateRequest from the work queue, publishes TokenEvents out of order on tokens.<rid>)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from services.recipe.service import RecipeService
from shared import subjects
from shared.bus import Bus, Envelope
from shared.models import resolve
from shared.schemas.gateway import ApiEvent, PrepareReply, PrepareRequest, Resume
from shared.schemas.generate import EVERY_WORKER, Cancel, GenerateRequest, TokenEvent, TokenLogprob
from shared.tokenizer import Tokenizer, load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
EOS = 2


@dataclass
class Mesh:
    """The recipe under test plus the test's own connection, playing the gateway and the engine."""

    recipe: RecipeService
    bus: Bus
    tokenizer: Tokenizer
    work: asyncio.Queue[GenerateRequest] = field(default_factory=asyncio.Queue)
    cancels: asyncio.Queue[Cancel] = field(default_factory=asyncio.Queue)

    async def prepare(self, api: str, body: dict[str, Any], *, tenant: str = "") -> tuple[str, PrepareReply,
                                                                                           asyncio.Queue[ApiEvent]]:
        rid = uuid.uuid4().hex
        events: asyncio.Queue[ApiEvent] = asyncio.Queue()

        async def on_event(ev: ApiEvent, _: Envelope) -> None:
            await events.put(ev)

        await self.bus.subscribe(subjects.events(rid), ApiEvent, on_event)  # as the gateway: before prepare
        req = PrepareRequest(rid, api, orjson.dumps(body), tenant)
        reply = await self.bus.request(subjects.RECIPE_PREPARE, req, PrepareReply, timeout=5.0)
        return rid, reply, events

    async def tokens(self, rid: str, *events: TokenEvent) -> None:
        for ev in events:
            await self.bus.publish(subjects.tokens(rid), ev)

    async def until_done(self, events: asyncio.Queue[ApiEvent]) -> list[ApiEvent]:
        out: list[ApiEvent] = []
        while not out or not out[-1].done:
            out.append(await asyncio.wait_for(events.get(), 5.0))
        return out


@pytest.fixture
async def mesh(nats_url: str) -> AsyncIterator[Mesh]:
    recipe_bus = await Bus.connect(nats_url, "recipe-test")
    test_bus = await Bus.connect(nats_url, "mesh-test")
    recipe = RecipeService([MODEL], ttl_s=0.5, stop_grace_s=0.0)
    await recipe.start(recipe_bus)
    m = Mesh(recipe, test_bus, load_tokenizer(resolve(MODEL)))

    async def on_work(req: GenerateRequest, _: Envelope) -> None:
        await m.work.put(req)

    async def on_cancel(c: Cancel, _: Envelope) -> None:
        await m.cancels.put(c)

    # A core subscription sees every message JetStream stores on the subject: the test reads the submitted
    # GenerateRequests without a consumer (each test gets only its own; the stream just keeps them).
    await test_bus.subscribe(subjects.ROUTE_PREFILL, GenerateRequest, on_work)
    await test_bus.subscribe(subjects.CANCEL, Cancel, on_cancel)
    try:
        yield m
    finally:
        await recipe.stop()
        await recipe_bus.drain()
        await test_bus.drain()


def _split(ids: list[int], sizes: list[int], finish: str, prompt: int, cached: int = 0) -> list[TokenEvent]:
    """Consecutive TokenEvents over `ids`: the first has the prompt counts, the last the finish reason."""
    events, pos = [], 0
    for i, n in enumerate(sizes):
        last = i == len(sizes) - 1
        events.append(TokenEvent("", pos, ids[pos : pos + n], finish if last else None,
                                 prompt if pos == 0 else 0, cached if pos == 0 else 0))
        pos += n
    assert pos == len(ids)
    return events


def _with_rid(rid: str, events: list[TokenEvent]) -> list[TokenEvent]:
    return [TokenEvent(rid, e.index, e.token_ids, e.finish_reason, e.prompt_tokens, e.cached_tokens) for e in events]


async def test_openai_stream_out_of_order_with_usage(mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "stream": True, "stream_options": {"include_usage": True}}
    rid, reply, events = await mesh.prepare("chat", body, tenant="acme")
    assert reply.ok and reply.stream

    work = await asyncio.wait_for(mesh.work.get(), 5.0)
    expected_prompt = mesh.tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert work.request_id == rid and work.model == MODEL and work.cache_salt == "acme"
    assert work.prompt_ids == expected_prompt and reply.prompt_tokens == len(expected_prompt)
    assert work.sampling.max_tokens == 8192 - len(expected_prompt)  # unset: the rest of the context
    assert work.sampling.seed is not None and EOS in work.sampling.stop_token_ids

    ids = mesh.tokenizer.encode("The capital of France is Paris. 🇫🇷") + [EOS]
    parts = _with_rid(rid, _split(ids, [1, 4, 3, len(ids) - 8], "stop", len(expected_prompt), cached=16))
    await mesh.tokens(rid, parts[2], parts[3], parts[1])  # decode's tokens overtake prefill's first one
    await asyncio.sleep(0.1)
    assert events.empty()
    await mesh.tokens(rid, parts[0])
    got = await mesh.until_done(events)

    assert [e.seq for e in got] == list(range(len(got)))
    frames = [f for e in got for f in e.frames]
    assert frames[-1] == b"data: [DONE]\n\n"
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "The capital of France is Paris. 🇫🇷"
    # DeepSeek's way (the reference's): the last chunk carries both the finish reason and the usage.
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == len(expected_prompt) and usage["completion_tokens"] == len(ids)
    assert usage["total_tokens"] == len(expected_prompt) + len(ids)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16} and usage["prompt_cache_hit_tokens"] == 16
    assert mesh.cancels.empty()  # the engine finished by itself: nothing to cancel
    assert mesh.recipe.health() == (True, "0 in flight")


async def test_anthropic_stop_sequence_cancels_the_workers(mesh: Mesh) -> None:
    body = {"model": MODEL, "max_tokens": 64, "stop_sequences": ["STOP"], "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}]}
    rid, reply, events = await mesh.prepare("messages", body)
    assert reply.ok and not reply.stream
    work = await asyncio.wait_for(mesh.work.get(), 5.0)
    assert work.sampling.max_tokens == 64 and work.sampling.temperature == 1.0

    ids = mesh.tokenizer.encode("Hello there! STOP and then more text")
    await mesh.tokens(rid, *_with_rid(rid, _split(ids, [1] * len(ids), "length", reply.prompt_tokens))[::-1])
    (final,) = await mesh.until_done(events)
    message = orjson.loads(final.body)
    assert message["content"] == [{"type": "text", "text": "Hello there! "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "STOP")
    assert message["usage"]["input_tokens"] == reply.prompt_tokens
    assert await asyncio.wait_for(mesh.cancels.get(), 5.0) == Cancel(rid, reason="stop")


@pytest.mark.parametrize(
    ("api", "body", "status", "error_type"),
    [
        # deepseek-recipe's answer to an unknown model: 400, naming the served ones
        ("chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
        ("messages", {"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 400,
         "invalid_request_error"),
        ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}, 400,
         "invalid_request_error"),
        ("messages", {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400,
         "invalid_request_error"),
        ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17}, 400,
         "invalid_request_error"),
    ],
)
async def test_refusals_come_back_in_the_apis_format(
    mesh: Mesh, api: str, body: dict[str, Any], status: int, error_type: str
) -> None:
    _, reply, _ = await mesh.prepare(api, body)
    assert not reply.ok and reply.status == status
    error = orjson.loads(reply.error_body)
    assert (error["error"]["type"] if api == "chat" else error["error"]["type"]) == error_type
    assert mesh.work.empty()


async def test_gateway_cancel_drops_the_request(mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    rid, reply, events = await mesh.prepare("chat", body)
    assert reply.ok and mesh.recipe.health() == (True, "1 in flight")
    await mesh.bus.publish(subjects.CANCEL, Cancel(rid, reason="re-routed", worker_id="prefill-0"))  # one worker's
    await asyncio.sleep(0.1)
    assert mesh.recipe.health() == (True, "1 in flight")
    await mesh.bus.publish(subjects.CANCEL, Cancel(rid, reason="client disconnected"))
    await asyncio.sleep(0.1)
    assert mesh.recipe.health() == (True, "0 in flight")
    await mesh.tokens(rid, TokenEvent(rid, 0, mesh.tokenizer.encode("late"), "stop", prompt_tokens=5))
    await asyncio.sleep(0.1)
    assert events.empty()


async def test_mesh_error_and_ttl_expiry(mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    rid, _, events = await mesh.prepare("chat", body)
    await mesh.tokens(rid, TokenEvent(rid, 0, [], "error", error="no prefill worker", error_status=503))
    (failed,) = await mesh.until_done(events)
    assert failed.status == 503 and orjson.loads(failed.body)["error"]["message"] == "no prefill worker"
    # over for the client, so over everywhere: a worker still holding it (or getting it again) lets go
    assert await asyncio.wait_for(mesh.cancels.get(), 5.0) == Cancel(rid, reason="error")

    rid, _, events = await mesh.prepare("messages", {**body, "max_tokens": 8, "stream": True})
    (expired,) = await mesh.until_done(events)  # ttl_s=0.5 and no tokens ever come
    assert expired.status == 504 and expired.frames[0].startswith(b"event: error\n")
    assert orjson.loads(expired.body)["error"]["type"] == "timeout_error"
    assert await asyncio.wait_for(mesh.cancels.get(), 5.0) == Cancel(rid, reason="timeout")
    assert mesh.recipe.health() == (True, "0 in flight")


async def test_non_streaming_request_sends_keepalives(mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long non-streaming generation is not mistaken by the gateway for a silent one."""
    import services.recipe.service as recipe_service

    monkeypatch.setattr(recipe_service, "KEEPALIVE_S", 0.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 50}
    rid, reply, events = await mesh.prepare("chat", body)
    assert reply.ok and not reply.stream
    ids = mesh.tokenizer.encode(" one two three four five six")
    for i, tok in enumerate(ids):
        await mesh.tokens(rid, TokenEvent(rid, i, [tok], None, 30 if i == 0 else 0))
        await asyncio.sleep(0.01)
    await mesh.tokens(rid, TokenEvent(rid, len(ids), [EOS], "stop"))
    got = await mesh.until_done(events)
    keepalives = [e for e in got[:-1] if not e.frames and not e.done and not e.body]
    assert len(keepalives) >= 2
    assert [e.seq for e in got] == list(range(len(got)))
    assert orjson.loads(got[-1].body)["choices"][0]["message"]["content"] == " one two three four five six"


def _content(got: list[ApiEvent]) -> str:
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for e in got for f in e.frames if f != b"data: [DONE]\n\n"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


async def test_a_lost_worker_resumes_the_stream_exactly_and_a_bounded_number_of_times(mesh: Mesh) -> None:
    """The balancer's "lost" event: the recipe submits the continuation (the prompt and the 5 tokens streamed, at
    output offset 5, the same sampling, as migration 1); the client's stream goes on with no gap and no repeat
    (the continuation's repeat of position 4 is dropped, the lost run's late error ignored). After
    max_migrations (2) resumptions the next loss ends the request with the event's 503 and a Cancel."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to eight."}], "stream": True,
            "max_tokens": 40, "temperature": 0.7, "seed": 11}
    rid, reply, events = await mesh.prepare("chat", body, tenant="acme")
    work = await asyncio.wait_for(mesh.work.get(), 5.0)
    ids = mesh.tokenizer.encode(" one two three four five six seven eight") + [EOS]
    await mesh.tokens(rid, *(TokenEvent(rid, i, [ids[i]], None, reply.prompt_tokens if i == 0 else 0)
                             for i in range(5)))
    await mesh.tokens(rid, TokenEvent(rid, 0, [], "lost", error="worker lost", error_status=503))
    resumed = await asyncio.wait_for(mesh.work.get(), 5.0)
    assert (resumed.request_id, resumed.prompt_ids, resumed.output_offset, resumed.migration) == (
        rid, work.prompt_ids + ids[:5], 5, 1)
    assert (resumed.sampling, resumed.cache_salt, resumed.model) == (work.sampling, work.cache_salt, work.model)
    await mesh.tokens(rid, TokenEvent(rid, 0, [], "error", error="aborted", error_status=500, migration=0),
                      TokenEvent(rid, 4, [ids[4]], migration=1), TokenEvent(rid, 5, ids[5:], "stop", migration=1))
    got = await mesh.until_done(events)
    assert got[-1].status == 200 and _content(got) == " one two three four five six seven eight"
    assert got[-1].output_tokens == len(ids)  # each token counted once
    assert mesh.cancels.empty() and mesh.recipe.migrations == 1 and mesh.recipe.forks == 0

    rid, reply, events = await mesh.prepare("chat", body)
    await asyncio.wait_for(mesh.work.get(), 5.0)
    await mesh.tokens(rid, TokenEvent(rid, 0, [ids[0]], None, reply.prompt_tokens))
    for migration in (0, 1):
        await mesh.tokens(rid, TokenEvent(rid, 0, [], "lost", error="worker lost", error_status=503,
                                          migration=migration))
        assert (await asyncio.wait_for(mesh.work.get(), 5.0)).migration == migration + 1
        await mesh.tokens(rid, TokenEvent(rid, 0, [], "lost", error="worker lost", error_status=503,
                                          migration=migration))  # the same loss told twice: resumed once
    await mesh.tokens(rid, TokenEvent(rid, 0, [], "lost", error="worker lost", error_status=503, migration=2))
    got = await mesh.until_done(events)
    assert got[-1].status == 503 and _content(got) == " one"
    assert "worker lost" in orjson.loads(got[-1].body)["error"]["message"]
    assert await asyncio.wait_for(mesh.cancels.get(), 5.0) == Cancel(rid, reason="error")
    assert mesh.work.empty() and mesh.recipe.migrations == 3


@pytest.mark.parametrize("forgotten", [True, False], ids=["another-recipe", "the-silent-one-itself"])
async def test_a_request_whose_recipe_died_is_taken_over_from_what_the_client_has(mesh: Mesh, forgotten: bool
                                                                                   ) -> None:
    """The gateway hands a request whose recipe died to another (here the same service, which forgets it first:
    a process that never knew it; or, not forgotten, the recipe taken for dead while only silent, whose own copy
    goes) with what the client has: the events' tokens, the reply's seed (drawn by the recipe: the client gave
    none) and creation time. The new recipe ends the runs the lost one may have left on every worker (past any
    migration it could have started), submits the continuation after the client's last token, and its events
    (epoch 1, seq from 0) carry only what follows: no token repeated, none missing."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to eight."}], "stream": True,
            "max_tokens": 40, "temperature": 0.7}
    rid, reply, events = await mesh.prepare("chat", body)
    work = await asyncio.wait_for(mesh.work.get(), 5.0)
    assert (reply.recipe, reply.seed) == (mesh.recipe.boot, work.sampling.seed) and reply.created > 0
    ids = mesh.tokenizer.encode(" one two three four five six seven eight") + [EOS]
    await mesh.tokens(rid, *(TokenEvent(rid, i, [ids[i]], None, reply.prompt_tokens if i == 0 else 0)
                             for i in range(5)))
    before: list[ApiEvent] = []
    while sum(len(e.token_ids) for e in before) < 5:
        before.append(await asyncio.wait_for(events.get(), 5.0))
    assert [t for e in before for t in e.token_ids] == ids[:5] and {e.epoch for e in before} == {0}
    if forgotten:
        mesh.recipe._drop(rid)  # the recipe that had it is gone

    resume = Resume(reply.seed, reply.created, ids[:5], 0, migration=0, epoch=1)
    again = PrepareRequest(rid, "chat", orjson.dumps(body), "", resume=resume)
    took = await mesh.bus.request(subjects.RECIPE_PREPARE, again, PrepareReply, timeout=5.0)
    assert took.ok and (took.seed, took.created) == (reply.seed, reply.created)
    assert await asyncio.wait_for(mesh.cancels.get(), 5.0) == Cancel(rid, "recipe lost", worker_id=EVERY_WORKER,
                                                                     migration=2)  # 0 + max_migrations
    resumed = await asyncio.wait_for(mesh.work.get(), 5.0)
    assert (resumed.prompt_ids, resumed.output_offset, resumed.migration) == (work.prompt_ids + ids[:5], 5, 3)
    assert resumed.sampling == work.sampling  # the same seed: the same draws
    await mesh.tokens(rid, TokenEvent(rid, 2, ids[2:4], migration=0),  # the lost recipe's run, late: dropped
                      TokenEvent(rid, 5, ids[5:], "stop", migration=3))
    after = await mesh.until_done(events)
    assert [e.seq for e in after] == list(range(len(after))) and {e.epoch for e in after} == {1}
    assert _content(before) + _content(after) == " one two three four five six seven eight"
    assert after[-1].status == 200 and after[-1].output_tokens == len(ids)
    assert mesh.recipe.takeovers == 1


async def test_a_recipe_whose_request_another_took_over_lets_it_go_quietly(mesh: Mesh) -> None:
    """Another recipe took the request over from this one (taken for dead while only silent): the takeover's
    Cancel for every worker, past this copy's migration, drops it here without an event or a Cancel of its own
    (a plain Cancel, for a stop string say, would end the copy that took over)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "stream": True, "max_tokens": 9}
    rid, reply, events = await mesh.prepare("chat", body)
    await asyncio.wait_for(mesh.work.get(), 5.0)
    await mesh.bus.publish(subjects.CANCEL, Cancel(rid, "recipe lost", worker_id=EVERY_WORKER, migration=2))
    assert await asyncio.wait_for(mesh.cancels.get(), 5.0) == Cancel(rid, "recipe lost", worker_id=EVERY_WORKER,
                                                                     migration=2)  # (the test's own, seen)
    for _ in range(100):  # (a bound on a failure)
        if rid not in mesh.recipe._flights:
            break
        await asyncio.sleep(0.05)
    assert rid not in mesh.recipe._flights
    await mesh.tokens(rid, TokenEvent(rid, 0, mesh.tokenizer.encode(" one"), "stop", reply.prompt_tokens))
    await asyncio.sleep(0.3)  # what it would send, had it kept the request
    assert events.empty() and mesh.cancels.empty()


async def test_a_request_finished_by_the_run_it_moved_past_cancels_its_continuation(mesh: Mesh) -> None:
    """A lost worker that was only silent finishes the request before its continuation does: the answer is the
    same (exact), the client gets it, and the continuation, still running for nobody, is cancelled."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "stream": True, "max_tokens": 9}
    rid, reply, events = await mesh.prepare("chat", body)
    await asyncio.wait_for(mesh.work.get(), 5.0)
    ids = mesh.tokenizer.encode(" one two three") + [EOS]
    await mesh.tokens(rid, TokenEvent(rid, 0, ids[:2], None, reply.prompt_tokens),
                      TokenEvent(rid, 0, [], "lost", error="worker lost", error_status=503))
    assert (await asyncio.wait_for(mesh.work.get(), 5.0)).migration == 1
    await mesh.tokens(rid, TokenEvent(rid, 2, ids[2:], "stop"))  # the old run (migration 0) ends it
    got = await mesh.until_done(events)
    assert got[-1].status == 200 and _content(got) == " one two three"
    assert await asyncio.wait_for(mesh.cancels.get(), 5.0) == Cancel(rid, reason="finished")


async def test_a_repeat_that_brings_another_token_is_noted_and_the_client_keeps_the_first(mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "stream": True, "max_tokens": 9}
    rid, reply, events = await mesh.prepare("chat", body)
    await asyncio.wait_for(mesh.work.get(), 5.0)
    ids = mesh.tokenizer.encode(" one two three") + [EOS]
    other = mesh.tokenizer.encode(" six")
    await mesh.tokens(rid, TokenEvent(rid, 0, ids[:1], None, reply.prompt_tokens),
                      TokenEvent(rid, 0, other, None, reply.prompt_tokens),  # a re-routed prefill, sampled otherwise
                      TokenEvent(rid, 1, ids[1:], "stop"))
    got = await mesh.until_done(events)
    assert _content(got) == " one two three" and mesh.recipe.forks == 1


# --- several choices (n > 1, best_of): one sub-request per candidate, merged into one response ---------------------


async def test_n_choices_share_the_prompt_and_merge_into_one_stream(mesh: Mesh) -> None:
    """Choice 0 goes first; the others once its first token is back (so they find its prompt cached). Each choice
    streams with its index; the usage comes once, at the end, then [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True, "seed": 7}
    rid, reply, events = await mesh.prepare("chat", body)
    assert reply.ok and reply.stream
    first = await asyncio.wait_for(mesh.work.get(), 5.0)
    assert first.request_id == f"{rid}-c0" and first.sampling.seed == 7
    await asyncio.sleep(0.1)
    assert mesh.work.empty()  # not before choice 0's prompt is computed
    prompt = len(first.prompt_ids)
    await mesh.tokens(first.request_id, TokenEvent(first.request_id, 0, mesh.tokenizer.encode("Hello"), None, prompt))
    second = await asyncio.wait_for(mesh.work.get(), 5.0)
    assert second.request_id == f"{rid}-c1" and second.prompt_ids == first.prompt_ids
    assert second.sampling.seed not in (None, 7)
    await mesh.tokens(second.request_id, TokenEvent(second.request_id, 0, mesh.tokenizer.encode("Bye") + [EOS],
                                                    "stop", prompt, cached_tokens=prompt - 3))
    await mesh.tokens(first.request_id, TokenEvent(first.request_id, 1, mesh.tokenizer.encode(" you") + [EOS], "stop"))
    got = await mesh.until_done(events)
    frames = [f for e in got for f in e.frames]
    assert frames[-1] == b"data: [DONE]\n\n"
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    texts = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                     if c["choices"] and c["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == ["Hello you", "Bye"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == prompt
    generated = sum(len(mesh.tokenizer.encode(t)) + (t != "Hello") for t in ("Hello", " you", "Bye"))  # + EOS
    assert chunks[-1]["usage"]["completion_tokens"] == generated
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # choice 0's: before any sharing
    assert mesh.cancels.empty() and mesh.recipe.health() == (True, "0 in flight")


async def test_best_of_ranks_the_candidates_by_their_logprobs(mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": "Once", "best_of": 3, "max_tokens": 4}
    rid, reply, events = await mesh.prepare("completions", body)
    assert reply.ok and not reply.stream
    texts = {0: " upon", 1: " there", 2: " more"}
    scores = {0: -3.0, 1: -1.0, 2: -2.0}
    for i in range(3):
        work = await asyncio.wait_for(mesh.work.get(), 5.0)
        assert work.request_id == f"{rid}-c{i}" and work.sampling.logprobs == 0  # needed to rank, not reported
        ids = mesh.tokenizer.encode(texts[i])
        logprobs = [TokenLogprob(scores[i] / len(ids)) for _ in ids]
        await mesh.tokens(work.request_id, TokenEvent(work.request_id, 0, ids, "length", len(work.prompt_ids),
                                                      logprobs=logprobs))
    (final,) = [e for e in await mesh.until_done(events) if e.done]
    response = orjson.loads(final.body)
    assert [(c["index"], c["text"]) for c in response["choices"]] == [(0, " there")]
    assert response["choices"][0]["logprobs"] is None
    assert response["usage"]["completion_tokens"] == sum(len(mesh.tokenizer.encode(t)) for t in texts.values())


async def test_a_client_cancel_reaches_every_choice_and_a_failed_one_fails_the_request(mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 3}
    rid, reply, events = await mesh.prepare("chat", body)
    first = await asyncio.wait_for(mesh.work.get(), 5.0)
    await mesh.tokens(first.request_id, TokenEvent(first.request_id, 0, [42], None, len(first.prompt_ids)))
    for _ in range(2):
        await asyncio.wait_for(mesh.work.get(), 5.0)
    await mesh.bus.publish(subjects.CANCEL, Cancel(rid, reason="client disconnected"))
    cancels = {(await asyncio.wait_for(mesh.cancels.get(), 5.0)).request_id for _ in range(4)}
    assert cancels == {rid, f"{rid}-c0", f"{rid}-c1", f"{rid}-c2"}
    assert mesh.recipe.health() == (True, "0 in flight")

    rid, reply, events = await mesh.prepare("chat", body)
    first = await asyncio.wait_for(mesh.work.get(), 5.0)
    await mesh.tokens(first.request_id, TokenEvent(first.request_id, 0, [42], None, len(first.prompt_ids)))
    others = [await asyncio.wait_for(mesh.work.get(), 5.0) for _ in range(2)]
    await mesh.tokens(others[0].request_id, TokenEvent(others[0].request_id, 0, [], "error", error="device lost",
                                                       error_status=500))
    (final,) = await mesh.until_done(events)
    assert final.status == 500 and orjson.loads(final.body)["error"]["message"] == "device lost"
    cancels = {(await asyncio.wait_for(mesh.cancels.get(), 5.0)).request_id for _ in range(3)}
    assert cancels == {f"{rid}-c0", f"{rid}-c1", f"{rid}-c2"}  # the failed one's own, and its siblings'
    assert mesh.recipe.health() == (True, "0 in flight")
