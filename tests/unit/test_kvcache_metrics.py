"""The kvcache's tier counters on the gateway's /metrics: rendered in Prometheus text format when a kvcache answers
`kv.stats`, and /metrics still answering when none does (or the bus fails)."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import test_utils

from services.gateway.app import build_app
from services.gateway.config import GatewayConfig
from services.gateway.kv_metrics import render
from shared import subjects
from shared.bus import BusTimeout
from shared.schemas.kv import KvStatsReply, KvTierStats

SAMPLE = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?\d+(\.\d+)?$')


def tier(name: str, **counts: int) -> KvTierStats:
    fields = dict.fromkeys(KvTierStats.__dataclass_fields__, 0)
    return KvTierStats(**{**fields, "tier": name, **counts})


REPLY = KvStatsReply(
    instance="kvcache-0",
    tiers=[tier("ram", hits=7, entries=3), tier("lmdb"), tier("ssd", hits=2, corrupt=1, disk_bytes=4096)],
    counters={"lookups": 5, "get_hits": 9},
    leases=4,
)


class StatsBus:
    """Just enough of `Bus` for the app: kv.stats answered by `answer`, everything else unanswered."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.asked: list[str] = []

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def publish(self, subject: str, message: Any) -> None:
        return None

    async def request(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        self.asked.append(subject)
        if subject == subjects.KV_STATS and not isinstance(self.answer, Exception):
            return self.answer
        raise self.answer if isinstance(self.answer, Exception) else BusTimeout(subject)


def test_render_is_prometheus_text() -> None:
    text = render(REPLY)
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or SAMPLE.match(line), line
    assert "deepinfer_kvcache_up 1" in text
    assert 'deepinfer_kvcache_tier_hits_total{instance="kvcache-0",tier="ram"} 7' in text
    assert 'deepinfer_kvcache_tier_corrupt_total{instance="kvcache-0",tier="ssd"} 1' in text
    assert 'deepinfer_kvcache_tier_disk_bytes{instance="kvcache-0",tier="ssd"} 4096' in text
    assert 'deepinfer_kvcache_lookups_total{instance="kvcache-0"} 5' in text
    assert 'deepinfer_kvcache_leases{instance="kvcache-0"} 4' in text
    assert render(None).splitlines()[-1] == "deepinfer_kvcache_up 0"


async def test_metrics_endpoint_with_the_kvcache_up_down_and_a_broken_bus() -> None:
    for answer, up in ((REPLY, True), (BusTimeout("no responders"), False), (RuntimeError("bus broke"), False)):
        bus = StatsBus(answer)
        app = build_app(bus, GatewayConfig(), ["m"])  # type: ignore[arg-type]
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            resp = await client.get("/metrics")
            text = await resp.text()
        assert resp.status == 200 and "deepinfer_gateway_requests_in_flight" in text
        assert f"deepinfer_kvcache_up {int(up)}" in text
        assert ('tier="ssd"' in text) == up
        assert bus.asked == [subjects.KV_STATS]
