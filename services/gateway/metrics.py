"""Request counters in Prometheus text format (no client library: three series do not need one)."""

from __future__ import annotations

from collections import Counter


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self) -> None:
        self.in_flight = 0
        self.requests: Counter[tuple[str, int]] = Counter()  # (api, HTTP status) -> count
        self.cancels: Counter[str] = Counter()  # Cancel reason -> count

    def started(self) -> None:
        self.in_flight += 1

    def finished(self, api: str, status: int) -> None:
        self.in_flight -= 1
        self.requests[(api, status)] += 1

    def cancelled(self, reason: str) -> None:
        self.cancels[reason] += 1

    def render(self) -> str:
        lines = [
            "# HELP deepinfer_gateway_requests_total API requests answered, by api and HTTP status.",
            "# TYPE deepinfer_gateway_requests_total counter",
        ]
        for (api, status), n in sorted(self.requests.items()):
            lines.append(f'deepinfer_gateway_requests_total{{api="{_label(api)}",status="{status}"}} {n}')
        lines += [
            "# HELP deepinfer_gateway_requests_in_flight API requests being served now.",
            "# TYPE deepinfer_gateway_requests_in_flight gauge",
            f"deepinfer_gateway_requests_in_flight {self.in_flight}",
            "# HELP deepinfer_gateway_cancels_total Cancel messages sent, by reason.",
            "# TYPE deepinfer_gateway_cancels_total counter",
        ]
        for reason, n in sorted(self.cancels.items()):
            lines.append(f'deepinfer_gateway_cancels_total{{reason="{_label(reason)}"}} {n}')
        return "\n".join(lines) + "\n"
