"""The balancer's routing and cache statistics on the gateway's /metrics, fetched over `balancer.stats` at each
scrape (the first balancer to answer, labelled with its instance; `deepinfer_balancer_up 0` when none does)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.gateway.scrape import Scraped
from shared import subjects
from shared.bus import Bus
from shared.schemas.balancer import BalancerStats, BalancerStatsReply

UP = ("deepinfer_balancer_up", "Whether a balancer answered balancer.stats at this scrape.")

# counters named <prefix>_<role> in the balancer -> a family with a `role` label
_PER_ROLE = {
    "routed": ("deepinfer_balancer_routed", "Jobs placed on a worker, by role."),
    "prompt_tokens": ("deepinfer_balancer_routed_prompt_tokens", "Prompt tokens of the jobs placed, by role."),
    "local_hit_tokens": ("deepinfer_balancer_local_hit_tokens",
                         "Prompt tokens the chosen worker held in its own prefix cache, by role."),
    "store_hit_tokens": ("deepinfer_balancer_store_hit_tokens",
                         "Prompt tokens the chosen worker would load from the kvcache store, by role."),
    "affinity": ("deepinfer_balancer_affinity_routed", "Jobs placed on the worker their session last used, by role."),
}
# counters that stand alone -> (family, labels) where several share one family
_SINGLE = {
    "rerouted": ("deepinfer_balancer_rerouted", "Jobs of a lost worker placed again on another one.", {}),
    "workers_lost": ("deepinfer_balancer_workers_lost", "Workers that fell silent and left the pool.", {}),
    "released_worker_lost": ("deepinfer_balancer_released", "Requests of a lost worker handed back to the recipe "
                             "to resume from the tokens it streamed (exact migration).", {}),
    "failed_no_worker": ("deepinfer_balancer_failed", "Requests failed by the balancer, by reason.",
                         {"reason": "no_worker"}),
    "failed_worker_lost": ("deepinfer_balancer_failed", "Requests failed by the balancer, by reason.",
                           {"reason": "worker_lost"}),
}
_OTHER = ("deepinfer_balancer_events", "Balancer counters without a family of their own, by name.")


def scraper(bus: Bus) -> Scraped[BalancerStatsReply]:
    return Scraped(bus, subjects.BALANCER_STATS, BalancerStats(), BalancerStatsReply, families, UP)


def families(reply: BalancerStatsReply) -> Iterator[Metric]:
    instance = reply.instance
    per_role = {p: CounterMetricFamily(n, h, labels=["instance", "role"]) for p, (n, h) in _PER_ROLE.items()}
    single: dict[str, CounterMetricFamily] = {}
    other = CounterMetricFamily(*_OTHER, labels=["instance", "counter"])
    for key, value in sorted(reply.counters.items()):
        if key in _SINGLE:
            name, help_text, labels = _SINGLE[key]
            family = single.setdefault(name, CounterMetricFamily(name, help_text, labels=["instance", *labels]))
            family.add_metric([instance, *labels.values()], value)
            continue
        prefix, _, role = key.rpartition("_")
        if prefix in per_role:
            per_role[prefix].add_metric([instance, role], value)
        else:
            other.add_metric([instance, key], value)
    yield from per_role.values()
    yield from single.values()
    if other.samples:
        yield other
    workers = GaugeMetricFamily("deepinfer_balancer_workers", "Workers in the balancer's pool, by role.",
                                labels=["instance", "role"])
    for role, n in sorted(reply.workers.items()):
        workers.add_metric([instance, role], n)
    yield workers
    for name, help_text, value in (
        ("deepinfer_balancer_assignments", "Requests placed on a worker and not done yet.", reply.assignments),
        ("deepinfer_balancer_kv_sources", "KV event sources (caches) in the prefix index.", reply.kv_sources),
    ):
        gauge = GaugeMetricFamily(name, help_text, labels=["instance"])
        gauge.add_metric([instance], value)
        yield gauge
    feed = CounterMetricFamily("deepinfer_balancer_kv_feed", "The KV event feed's events, gaps and resyncs.",
                               labels=["instance", "counter"])
    for key, value in sorted(reply.kv_feed.items()):
        feed.add_metric([instance, key], value)
    yield feed
