"""The gateway's Prometheus metrics (prometheus-client, one registry per app).

Request counts and latencies per route and status; time to the first streamed token as the
HTTP client sees it; open streams; streams cancelled after their grace; batch lines by result.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 (re-exported)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedq_gateway_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.latency = Histogram("pagedq_gateway_request_seconds",
                                 "HTTP request latency (to the end of the body) by route.",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("pagedq_gateway_time_to_first_token_seconds",
                              "From request arrival to the first streamed token chunk.",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.streams = Gauge("pagedq_gateway_open_streams", "SSE streams open now.", registry=r)
        self.abandoned = Counter("pagedq_gateway_abandoned_streams",
                                 "Streams dropped and not resumed within the grace: their "
                                 "jobs were cancelled.", registry=r)
        self.batch_lines = Counter("pagedq_gateway_batch_lines", "Batch lines by result.",
                                   ["result"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
