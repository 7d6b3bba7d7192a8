"""Per-worker series from the heartbeats the gateway hears (services/gateway/fleet.py), under vLLM's names
where vLLM has one; labels: model_name, engine (the worker id) and role. A silent worker's series disappear."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.gateway.fleet import Fleet
from shared.schemas.workers import Heartbeat

LABELS = ["model_name", "engine", "role"]

# (name, counter?, help, value of a heartbeat)
_SERIES: list[tuple[str, bool, str, Callable[[Heartbeat], float]]] = [
    ("vllm:num_requests_running", False, "Number of requests in model execution batches.",
     lambda b: b.running - b.waiting),
    ("vllm:num_requests_waiting", False, "Number of requests waiting to be processed.", lambda b: b.waiting),
    ("vllm:kv_cache_usage_perc", False, "KV-cache usage. 1 means 100 percent usage.",
     lambda b: 1 - b.free_blocks / b.total_blocks if b.total_blocks else 0.0),
    ("vllm:spec_decode_num_draft_tokens", True, "Number of draft tokens.", lambda b: b.spec_drafted),
    ("vllm:spec_decode_num_accepted_tokens", True, "Number of accepted tokens.", lambda b: b.spec_accepted),
    ("vllm:spec_decode_num_drafts", True, "Number of spec decoding drafts (decode steps that verified drafts).",
     lambda b: b.spec_verifies),
    ("deepinfer_worker_queued_tokens", False, "Prompt tokens waiting or being computed on the worker.",
     lambda b: b.queued_tokens),
    ("deepinfer_worker_kv_blocks_free", False, "Free KV blocks of the worker's engine.", lambda b: b.free_blocks),
    ("deepinfer_worker_kv_blocks", False, "KV blocks of the worker's engine.", lambda b: b.total_blocks),
]


def _acceptance(beats: Sequence[Heartbeat], draft_rates: dict[str, float]) -> Iterator[Metric]:
    """Per model, over its live workers: drafts accepted / proposed, tokens a verifying step emits on average
    (1 + accepted / verifies, vLLM's mean acceptance length) and drafts proposed per second (summed over the
    workers' rates between their last two heartbeats); a model none of whose workers drafted has none."""
    totals: dict[str, list[int]] = {}
    for b in beats:
        t = totals.setdefault(b.model, [0, 0, 0])
        t[0], t[1], t[2] = t[0] + b.spec_drafted, t[1] + b.spec_accepted, t[2] + b.spec_verifies
    rate = GaugeMetricFamily("deepinfer_spec_decode_acceptance_rate",
                             "Speculative drafts accepted / proposed, over the model's live workers.",
                             labels=["model_name"])
    length = GaugeMetricFamily("deepinfer_spec_decode_mean_accepted_length",
                               "Tokens a verifying decode step emits on average (1 + accepted / verifies), over the "
                               "model's live workers.", labels=["model_name"])
    per_second = GaugeMetricFamily("deepinfer_spec_decode_draft_tokens_per_second",
                                   "Speculative draft tokens proposed per second, over the model's live workers "
                                   "(each worker's rate between its last two heartbeats).", labels=["model_name"])
    speeds: dict[str, float] = {}
    for b in beats:
        if b.worker_id in draft_rates:
            speeds[b.model] = speeds.get(b.model, 0.0) + draft_rates[b.worker_id]
    for model, (drafted, accepted, verifies) in sorted(totals.items()):
        if drafted and verifies:
            rate.add_metric([model], accepted / drafted)
            length.add_metric([model], 1 + accepted / verifies)
        if drafted and model in speeds:
            per_second.add_metric([model], speeds[model])
    yield rate
    yield length
    yield per_second


class FleetCollector:
    def __init__(self, fleet: Fleet, models: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._fleet = fleet
        self._models = list(models)
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        beats = self._fleet.workers(now)
        for name, counter, help_text, value in _SERIES:
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, help_text, labels=LABELS)
            for beat in beats:
                family.add_metric([beat.model, beat.worker_id, beat.role], value(beat))
            yield family
        yield from _acceptance(beats, self._fleet.draft_rates(now))
        services = GaugeMetricFamily("deepinfer_services", "Live instances of each service the gateway hears from.",
                                     labels=["service"])
        counts: dict[str, int] = {"prefill": 0, "decode": 0, "recipe": 0, "balancer": 0}
        for beat in beats:
            counts[beat.role] = counts.get(beat.role, 0) + 1
        for presence in self._fleet.services(now):
            counts[presence.service] = counts.get(presence.service, 0) + 1
        for service, n in sorted(counts.items()):
            services.add_metric([service], n)
        yield services
        ready = GaugeMetricFamily("deepinfer_ready", "1 when every served model has a recipe, a balancer and a "
                                  "prefill and a decode worker (what /health answers 200 for).")
        ready.add_metric([], int(not self._fleet.missing(self._models, now)))
        yield ready
