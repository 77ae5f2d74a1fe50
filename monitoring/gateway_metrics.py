"""Prometheus metrics of the HTTP gateway (`redline serve`), served on its own port at /metrics.

One `GatewayMetrics` per gateway app, with its own registry. Every metric carries the labels `queue` and
`model_name`, as the worker's do, so one dashboard variable selects both.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "redline_gateway_"

# A request's time from its head to the end of its answer: a health check takes a millisecond, an online
# completion waits for its job (up to the request timeout, 600 s by default), a stream lasts as long.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                   80.0, 160.0, 320.0, 640.0)
OPEN_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
FINAL_BATCH_STATUSES = ("completed", "failed", "expired", "cancelled")
# why the gateway closed a connection itself: its request head or body did not arrive in time, it waited for a
# head when a new connection needed its place, or every place was busy with a request
DROP_REASONS = ("head_timeout", "body_timeout", "evicted", "refused")
UNROUTED = "unrouted"  # the route label of a request no route matches (404)


class GatewayMetrics:
    """Every metric one gateway exports."""

    def __init__(self, queue: str = "default", model: str = "redline",
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        base, values = ("queue", "model_name"), (queue, model)

        def family(kind, name, doc, extra=(), **kwargs):
            return kind(PREFIX + name, doc, base + extra, registry=self.registry, **kwargs)

        self._requests = family(Counter, "requests", "HTTP requests answered, by route, method and status",
                                ("route", "method", "status"))
        self._latency = family(Histogram, "request_duration_seconds",
                               "Request head to the end of the answer (a stream's whole length), by route",
                               ("route", "method"), buckets=LATENCY_BUCKETS)
        self.open_streams = family(Gauge, "open_streams", "Server-sent event streams being answered").labels(*values)
        self.open_connections = family(Gauge, "open_connections", "Client connections open").labels(*values)
        dropped = family(Counter, "connections_dropped", "Connections the gateway closed itself, by reason",
                         ("reason",))
        self._dropped = {reason: dropped.labels(*values, reason) for reason in DROP_REASONS}
        batches = family(Gauge, "batches", "Batches not yet final, by status (every gateway reports them all)",
                         ("status",))
        self._batches = {status: batches.labels(*values, status) for status in OPEN_BATCH_STATUSES}
        finished = family(Counter, "batches_finished", "Batches this gateway moved to a final status, by status",
                          ("status",))
        self._finished = {status: finished.labels(*values, status) for status in FINAL_BATCH_STATUSES}
        self._values = values

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self._requests.labels(*self._values, route, method, str(status)).inc()
        self._latency.labels(*self._values, route, method).observe(max(seconds, 0.0))

    def connection_dropped(self, reason: str) -> None:
        self._dropped[reason].inc()

    def set_open_batches(self, counts: dict[str, int]) -> None:
        """The open batches' statuses, as the last round of the batch keeper found them."""
        for status, gauge in self._batches.items():
            gauge.set(counts.get(status, 0))

    def batch_finished(self, status: str) -> None:
        self._finished[status].inc()

    def exposition(self) -> tuple[bytes, str]:
        """(The text format's body, its content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
