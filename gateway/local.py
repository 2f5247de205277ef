"""``pagedq serve`` and ``pagedq batch`` with no Redis: an embedded redis-server and one worker
process on the default model, as ``pagedq demo`` starts, so one command works on a bare
machine. The worker is a separate process (no GIL shared with the HTTP server) that dies with
the gateway.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pagedq.embedded_redis import (
    EmbeddedRedis,
    _detach,
    advertise,
    find_advertised,
    withdraw,
)
from pagedq.logging import get_logger
from pagedq.processes import stop_process
from pagedq.redis_url import resolve_redis_url
from pagedq.worker.cli.flags import to_flags
from pagedq.worker.config import EngineConfig

log = get_logger("pagedq.gateway.local")


@contextmanager
def queue_stack(redis_url: str | None, queue: str, prefix: str,
                engine: EngineConfig | None = None,
                until_loaded: str = "requests get 503 until then",
                worker_log_level: str = "WARNING") -> Iterator[str]:
    """The Redis URL to use: the given one (or $REDIS_URL), else the embedded Redis a local
    `pagedq worker` advertises, else a local Redis + worker running ``engine`` (every engine
    flag `serve` and `batch` were given; advertised in turn, so `pagedq submit`/`stats` and more
    workers find it). ``until_loaded``: what the command's user sees while the worker loads;
    ``worker_log_level``: what of its log reaches them."""
    url = resolve_redis_url(redis_url, default=None) or find_advertised()
    if url is not None:
        yield url
        return
    with EmbeddedRedis.start() as server, advertised(server):
        cmd = [sys.executable, "-m", "pagedq.worker", "--redis-url", server.url, "--queue",
               queue, "--prefix", prefix, "--consumer-name", "local", "--log-format", "console",
               "--log-level", worker_log_level]
        cmd += to_flags(engine) if engine else []
        worker = subprocess.Popen(cmd, preexec_fn=_detach)
        log.warning("no --redis-url or REDIS_URL: started an embedded redis-server and one "
                    f"worker (the model loads in the background; {until_loaded})",
                    redis=server.url, worker_pid=worker.pid,
                    model=(engine.model if engine else None) or "default")
        try:
            yield server.url
        finally:
            stop_process(worker)


@contextmanager
def advertised(server: EmbeddedRedis) -> Iterator[None]:
    path = advertise(server)
    try:
        yield
    finally:
        withdraw(path)
