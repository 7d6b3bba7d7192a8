"""The gateway's /metrics and /health over a stand-in bus (no broker): Prometheus text that prometheus_client's
own parser accepts, HELP on every family, vLLM's series moving with a request's events, the kvcache's and the
balancer's statistics (and /metrics still answering when they do not), per-worker gauges and readiness from
heartbeats, on a fake clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import test_utils
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.fleet import Fleet
from services.gateway.metrics import Metrics
from shared import subjects
from shared.bus import BusTimeout
from shared.schemas.balancer import BalancerStatsReply
from shared.schemas.gateway import ApiEvent, PrepareReply
from shared.schemas.kv import KvStatsReply, KvTierStats
from shared.schemas.health import Presence
from shared.schemas.workers import Heartbeat
from shared.schemas.launcher import LauncherStatsReply, ProcessState

MODEL = "m"


def tier(**counts: int) -> KvTierStats:
    fields = dict.fromkeys(KvTierStats.__dataclass_fields__, 0)
    return KvTierStats(**{**fields, **counts})


KV = KvStatsReply(
    instance="kvcache-0",
    tiers={"ram": tier(hits=7, entries=3), "lmdb": tier(), "ssd": tier(hits=2, corrupt=1, disk_bytes=4096)},
    counters={"lookups": 5, "get_hits": 9, "leases": 2, "someday": 1},
    leases=4,
)
BALANCER = BalancerStatsReply(
    instance="balancer-0",
    counters={"routed_prefill": 3, "prompt_tokens_prefill": 120, "local_hit_tokens_prefill": 32, "rerouted": 1,
              "failed_no_worker": 2, "failed_worker_lost": 1, "affinity_decode": 1, "novel": 4,
              "released_worker_lost": 3},
    workers={"prefill": 1, "decode": 2},
    assignments=1,
    kv_sources=3,
    kv_feed={"events": 10, "resyncs": 1},
)


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


class StubBus:
    """Just enough of `Bus` for the app: stats requests answered from `answers` (an exception is raised), the
    prepare request by `prepare`, subscriptions kept so the test can deliver messages."""

    def __init__(self, answers: dict[str, Any] | None = None, prepare: Callable[[Any], Any] | None = None) -> None:
        self.answers = answers or {}
        self.prepare = prepare
        self.asked: list[str] = []
        self.handlers: dict[str, Callable[..., Any]] = {}
        self.connected = True
        self.losses, self.back_at = 0, 0.0  # the bus's outage state: never lost

    def down_for(self) -> float:
        return 0.0

    async def subscribe(self, subject: str, message_type: Any, handler: Callable[..., Any], **kwargs: Any) -> None:
        self.handlers[subject] = handler

    async def publish(self, subject: str, message: Any, **kwargs: Any) -> None:
        return None

    async def request(self, subject: str, message: Any, *args: Any, **kwargs: Any) -> Any:
        self.asked.append(subject)
        if subject == subjects.RECIPE_PREPARE and self.prepare is not None:
            return await self.prepare(message)
        answer = self.answers.get(subject, BusTimeout(subject))
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def deliver(self, subject: str, message: Any) -> None:
        await self.handlers[subject](message, None)


def families(text: str) -> dict[str, Any]:
    parsed = {f.name: f for f in text_string_to_metric_families(text)}  # raises on a malformed exposition
    undocumented = [name for name, f in parsed.items() if not f.documentation]
    assert not undocumented, undocumented
    return parsed


def value(parsed: dict[str, Any], sample: str, **labels: str) -> float | None:
    for family in parsed.values():
        for s in family.samples:
            if isinstance(s, Sample) and s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def scrape(app: Any) -> tuple[dict[str, Any], str]:
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.get("/metrics")
        assert resp.status == 200 and resp.content_type == "text/plain"
        text = await resp.text()
    return families(text), text


async def test_kvcache_and_balancer_statistics_and_their_absence() -> None:
    bus = StubBus({subjects.KV_STATS: KV, subjects.BALANCER_STATS: BALANCER})
    parsed, _ = await scrape(build_app(bus, GatewayConfig(), [MODEL]))  # type: ignore[arg-type]
    assert sorted(bus.asked) == sorted([subjects.KV_STATS, subjects.BALANCER_STATS, subjects.LAUNCHER_STATS])
    assert value(parsed, "deepinfer_kvcache_up") == 1 and value(parsed, "deepinfer_balancer_up") == 1
    assert value(parsed, "deepinfer_kvcache_tier_hits_total", instance="kvcache-0", tier="ram") == 7
    assert value(parsed, "deepinfer_kvcache_tier_corrupt_total", tier="ssd") == 1
    assert value(parsed, "deepinfer_kvcache_tier_disk_bytes", tier="ssd") == 4096
    assert value(parsed, "deepinfer_kvcache_lookups_total") == 5
    # the old clash: a counter of leasing lookups and a gauge of leases held, now two families
    assert parsed["deepinfer_kvcache_leased_lookups"].type == "counter"
    assert value(parsed, "deepinfer_kvcache_leased_lookups_total") == 2
    assert parsed["deepinfer_kvcache_leases_held"].type == "gauge"
    assert value(parsed, "deepinfer_kvcache_leases_held") == 4
    assert value(parsed, "deepinfer_kvcache_store_events_total", counter="someday") == 1

    assert value(parsed, "deepinfer_balancer_routed_total", role="prefill") == 3
    assert value(parsed, "deepinfer_balancer_routed_prompt_tokens_total", role="prefill") == 120
    assert value(parsed, "deepinfer_balancer_local_hit_tokens_total", role="prefill") == 32
    assert value(parsed, "deepinfer_balancer_affinity_routed_total", role="decode") == 1
    assert value(parsed, "deepinfer_balancer_failed_total", reason="no_worker") == 2
    assert value(parsed, "deepinfer_balancer_failed_total", reason="worker_lost") == 1
    assert value(parsed, "deepinfer_balancer_rerouted_total") == 1
    assert value(parsed, "deepinfer_balancer_released_total") == 3
    assert value(parsed, "deepinfer_balancer_events_total", counter="novel") == 4
    assert value(parsed, "deepinfer_balancer_workers", role="decode") == 2
    assert value(parsed, "deepinfer_balancer_kv_feed_total", counter="resyncs") == 1

    for broken in (BusTimeout("no responders"), RuntimeError("bus broke")):
        bus = StubBus({subjects.KV_STATS: broken, subjects.BALANCER_STATS: broken})
        parsed, text = await scrape(build_app(bus, GatewayConfig(), [MODEL]))  # type: ignore[arg-type]
        assert value(parsed, "deepinfer_kvcache_up") == 0 and value(parsed, "deepinfer_balancer_up") == 0
        assert 'tier="ssd"' not in text and "deepinfer_balancer_routed" not in text
        assert value(parsed, "deepinfer_gateway_requests_in_flight") == 0


async def test_the_launchers_processes_and_a_crash_loop() -> None:
    reply = LauncherStatsReply("launcher", [
        ProcessState("decode-0", "decode", running=False, restarts=6, crash_looping=True, restart_in_s=8.0),
        ProcessState("nats-server", "nats", running=True, restarts=1, crash_looping=False),
    ])
    bus = StubBus({subjects.LAUNCHER_STATS: reply})
    parsed, _ = await scrape(build_app(bus, GatewayConfig(), [MODEL]))  # type: ignore[arg-type]
    assert value(parsed, "deepinfer_launcher_up") == 1
    assert value(parsed, "deepinfer_process_crash_looping", instance="decode-0", service="decode") == 1
    assert value(parsed, "deepinfer_process_running", instance="decode-0") == 0
    assert value(parsed, "deepinfer_process_restarts_total", instance="decode-0") == 6
    assert value(parsed, "deepinfer_process_restart_in_seconds", instance="decode-0") == 8
    assert value(parsed, "deepinfer_process_running", instance="nats-server", service="nats") == 1
    assert value(parsed, "deepinfer_process_crash_looping", instance="nats-server") == 0
    parsed, text = await scrape(build_app(StubBus(), GatewayConfig(), [MODEL]))  # type: ignore[arg-type]
    assert value(parsed, "deepinfer_launcher_up") == 0 and "deepinfer_process_running" not in text


def beat(worker: str, role: str, **load: int) -> Heartbeat:
    fields = {"queued_tokens": 0, "running": 0, "free_blocks": 100, "total_blocks": 100, "sent_at": 0.0, **load}
    return Heartbeat(worker, role, MODEL, **fields)


async def test_readiness_and_worker_gauges_follow_the_heartbeats() -> None:
    clock, bus = Clock(), StubBus()
    app = build_app(bus, GatewayConfig(), [MODEL], clock=clock)  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:

        async def health() -> tuple[int, dict[str, Any]]:
            resp = await client.get("/health")
            return resp.status, orjson.loads(await resp.read())

        assert (await client.get("/live")).status == 200
        status, body = await health()
        assert status == 503 and body["status"] == "not ready"
        assert body["missing"] == ["a balancer", f"a recipe for {MODEL}", f"a prefill worker for {MODEL}",
                                   f"a decode worker for {MODEL}"]

        await bus.deliver(subjects.PRESENCE, Presence("recipe", "recipe-0", [MODEL]))
        await bus.deliver(subjects.PRESENCE, Presence("balancer", "balancer-0"))
        await bus.deliver(subjects.HEARTBEAT, beat("prefill-0", "prefill", queued_tokens=30, running=1))
        await bus.deliver(subjects.HEARTBEAT, beat("decode-0", "decode", running=3, waiting=1, free_blocks=75,
                                                   spec_drafted=10, spec_accepted=7, spec_verifies=4))
        await bus.deliver(subjects.HEARTBEAT, beat("decode-2", "decode", spec_drafted=6, spec_accepted=1,
                                                   spec_verifies=3))
        assert await health() == (200, {"status": "ok"})
        parsed = families(await (await client.get("/metrics")).text())
        decode = {"model_name": MODEL, "engine": "decode-0", "role": "decode"}
        assert value(parsed, "vllm:num_requests_running", **decode) == 2
        assert value(parsed, "vllm:num_requests_waiting", **decode) == 1
        assert value(parsed, "vllm:kv_cache_usage_perc", **decode) == 0.25
        assert value(parsed, "vllm:spec_decode_num_draft_tokens_total", **decode) == 10
        assert value(parsed, "vllm:spec_decode_num_accepted_tokens_total", **decode) == 7
        assert value(parsed, "vllm:spec_decode_num_drafts_total", **decode) == 4
        # per model, over both decode workers: 8 of 16 drafts kept, 7 verifying steps emitted 7 + 8 tokens
        assert value(parsed, "deepinfer_spec_decode_acceptance_rate", model_name=MODEL) == 0.5
        assert value(parsed, "deepinfer_spec_decode_mean_accepted_length", model_name=MODEL) == 1 + 8 / 7
        assert value(parsed, "deepinfer_worker_queued_tokens", engine="prefill-0") == 30
        assert value(parsed, "deepinfer_ready") == 1 and value(parsed, "deepinfer_services", service="decode") == 2
        # drafts per second need two beats of a worker: decode-0 proposes 30 more in the next 0.5 s (decode-2's
        # counter went back: a restart, no rate until its next beat)
        assert value(parsed, "deepinfer_spec_decode_draft_tokens_per_second", model_name=MODEL) is None
        clock.t += 0.5
        await bus.deliver(subjects.HEARTBEAT, beat("decode-0", "decode", running=3, waiting=1, free_blocks=75,
                                                   spec_drafted=40, spec_accepted=27, spec_verifies=14))
        await bus.deliver(subjects.HEARTBEAT, beat("decode-2", "decode", spec_drafted=2, spec_accepted=1,
                                                   spec_verifies=1))
        parsed = families(await (await client.get("/metrics")).text())
        assert value(parsed, "deepinfer_spec_decode_draft_tokens_per_second", model_name=MODEL) == 60.0

        clock.t += 2.0  # the decode worker falls silent; everyone else keeps speaking
        await bus.deliver(subjects.PRESENCE, Presence("recipe", "recipe-0", [MODEL]))
        await bus.deliver(subjects.PRESENCE, Presence("balancer", "balancer-0"))
        await bus.deliver(subjects.HEARTBEAT, beat("prefill-0", "prefill"))
        clock.t += 2.0
        assert await health() == (503, {"status": "not ready", "missing": [f"a decode worker for {MODEL}"]})
        parsed = families(await (await client.get("/metrics")).text())
        assert value(parsed, "vllm:num_requests_running", engine="decode-0") is None
        assert value(parsed, "deepinfer_ready") == 0
        assert value(parsed, "deepinfer_spec_decode_acceptance_rate", model_name=MODEL) is None  # none drafts now

        await bus.deliver(subjects.HEARTBEAT, beat("decode-1", "decode"))  # a restarted worker
        assert (await health())[0] == 200


def event(seq: int, tokens: int, *, done: bool = False, cached: int = 0, reason: str = "") -> ApiEvent:
    return ApiEvent("r", seq, [b"data: x\n\n"], done=done, output_tokens=tokens, cached_tokens=cached,
                    finish_reason=reason)


def test_request_meter_streaming_and_unary() -> None:
    metrics = Metrics()
    meter = metrics.meter(MODEL, stream=True, prompt_tokens=20, arrival=10.0)
    meter.event(event(0, 0), 10.1)  # a role chunk: no token yet
    meter.event(event(1, 1, cached=16), 10.5)  # the first token: TTFT 0.5 s
    meter.event(event(2, 3), 10.7)  # two tokens in 0.2 s: 0.1 s each
    meter.event(event(3, 4, done=True, reason="length"), 10.8)
    meter.end(10.8)
    meter.end(11.0)  # once only
    unary = metrics.meter(MODEL, stream=False, prompt_tokens=5, arrival=20.0)
    unary.event(event(0, 2, done=True, reason="stop_sequence"), 21.0)
    unary.end(21.0)
    failed = metrics.meter(MODEL, stream=True, prompt_tokens=5, arrival=30.0)
    failed.event(event(0, 1), 30.5)
    failed.end(31.0)  # ended without `done` (client gone): tokens count, latency and success do not

    parsed = families(metrics.render().decode())
    m = {"model_name": MODEL}
    assert value(parsed, "vllm:time_to_first_token_seconds_count", **m) == 2  # the unary one has no TTFT
    assert value(parsed, "vllm:time_to_first_token_seconds_sum", **m) == 1.0
    assert value(parsed, "vllm:time_to_first_token_seconds_bucket", le="0.5", **m) == 2
    assert value(parsed, "vllm:inter_token_latency_seconds_count", **m) == 3
    assert abs(value(parsed, "vllm:inter_token_latency_seconds_sum", **m) - 0.3) < 1e-9
    assert abs(value(parsed, "vllm:request_time_per_output_token_seconds_sum", **m) - 0.1) < 1e-9
    assert value(parsed, "vllm:e2e_request_latency_seconds_count", **m) == 2
    assert value(parsed, "vllm:prompt_tokens_total", **m) == 30
    assert value(parsed, "vllm:generation_tokens_total", **m) == 7
    assert value(parsed, "vllm:prompt_tokens_cached_total", **m) == 16
    assert value(parsed, "vllm:prefix_cache_hits_total", **m) == 16
    assert value(parsed, "vllm:prefix_cache_queries_total", **m) == 30
    assert value(parsed, "vllm:request_success_total", finished_reason="length", **m) == 1
    assert value(parsed, "vllm:request_success_total", finished_reason="stop", **m) == 1
    assert value(parsed, "vllm:request_generation_tokens_sum", **m) == 6


async def test_a_streamed_request_through_the_app_moves_the_series() -> None:
    bus = StubBus()

    async def prepare(message: Any) -> PrepareReply:
        deliver = bus.handlers[subjects.events(message.request_id)]
        for e in (event(0, 1, cached=4), event(1, 2), event(2, 3, done=True, reason="stop")):
            await deliver(ApiEvent(message.request_id, e.seq, e.frames, e.done, output_tokens=e.output_tokens,
                                   cached_tokens=e.cached_tokens, finish_reason=e.finish_reason), None)
        return PrepareReply(ok=True, stream=True, prompt_tokens=9)

    bus.prepare = prepare
    app = build_app(bus, GatewayConfig(), [MODEL])  # type: ignore[arg-type]
    async with test_utils.TestClient(test_utils.TestServer(app)) as client:
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [], "stream": True})
        assert resp.status == 200 and (await resp.read()).count(b"data: x") == 3
        parsed = families(await (await client.get("/metrics")).text())
    m = {"model_name": MODEL}
    assert value(parsed, "vllm:time_to_first_token_seconds_count", **m) == 1
    assert value(parsed, "vllm:inter_token_latency_seconds_count", **m) == 2
    assert value(parsed, "vllm:e2e_request_latency_seconds_count", **m) == 1
    assert value(parsed, "vllm:generation_tokens_total", **m) == 3
    assert value(parsed, "vllm:prompt_tokens_total", **m) == 9
    assert value(parsed, "vllm:request_success_total", finished_reason="stop", **m) == 1
    assert value(parsed, "deepinfer_gateway_requests_total", api="chat", status="200") == 1


def test_readiness_follows_a_served_alias_to_the_workers_model() -> None:
    """--served-model-name smol alias: the recipe serves both names, the workers only the first."""
    fleet, now = Fleet(), 100.0
    fleet.heard_service(Presence("balancer", "balancer-0", [], now), now)
    fleet.heard_service(Presence("recipe", "recipe-0", ["smol", "alias"], now, {"alias": "smol"}), now)
    assert fleet.missing(["smol", "alias"], now) == ["a prefill worker for smol", "a decode worker for smol"]
    for role in ("prefill", "decode"):
        fleet.heard_worker(Heartbeat(f"{role}-0", role, "smol", 0, 0, 10, 10, now), now)
    assert fleet.missing(["smol", "alias"], now) == []
    assert fleet.missing(["smol", "alias"], now + 10) == ["a balancer", "a recipe for smol", "a prefill worker for smol",
                                                         "a decode worker for smol", "a recipe for alias",
                                                         "a prefill worker for alias", "a decode worker for alias"]
