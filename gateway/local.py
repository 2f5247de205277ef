"""``pagedq serve`` and ``pagedq batch`` with no Redis: an embedded redis-server and one worker
process on the default model, as ``pagedq demo`` starts, so one command works on a bare
machine. The worker is a separate process (no GIL shared with the HTTP server) that dies with
the gateway. The Redis listens on a unix socket only this user can reach, with a password and a
``maxmemory`` (pagedq/embedded_redis.py).

This module imports only the ground floor (pagedq/): the worker's flags arrive already written
out (commands.py writes them from the engine config), so the gateway never imports the
worker's CLI to start one.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from pagedq.embedded_redis import EmbeddedRedis, advertised, detach_child, find_advertised
from pagedq.logging import get_logger
from pagedq.processes import stop_process
from pagedq.redis_url import resolve_redis_url

log = get_logger("pagedq.gateway.local")


@contextmanager
def queue_stack(redis_url: str | None, queue: str, prefix: str,
                worker_flags: Sequence[str] = (),
                until_loaded: str = "requests get 503 until then",
                worker_log_level: str = "WARNING", model: str | None = None) -> Iterator[str]:
    """The Redis URL to use: the given one (or $REDIS_URL), else the embedded Redis a local
    `pagedq worker` advertises, else a local Redis + worker started with ``worker_flags`` (every
    engine flag `serve` and `batch` were given; advertised in turn, so `pagedq submit`/`stats`
    and more workers find it). ``until_loaded``: what the command's user sees while the worker
    loads; ``worker_log_level``: what of its log reaches them; ``model``: named in the log."""
    url = resolve_redis_url(redis_url, default=None) or find_advertised()
    if url is not None:
        yield url
        return
    with EmbeddedRedis.start(unix_socket=True) as server, advertised(server):
        cmd = [sys.executable, "-m", "pagedq.worker", "--redis-url", server.url, "--queue",
               queue, "--prefix", prefix, "--consumer-name", "local", "--log-format", "console",
               "--log-level", worker_log_level]
        worker = subprocess.Popen([*cmd, *worker_flags], preexec_fn=detach_child)
        log.warning("no --redis-url or REDIS_URL: started an embedded redis-server and one "
                    f"worker (the model loads in the background; {until_loaded})",
                    redis=server.url, worker_pid=worker.pid, model=model or "default")
        try:
            yield server.url
        finally:
            stop_process(worker)
