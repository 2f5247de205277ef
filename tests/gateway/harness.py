"""A real gateway for the tests: uvicorn on a loopback port, in a thread (or a process).

The HTTP client in every test is the official ``openai`` package (or plain httpx where the
test needs raw SSE bytes or odd requests).
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import openai
import uvicorn

from pagedq.embedded_redis import free_port
from pagedq.gateway.app import create_app
from pagedq.worker.config import GatewayConfig
from tests.service.harness import running_worker

try:  # the HTTP library the installed openai package is built on
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx


@dataclass
class Gateway:
    base: str  # http://127.0.0.1:PORT
    config: GatewayConfig

    def openai(self, key: str | None = None, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key or "none", max_retries=0,
                             timeout=kw.pop("timeout", 120), **kw)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=kw.pop("timeout", 120), **kw)


@contextmanager
def serve(redis_url: str, **overrides) -> Iterator[Gateway]:
    """A gateway in a thread of this process (its own event loop)."""
    fields = {"api_keys": (), "fleet_cache": 0.05, **overrides}
    config = GatewayConfig(redis_url=redis_url, port=free_port(), **fields)
    server = uvicorn.Server(uvicorn.Config(create_app(config, redis_url), host="127.0.0.1",
                                           port=config.port, log_level="warning",
                                           access_log=False, loop="asyncio",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the gateway did not start"
        time.sleep(0.02)
    try:
        yield Gateway(f"http://127.0.0.1:{config.port}", config)
    finally:
        server.should_exit = True
        thread.join(30)


def spawn_gateway(redis_url: str, log_path, *flags: str,
                  ca: str | None = None) -> tuple[subprocess.Popen, str]:
    """``pagedq serve`` as a process (for tests that SIGKILL the gateway). ``ca``: it serves
    HTTPS (``flags`` hold --ssl-certfile/--ssl-keyfile) with a certificate this CA signed."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedq.worker.cli", "serve", "--redis-url", redis_url,
           "--port", str(port), "--log-level", "WARNING", *flags]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
                            env=dict(os.environ))
    base = f"{'https' if ca else 'http'}://127.0.0.1:{port}"
    verify = ssl.create_default_context(cafile=ca) if ca else True
    end = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
        assert time.monotonic() < end, "the gateway did not start"
        try:
            if httpx.get(base + "/health", timeout=1, verify=verify).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def wait_until(cond, timeout: float = 60.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} not reached within {timeout}s"
        time.sleep(0.05)


@contextmanager
def serve_worker(redis_url: str, model: str, worker: str, queue: str) -> Iterator[Gateway]:
    """A gateway in front of one worker serving ``model`` on ``queue`` (1k tokens, 1k blocks)."""
    with running_worker(redis_url, model, worker, queue=queue,
                        engine={"max_model_len": 1024, "num_kv_blocks": 1024}):
        with serve(redis_url, queue=queue) as gateway:
            yield gateway
