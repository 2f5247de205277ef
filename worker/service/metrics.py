"""Prometheus metrics with vLLM's names, served by a tiny HTTP server on asyncio.

No extra dependency: the text exposition format is a few lines. ``GET /metrics`` returns the
metrics, ``GET /healthz`` 200 while the worker is serving (503 once it drains or its last
checkpoint failed), anything else 404.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedq.worker.logging import get_logger

log = get_logger("pagedq.worker.metrics")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            acc += count
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {acc}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {self.n}')
        lines.append(f"{self.name}_sum{{{labels}}} {self.total}")
        lines.append(f"{self.name}_count{{{labels}}} {self.n}")
        return lines


class Metrics:
    """The worker's metrics; engine gauges/counters come from the latest engine stats."""

    def __init__(self, model: str):
        self.labels = f'model_name="{_esc(model)}"'
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time to first token (from admission).", TTFT_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.",
                             ITL_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency (from admission).", E2E_BUCKETS)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time from submission to admission by a worker.", E2E_BUCKETS)
        self.success: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.counters = {"pagedq:jobs_reclaimed_total": 0, "pagedq:jobs_dead_lettered_total": 0,
                         "pagedq:jobs_fenced_total": 0, "pagedq:jobs_handed_back_total": 0,
                         "pagedq:jobs_cancelled_total": 0, "vllm:prompt_tokens_total": 0}
        self.engine: dict[str, Any] = {}
        self.queue: dict[str, Any] = {}
        self.generation_tokens = 0

    def inc(self, name: str, by: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by

    def count_failure(self, code: str) -> None:
        """A request ended by an error event with protocol error ``code``."""
        self.failed[code] = self.failed.get(code, 0) + 1

    def render(self) -> str:
        L = self.labels
        e = self.engine
        lines: list[str] = []

        def metric(name: str, kind: str, value: Any, help_: str, extra: str = "") -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}",
                          f"{name}{{{L}{extra}}} {float(value or 0)}"])

        metric("vllm:num_requests_running", "gauge", e.get("running"),
               "Number of requests in model execution batches.")
        metric("vllm:num_requests_waiting", "gauge", e.get("waiting"),
               "Number of requests waiting to be processed.")
        metric("vllm:kv_cache_usage_perc", "gauge", e.get("kv_usage"),
               "KV-cache usage. 1 means 100 percent usage.")
        metric("vllm:num_preemptions_total", "counter", e.get("preemptions"),
               "Cumulative number of preemptions.")
        metric("vllm:prefix_cache_queries_total", "counter", e.get("prefix_cache_queries"),
               "Prefix cache queries, in prompt tokens looked up.")
        metric("vllm:prefix_cache_hits_total", "counter", e.get("prefix_cache_hits"),
               "Prefix cache hits, in prompt tokens found cached.")
        metric("vllm:generation_tokens_total", "counter", self.generation_tokens,
               "Number of generation tokens published.")
        for name, value in self.counters.items():
            metric(name, "counter", value, name.split(":")[1].replace("_", " ") + ".")
        lines += ["# HELP vllm:request_success_total Finished requests by finish reason.",
                  "# TYPE vllm:request_success_total counter"]
        for reason, count in sorted(self.success.items()):
            lines.append(f'vllm:request_success_total{{{L},finished_reason="{reason}"}} {count}')
        lines += ["# HELP pagedq:request_failed_total Requests ended by an error event.",
                  "# TYPE pagedq:request_failed_total counter"]
        for code, count in sorted(self.failed.items()):
            lines.append(f'pagedq:request_failed_total{{{L},code="{code}"}} {count}')
        lines += ["# HELP pagedq:queue_depth Jobs waiting in the queue (not yet delivered).",
                  "# TYPE pagedq:queue_depth gauge"]
        for key, value in sorted(self.queue.items()):
            if key.startswith("lag_"):
                lines.append(f'pagedq:queue_depth{{{L},level="{key[4:]}"}} {float(value)}')
        for hist in (self.ttft, self.itl, self.e2e, self.queue_time):
            lines += hist.render(L)
        return "\n".join(lines) + "\n"


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


class MetricsServer:
    """``GET /metrics`` and ``GET /healthz`` over plain asyncio streams."""

    def __init__(self, metrics: Metrics, healthy: Callable[[], bool], host: str, port: int):
        self.metrics = metrics
        self.healthy = healthy
        self.host = host
        self.port = port
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("metrics endpoint listening", url=f"http://{self.host}:{self.port}/metrics")
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            if path == "/metrics":
                status, body = "200 OK", self.metrics.render()
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            elif path == "/healthz":
                ok = self.healthy()
                status, body = ("200 OK", "ok\n") if ok else ("503 Service Unavailable", "no\n")
                ctype = "text/plain"
            else:
                status, body, ctype = "404 Not Found", "not found\n", "text/plain"
            data = body.encode()
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: "
                         f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
            await writer.drain()
        except (TimeoutError, ConnectionError, OSError):
            pass
        finally:
            writer.close()
