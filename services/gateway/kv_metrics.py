"""The kvcache store's counters on the gateway's /metrics, fetched over `kv.stats` at each scrape.

/metrics answers whatever the kvcache does: when no instance replies in time, the section says
`deepinfer_kvcache_up 0` and nothing else. With several kvcache instances the first reply is shown, labelled
with its instance.
"""

from __future__ import annotations

import logging

from services.gateway.metrics import _label
from shared import subjects
from shared.bus import Bus
from shared.schemas.kv import KvStats, KvStatsReply

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 1.0

# (field of KvTierStats, metric suffix, Prometheus type, help)
_TIER_SERIES = [
    ("hits", "hits_total", "counter", "Blocks read from the tier."),
    ("misses", "misses_total", "counter", "Reads that the tier could not answer (they fell through to a slower one)."),
    ("promotions", "promotions_total", "counter", "Entries copied into the tier from a slower one on a read."),
    ("evictions", "evictions_total", "counter", "Entries dropped to make room."),
    ("expired", "expired_total", "counter", "Entries dropped by TTL."),
    ("corrupt", "corrupt_total", "counter", "Records that failed their checksum (dropped, never returned)."),
    ("entries", "entries", "gauge", "Entries held."),
    ("bytes", "bytes", "gauge", "Bytes of live entries."),
    ("capacity_bytes", "capacity_bytes", "gauge", "Capacity of the tier in bytes."),
    ("disk_bytes", "disk_bytes", "gauge", "Bytes on disk, live or not (0 for RAM)."),
]


async def scrape(bus: Bus, timeout: float = SCRAPE_TIMEOUT_S) -> str:
    try:
        reply = await bus.request(subjects.KV_STATS, KvStats(), KvStatsReply, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - /metrics must answer however the bus or the kvcache fails
        log.debug("kv.stats not answered: %s", exc)
        reply = None
    return render(reply if isinstance(reply, KvStatsReply) else None)


def render(reply: KvStatsReply | None) -> str:
    lines = [
        "# HELP deepinfer_kvcache_up Whether a kvcache instance answered kv.stats at this scrape.",
        "# TYPE deepinfer_kvcache_up gauge",
        f"deepinfer_kvcache_up {int(reply is not None)}",
    ]
    if reply is None:
        return "\n".join(lines) + "\n"
    instance = _label(reply.instance)
    for field, suffix, kind, help_text in _TIER_SERIES:
        name = f"deepinfer_kvcache_tier_{suffix}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for tier in reply.tiers:
            value = getattr(tier, field)
            lines.append(f'{name}{{instance="{instance}",tier="{_label(tier.tier)}"}} {value}')
    for counter, value in sorted(reply.counters.items()):
        name = f"deepinfer_kvcache_{counter}_total"
        lines += [f"# TYPE {name} counter", f'{name}{{instance="{instance}"}} {value}']
    lines += [
        "# HELP deepinfer_kvcache_leases Keys leased by kv.lookup now.",
        "# TYPE deepinfer_kvcache_leases gauge",
        f'deepinfer_kvcache_leases{{instance="{instance}"}} {reply.leases}',
    ]
    return "\n".join(lines) + "\n"

