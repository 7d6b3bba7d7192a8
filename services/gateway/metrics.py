"""The gateway's own series on /metrics, in one prometheus_client registry per app (never the global one, so a
process, or a test, can build several apps).

Request series carry vLLM's names, buckets and `model_name` label, so dashboards built for vLLM read them:
latency is measured here, where the client sees the events go out, and tokens come from the recipe's metering
fields on each ApiEvent (cumulative engine tokens, cached prompt tokens, the finish reason on `done`).

    TTFT         arrival -> the first event that carries a token (streaming requests: a unary answer has none
                 before its end, so it would only repeat the end-to-end latency)
    inter-token  the gap between two events that carry tokens, shared by the tokens the later one brings
                 (observed once per token, so sum / count is the mean time per output token, as clients compute)
    end-to-end   arrival -> `done`, for requests that finished normally
"""

from __future__ import annotations

from collections.abc import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.schemas.gateway import ApiEvent

prometheus_client.disable_created_metrics()  # no `_created` series beside every counter (vLLM does the same)

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


TOKEN_COUNT_BUCKETS = one_two_five(1_000_000)  # the gateway does not know max_model_len: wide enough for any


def finished_reason(reason: str) -> str:
    """vLLM's finished_reason values: ours that end the turn on a stop condition read as "stop"."""
    return "length" if reason == "length" else "stop"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        m = ["model_name"]
        self.requests = Counter("deepinfer_gateway_requests", "API requests answered, by api and HTTP status.",
                                ["api", "status"], registry=r)
        self.in_flight = Gauge("deepinfer_gateway_requests_in_flight", "API requests being served now.", registry=r)
        self.cancels = Counter("deepinfer_gateway_cancels", "Cancel messages sent, by reason.", ["reason"],
                               registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", m,
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             m, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", m,
                                        buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                            m, buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", m,
                                         registry=r)
        self.cached_tokens = Counter("vllm:prompt_tokens_cached",
                                     "Number of cached prompt tokens (worker caches and the kvcache store).", m,
                                     registry=r)
        self.cache_queries = Counter("vllm:prefix_cache_queries",
                                     "Prefix cache queries, in terms of number of queried tokens.", m, registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                  m, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*m, "finished_reason"], registry=r)

    def register(self, collectors: Iterable[prometheus_client.registry.Collector]) -> None:
        for collector in collectors:
            self.registry.register(collector)

    def started(self) -> None:
        self.in_flight.inc()

    def finished(self, api: str, status: int) -> None:
        self.in_flight.dec()
        self.requests.labels(api, str(status)).inc()

    def cancelled(self, reason: str) -> None:
        self.cancels.labels(reason).inc()

    def meter(self, model: str, *, stream: bool, prompt_tokens: int, arrival: float) -> RequestMeter:
        return RequestMeter(self, model, stream, prompt_tokens, arrival)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class RequestMeter:
    """One accepted request's tokens and timings: `event` for each ApiEvent in order, `end` once.
    Times are monotonic seconds."""

    def __init__(self, metrics: Metrics, model: str, stream: bool, prompt_tokens: int, arrival: float) -> None:
        self._m = metrics
        self._model = model
        self._stream = stream
        self._prompt = prompt_tokens
        self._arrival = arrival
        self._tokens = 0
        self._first: float | None = None  # when the first token went out (streaming)
        self._last = 0.0
        self._reason = ""
        self._ended = False

    @property
    def model(self) -> str:
        return self._model

    @property
    def prompt_tokens(self) -> int:
        return self._prompt

    @property
    def output_tokens(self) -> int:
        return self._tokens

    @property
    def finish_reason(self) -> str:
        """"" until the request finished normally."""
        return self._reason

    def event(self, event: ApiEvent, now: float) -> None:
        m, model = self._m, self._model
        if event.done and event.status == 200:
            self._reason = event.finish_reason or "stop"
        new = event.output_tokens - self._tokens
        if new <= 0:
            return
        if self._tokens == 0:  # prefill is over: the prompt was processed, some of it found cached
            m.prompt_tokens.labels(model).inc(self._prompt)
            m.cache_queries.labels(model).inc(self._prompt)
            m.cached_tokens.labels(model).inc(event.cached_tokens)
            m.cache_hits.labels(model).inc(event.cached_tokens)
        m.generation_tokens.labels(model).inc(new)
        self._tokens = event.output_tokens
        if not self._stream:
            return
        if self._first is None:
            self._first = now
            m.ttft.labels(model).observe(now - self._arrival)
        else:
            gap = (now - self._last) / new
            for _ in range(new):
                m.itl.labels(model).observe(gap)
        self._last = now

    def end(self, now: float) -> None:
        """The request is over, however it ended; the latency and success series count only a normal finish."""
        if self._ended:
            return
        self._ended = True
        m, model = self._m, self._model
        if not self._reason:
            return
        m.success.labels(model, finished_reason(self._reason)).inc()
        m.e2e.labels(model).observe(now - self._arrival)
        m.request_prompt.labels(model).observe(self._prompt)
        m.request_generation.labels(model).observe(self._tokens)
        if self._first is not None and self._tokens > 1:
            m.tpot.labels(model).observe((self._last - self._first) / (self._tokens - 1))
