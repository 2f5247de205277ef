"""The ``gateway`` scenario: the mixed (throughput) trace through ``pagedq serve``'s HTTP
streaming API against the same trace through the SDK, on one worker process.

What it measures is what the gateway adds:

- throughput: output tok/s over HTTP streaming / tok/s through the SDK (target >= 0.95). Both
  paths submit every request of the trace at once and stream every answer. A first SDK run
  warms the worker (its per-shape kernel caches) and is discarded; then SDK, HTTP, SDK, and the
  baseline is the mean of the two SDK runs, so a drift of the machine's speed cancels to first
  order.
- added p50 TTFT (target <= 10 ms): single short requests, one at a time, alternating HTTP and
  SDK, each timed from sending the request to its first token as the client sees it (the first
  TOKENS event, or the first content chunk). Under the full trace TTFT is mostly waiting for
  other prompts' prefill, which would drown the gateway's share; alone it is what remains.

The gateway is its own process, like in production.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import redis.asyncio as aredis

from pagedq.bench.context import BenchContext, Unavailable
from pagedq.bench.queue_path import _wait_ready, check_dependencies, redis_url, worker_process
from pagedq.bench.workload import BenchRequest
from pagedq.client import AsyncClient, Client
from pagedq.embedded_redis import free_port
from pagedq.params import SamplingParams
from pagedq.processes import stop_process
from pagedq.worker.config import QueueConfig
from pagedq.worker.config_flags import to_flags

GATEWAY_READY_S = 120.0
TTFT_PROBES = 12  # single requests per path for the added-TTFT figure


def _unavailable(why: str) -> Exception:
    return Unavailable(why)


def _http_module() -> Any:
    try:
        # optional: httpx comes with the openai package (the dev extra)
        import httpx2 as httpx
    except ImportError:
        try:
            import httpx  # optional, as above
        except ImportError as exc:
            raise _unavailable("no httpx (install the openai package)") from exc
    return httpx


def start_gateway(queue: QueueConfig, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedq.worker.cli", "serve", *to_flags(queue),
           "--port", str(port), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    httpx = _http_module()
    end = time.monotonic() + GATEWAY_READY_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}: "
                               f"{log_path.read_text(errors='replace')[-1500:]}")
        try:
            if httpx.get(base + "/health", timeout=1).json().get("workers"):
                return proc, base
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > end:
            raise RuntimeError("the gateway did not become ready")
        time.sleep(0.2)


async def run_sdk(queue: QueueConfig, trace: list[BenchRequest]) -> dict[str, Any]:
    url = str(queue.redis_url)
    async with AsyncClient(url, **queue.client_options()) as client:
        tls = queue.tls.kwargs() if queue.tls else {}
        client.redis = aredis.Redis.from_url(url, max_connections=len(trace) + 16, **tls)
        began = perf_counter()

        async def one(req: BenchRequest) -> tuple[float, int, str]:
            sent = perf_counter()
            handle = await client.submit(req.prompt_token_ids, req.params())
            first, tokens, text = None, 0, ""
            async for ev in handle.stream(timeout=600):
                if ev.token_ids and first is None:
                    first = perf_counter() - sent
                tokens += len(ev.token_ids)
                text += ev.text
            return first or 0.0, tokens, text

        rows = await asyncio.gather(*(one(r) for r in trace))
        elapsed = perf_counter() - began
        await client.redis.aclose()
    return _summary(rows, elapsed)


async def run_http(base: str, model: str, trace: list[BenchRequest]) -> dict[str, Any]:
    httpx = _http_module()
    limits = httpx.Limits(max_connections=len(trace) + 8, max_keepalive_connections=len(trace))
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        began = perf_counter()

        async def one(req: BenchRequest) -> tuple[float, int, str]:
            body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            sent = perf_counter()
            first, tokens, text = None, 0, ""
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk["choices"]:
                        if first is None:
                            first = perf_counter() - sent
                        text += choice["text"]
            return first or 0.0, tokens, text

        rows = await asyncio.gather(*(one(r) for r in trace))
        elapsed = perf_counter() - began
    return _summary(rows, elapsed)


async def ttft_probe(queue: QueueConfig, base: str, model: str,
                     prompts: list[tuple[list[int], list[int]]]) -> dict[str, list[float]]:
    """Each pair's first prompt alone through HTTP, then its second through the SDK: seconds to
    the first token. The two prompts differ, so neither path finds the other's prompt in the
    prefix cache (a repeated prompt would prefill only its last block)."""
    httpx = _http_module()
    out: dict[str, list[float]] = {"http": [], "sdk": []}
    async with AsyncClient(queue.redis_url, **queue.client_options()) as client, \
            httpx.AsyncClient(base_url=base, timeout=600) as http:
        for prompt, sdk_prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "stream": True}
            sent = perf_counter()
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        out["http"].append(perf_counter() - sent)
                        break
            sent = perf_counter()
            handle = await client.submit(sdk_prompt, SamplingParams(temperature=0, max_tokens=1))
            async for ev in handle.stream(timeout=600):
                if ev.token_ids:
                    out["sdk"].append(perf_counter() - sent)
                    break
    return out


def _summary(rows: list[tuple[float, int, str]], elapsed: float) -> dict[str, Any]:
    ttfts = [r[0] for r in rows]
    tokens = sum(r[1] for r in rows)
    return {"tokens_per_s": tokens / elapsed, "output_tokens": tokens, "elapsed_s": elapsed,
            "ttft_p50_s": float(np.median(ttfts)), "ttft_p90_s": float(np.percentile(ttfts, 90)),
            "texts": [r[2] for r in rows]}


def serve_through_gateway(bench: BenchContext, trace: list[BenchRequest]) -> dict[str, Any]:
    """SDK, HTTP, SDK on one worker; the figures and their provenance."""
    check_dependencies()
    _http_module()
    rng = np.random.default_rng(bench.config.seed + 1)
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-gw-") as tmp, \
            redis_url(bench.config.redis_url) as url:
        tmp_path = Path(tmp)
        queue = bench.config.run_queue(url, "gateway")
        with worker_process(bench, queue, tmp_path / "worker.log") as proc:
            with Client(url, **queue.client_options()) as cl:
                warmup = BenchRequest("warmup", list(range(bench.space.low,
                                                           bench.space.low + 16)), 4)
                _wait_ready(cl, proc, warmup, tmp_path / "worker.log")
            gateway, base = start_gateway(queue, tmp_path / "gateway.log")
            try:
                httpx = _http_module()
                model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
                asyncio.run(run_http(base, model, trace[:2]))  # connections and code paths warm
                asyncio.run(run_sdk(queue, trace))  # the worker's per-shape caches warm
                sdk_before = asyncio.run(run_sdk(queue, trace))
                http = asyncio.run(run_http(base, model, trace))
                sdk_after = asyncio.run(run_sdk(queue, trace))
                probes = [(bench.space.sample(rng, 16), bench.space.sample(rng, 16))
                          for _ in range(TTFT_PROBES)]
                ttft = asyncio.run(ttft_probe(queue, base, model, probes))
            finally:
                stop_process(gateway)
    sdk_tok_s = (sdk_before["tokens_per_s"] + sdk_after["tokens_per_s"]) / 2
    http_ttft, sdk_ttft = float(np.median(ttft["http"])), float(np.median(ttft["sdk"]))
    return {"http": {k: v for k, v in http.items() if k != "texts"},
            "sdk_before": {k: v for k, v in sdk_before.items() if k != "texts"},
            "sdk_after": {k: v for k, v in sdk_after.items() if k != "texts"},
            "sdk_tok_s_baseline": sdk_tok_s,
            "throughput_vs_sdk": http["tokens_per_s"] / sdk_tok_s,
            "single_ttft_p50_s": {"http": http_ttft, "sdk": sdk_ttft},
            "single_ttft_s": ttft,
            "added_ttft_p50_ms": 1000 * (http_ttft - sdk_ttft),
            "texts_equal": http["texts"] == sdk_before["texts"],
            "requests": len(trace)}
