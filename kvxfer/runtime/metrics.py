"""Prometheus metrics of a receive service, through the standard ``prometheus_client`` library.

Each service owns a ``CollectorRegistry`` (never the process-global one, so many services can live in one
process, as in tests): request counters and gauges are read from the consumer's own ledger at scrape time
(one source of truth, nothing counted twice), and the transfer time is a histogram observed per hand-off.
Expose it with ``prometheus_client.start_http_server(port, registry=service.metrics.registry)`` or serve
``service.metrics.exposition()`` from the runtime's own HTTP endpoint.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    HAVE_PROMETHEUS = True
except ImportError:  # pragma: no cover - the metrics extra is optional
    HAVE_PROMETHEUS = False

# transfer seconds: from admission to hand-off (sub-millisecond on NVLink up to seconds for 128k tokens on TCP)
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_COUNTERS = {
    "admitted": "Requests admitted (blocks granted)",
    "rejected": "Requests refused at admission (busy or invalid)",
    "completed": "Requests received completely and handed to the runtime",
    "failed": "Admitted requests that failed, were cancelled or timed out",
}


class _LedgerCollector:
    def __init__(self, stats: Callable[[], dict], prefix: str):
        self.stats = stats
        self.prefix = prefix

    def collect(self):
        s = self.stats()
        p = self.prefix
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"{p}_requests_{name}", doc, value=s[name])
        yield CounterMetricFamily(f"{p}_received_bytes", "KV bytes received into handed-off requests", value=s["bytes"])
        yield GaugeMetricFamily(f"{p}_requests_inflight", "Admitted requests still receiving", value=s["inflight"])
        yield GaugeMetricFamily(
            f"{p}_requests_handed", "Handed-off requests whose blocks the runtime holds", value=s["handed"]
        )
        yield GaugeMetricFamily(
            f"{p}_free_blocks", "Free blocks in the runtime's allocator (-1: unknown)", value=s["free_blocks"]
        )


class ServiceMetrics:
    """A private registry with the service's metrics; ``exposition()`` is the Prometheus text format."""

    def __init__(self, stats: Callable[[], dict], prefix: str = "kvxfer_receive", registry=None):
        if not HAVE_PROMETHEUS:
            raise ImportError("metrics need prometheus-client (pip install 'kvxfer[metrics]')")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry.register(_LedgerCollector(stats, prefix))
        self.transfer_seconds = Histogram(
            f"{prefix}_transfer_seconds",
            "Admission to hand-off time of completed requests",
            buckets=BUCKETS,
            registry=self.registry,
        )

    def observe(self, seconds: float) -> None:
        self.transfer_seconds.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict | None = None) -> float | None:
        """One sample's value by its exposed name (``kvxfer_receive_requests_completed_total``, ...)."""
        return self.registry.get_sample_value(name, labels or {})
