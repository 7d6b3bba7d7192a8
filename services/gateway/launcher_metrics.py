"""What `deepinfer up` supervises on the gateway's /metrics, fetched over `launcher.stats` at each scrape: each
process running or not, its restarts, whether it is in a crash loop (restarted with a growing delay while the
rest serves on). `deepinfer_launcher_up 0` where no launcher answers (compose, Kubernetes: they have their own)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.gateway.scrape import Scraped
from shared import subjects
from shared.bus import Bus
from shared.schemas.launcher import LauncherStats, LauncherStatsReply

UP = ("deepinfer_launcher_up", "Whether a launcher (deepinfer up) answered launcher.stats at this scrape.")
LABELS = ["instance", "service"]


def scraper(bus: Bus) -> Scraped[LauncherStatsReply]:
    return Scraped(bus, subjects.LAUNCHER_STATS, LauncherStats(), LauncherStatsReply, families, UP)


def families(reply: LauncherStatsReply) -> Iterator[Metric]:
    running = GaugeMetricFamily("deepinfer_process_running", "Whether the launcher's process runs now.", labels=LABELS)
    restarts = CounterMetricFamily("deepinfer_process_restarts", "Times the launcher restarted the process.",
                                   labels=LABELS)
    looping = GaugeMetricFamily("deepinfer_process_crash_looping",
                                "1 while the process keeps dying and is restarted with a growing delay.", labels=LABELS)
    backoff = GaugeMetricFamily("deepinfer_process_restart_in_seconds",
                                "Seconds until a dead, backed-off process is started again (0 when running).",
                                labels=LABELS)
    for p in reply.processes:
        labels = [p.instance, p.service]
        running.add_metric(labels, int(p.running))
        restarts.add_metric(labels, p.restarts)
        looping.add_metric(labels, int(p.crash_looping))
        backoff.add_metric(labels, p.restart_in_s)
    yield from (running, restarts, looping, backoff)
