"""Prometheus metrics with vLLM's names, served by prometheus-client on a thread of its own.

``GET /metrics`` returns the metrics, ``GET /healthz`` 200 while the worker is serving (503
once it drains, while Redis is away, or when its last checkpoint failed), anything else 404.
The server listens on 127.0.0.1 unless told otherwise: it has no authentication. Each
connection is served on its own thread with a socket timeout, so a slow client holds nothing
up, and an oversized request line gets an HTTP error, not a traceback. The ``model_name`` label
is the model's name, never its path.
"""

from __future__ import annotations

import asyncio
import socketserver
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedq.logging import get_logger

log = get_logger("pagedq.worker.metrics")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)
REQUEST_TIMEOUT_S = 5.0  # a connection that sends nothing for this long is closed

# engine gauges and counters: (metric name, kind, engine stats key, help)
ENGINE_METRICS = (
    ("vllm:num_requests_running", "gauge", "running",
     "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "gauge", "kv_usage", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:num_preemptions_total", "counter", "preemptions", "Cumulative number of preemptions."),
    ("vllm:prefix_cache_queries_total", "counter", "prefix_cache_queries",
     "Prefix cache queries, in prompt tokens looked up."),
    ("vllm:prefix_cache_hits_total", "counter", "prefix_cache_hits",
     "Prefix cache hits, in prompt tokens found cached."),
    ("vllm:spec_decode_num_drafts_total", "counter", "spec_decode_num_drafts",
     "Number of spec decoding drafts (one per sequence and step that verified a draft)."),
    ("vllm:spec_decode_num_draft_tokens_total", "counter", "spec_decode_num_draft_tokens",
     "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter", "spec_decode_num_accepted_tokens",
     "Number of accepted tokens."),
)


def model_label(model: str) -> str:
    """The model's name for a label: a path's last part (paths stay private)."""
    return Path(str(model)).name or str(model)


class Metrics:
    """The worker's metrics; engine gauges/counters come from the latest engine stats."""

    def __init__(self, model: str):
        self.model = model_label(model)
        self.registry = CollectorRegistry(auto_describe=True)

        def histogram(name: str, help_: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, help_, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(self.model)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time to first token (from admission).", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency (from admission).", E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time from submission to admission by a worker.", E2E_BUCKETS)
        self.success: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.counters = {"pagedq:jobs_reclaimed_total": 0, "pagedq:jobs_dead_lettered_total": 0,
                         "pagedq:jobs_fenced_total": 0, "pagedq:jobs_handed_back_total": 0,
                         "pagedq:jobs_cancelled_total": 0,
                         "pagedq:engine_step_failures_total": 0, "vllm:prompt_tokens_total": 0}
        self.engine: dict[str, Any] = {}
        self.queue: dict[str, Any] = {}
        self.generation_tokens = 0
        self.registry.register(_Snapshot(self))

    def inc(self, name: str, by: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    def count_failure(self, code: str) -> None:
        """A request ended by an error event with protocol error ``code``."""
        self.failed[code] = self.failed.get(code, 0) + 1

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _Snapshot:
    """A prometheus-client collector: the counters and gauges as the worker last saw them."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # collected on each scrape, never registered by name

    def collect(self) -> Iterator[Metric]:
        m, labels = self.m, ["model_name"]
        for name, kind, key, help_ in ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, help_, labels=labels)
            family.add_metric([m.model], float(m.engine.get(key) or 0))
            yield family
        yield _counter("vllm:generation_tokens_total", "Number of generation tokens published.",
                       labels, [([m.model], m.generation_tokens)])
        for name, value in m.counters.items():
            yield _counter(name, name.split(":")[1].replace("_", " ") + ".", labels,
                           [([m.model], value)])
        yield _counter("vllm:request_success_total", "Finished requests by finish reason.",
                       [*labels, "finished_reason"],
                       [([m.model, r], c) for r, c in sorted(m.success.items())])
        yield _counter("pagedq:request_failed_total", "Requests ended by an error event.",
                       [*labels, "code"], [([m.model, c], n) for c, n in sorted(m.failed.items())])
        depth = GaugeMetricFamily("pagedq:queue_depth",
                                  "Jobs waiting in the queue (not yet delivered).",
                                  labels=[*labels, "level"])
        for key, value in sorted(m.queue.items()):
            if key.startswith("lag_"):
                depth.add_metric([m.model, key[4:]], float(value))
        yield depth


def _counter(name: str, help_: str, labels: list[str],
             values: list[tuple[list[str], float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_, labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, float(value))
    return family


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


class MetricsServer:
    """``GET /metrics`` and ``GET /healthz`` on a prometheus-client WSGI app."""

    def __init__(self, metrics: Metrics, healthy: Callable[[], bool], host: str, port: int):
        self.metrics = metrics
        self.healthy = healthy
        self.host = host
        self.port = port
        self.server: WSGIServer | None = None
        self._metrics_app = make_wsgi_app(metrics.registry)

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if path == "/healthz":
            ok = self.healthy()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"no\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    async def start(self) -> int:
        self.server = make_server(self.host, self.port, self.app, server_class=_ThreadingServer,
                                  handler_class=_QuietHandler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="pagedq-metrics",
                         daemon=True).start()
        log.info("metrics endpoint listening", url=f"http://{self.host}:{self.port}/metrics")
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            await asyncio.to_thread(self.server.shutdown)
            self.server.server_close()
