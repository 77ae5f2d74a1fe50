"""What a worker reports: the periodic stats line of a busy worker (as vLLM logs its engine's) and the
Prometheus metrics hooks."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("redline.worker")

STATS_LOG_INTERVAL_S = 10.0  # one line this often while busy; none while idle


class StatsLog:
    """The periodic INFO line of a busy worker: jobs done, sequences, generation speed, KV cache, queue."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.steps = self.done = self.total_done = self.generated = 0
        self.last = None  # the latest step's StepStats

    def observe(self, result) -> None:
        finished = sum(1 for o in result.outputs if o.finished)
        self.steps += 1
        self.done += finished
        self.total_done += finished
        self.generated += result.stats.num_decode_tokens
        self.last = result.stats

    def maybe_log(self, queue_waiting: int | None) -> None:
        now = time.monotonic()
        if now - self.since < STATS_LOG_INTERVAL_S:
            return
        if self.steps:  # no line for an idle interval
            s = self.last
            log.info("%d jobs done (%d in all); running %d, waiting %d sequences; generation %.1f tok/s; "
                     "KV cache %.1f%% used; queue %s entries waiting", self.done, self.total_done, s.num_running,
                     s.num_waiting, self.generated / (now - self.since), 100 * s.kv_cache_usage,
                     "?" if queue_waiting is None else queue_waiting)
        self.since, self.steps, self.done, self.generated = now, 0, 0, 0


class NullMetrics:
    """Stands in when monitoring is not installed: every hook does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def make_metrics(settings, model_name: str):
    try:
        from monitoring.metrics import Metrics, start_metrics_server
    except ImportError:
        if settings.metrics_port:
            log.warning("monitoring.metrics is not importable; no metrics on port %s", settings.metrics_port)
        return NullMetrics()
    metrics = Metrics(queue=settings.queue, model=model_name)
    if settings.metrics_port:
        start_metrics_server(settings.metrics_port, metrics)
        log.info("metrics on :%d/metrics", settings.metrics_port)
    return metrics
