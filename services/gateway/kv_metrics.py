"""The kvcache store's tiers and counters on the gateway's /metrics, fetched over `kv.stats` at each scrape.

When no instance replies in time, the section says `deepinfer_kvcache_up 0` and nothing else. With several
kvcache instances the first reply is shown, labelled with its instance.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.gateway.scrape import Scraped
from shared import subjects
from shared.bus import Bus
from shared.schemas.kv import KvStats, KvStatsReply

UP = ("deepinfer_kvcache_up", "Whether a kvcache instance answered kv.stats at this scrape.")

# (field of KvTierStats, family name, counter?, help)
_TIER_SERIES = [
    ("hits", "deepinfer_kvcache_tier_hits", True, "Blocks read from the tier."),
    ("misses", "deepinfer_kvcache_tier_misses", True,
     "Reads that the tier could not answer (they fell through to a slower one)."),
    ("promotions", "deepinfer_kvcache_tier_promotions", True,
     "Entries copied into the tier from a slower one on a read."),
    ("evictions", "deepinfer_kvcache_tier_evictions", True, "Entries dropped to make room."),
    ("expired", "deepinfer_kvcache_tier_expired", True, "Entries dropped by TTL."),
    ("corrupt", "deepinfer_kvcache_tier_corrupt", True,
     "Records that failed their checksum (dropped, never returned)."),
    ("entries", "deepinfer_kvcache_tier_entries", False, "Entries held."),
    ("bytes", "deepinfer_kvcache_tier_bytes", False, "Bytes of live entries."),
    ("capacity_bytes", "deepinfer_kvcache_tier_capacity_bytes", False, "Capacity of the tier in bytes."),
    ("disk_bytes", "deepinfer_kvcache_tier_disk_bytes", False, "Bytes on disk, live or not (0 for RAM)."),
]

# the store's counters (services/kvcache/store.py Counters) -> family name (without _total) and help
_STORE_COUNTERS = {
    "lookups": ("deepinfer_kvcache_lookups", "kv.lookup requests answered."),
    "lookup_blocks_hit": ("deepinfer_kvcache_lookup_blocks_hit", "Blocks of looked-up prompts found stored."),
    "lookup_blocks_missed": ("deepinfer_kvcache_lookup_blocks_missed", "Blocks of looked-up prompts not stored."),
    # was deepinfer_kvcache_leases_total, whose family clashed with the gauge of leases held
    "leases": ("deepinfer_kvcache_leased_lookups", "Lookups that leased their run against eviction."),
    "get_hits": ("deepinfer_kvcache_get_hits", "Keys kv.get returned."),
    "get_misses": ("deepinfer_kvcache_get_misses", "Keys kv.get did not find."),
    "bytes_read": ("deepinfer_kvcache_bytes_read", "Bytes returned by kv.get."),
    "puts": ("deepinfer_kvcache_puts", "kv.put requests."),
    "puts_refused": ("deepinfer_kvcache_puts_refused", "kv.put requests the store refused (too large, no room)."),
    "bytes_written": ("deepinfer_kvcache_bytes_written", "Bytes stored by kv.put."),
    "deletes": ("deepinfer_kvcache_deletes", "Entries deleted by kv.delete."),
    "migrations": ("deepinfer_kvcache_migrations", "Long-term blocks moved from LMDB to the SSD tier on read."),
}
_OTHER_COUNTER = ("deepinfer_kvcache_store_events", "Store counters without a family of their own, by name.")


def scraper(bus: Bus) -> Scraped[KvStatsReply]:
    return Scraped(bus, subjects.KV_STATS, KvStats(), KvStatsReply, families, UP)


def families(reply: KvStatsReply) -> Iterator[Metric]:
    instance = reply.instance
    for field, name, counter, help_text in _TIER_SERIES:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, help_text, labels=["instance", "tier"])
        for tier, stats in reply.tiers.items():
            family.add_metric([instance, tier], getattr(stats, field))
        yield family
    other = CounterMetricFamily(*_OTHER_COUNTER, labels=["instance", "counter"])
    for counter, value in sorted(reply.counters.items()):
        if counter in _STORE_COUNTERS:
            family = CounterMetricFamily(*_STORE_COUNTERS[counter], labels=["instance"])
            family.add_metric([instance], value)
            yield family
        else:
            other.add_metric([instance, counter], value)
    if other.samples:
        yield other
    leases = GaugeMetricFamily("deepinfer_kvcache_leases_held", "Keys leased by kv.lookup now.", labels=["instance"])
    leases.add_metric([instance], reply.leases)
    yield leases
