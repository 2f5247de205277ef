"""Which Redis to use: the one rule every pagedq command and the SDK follow.

This is the only place pagedq's client side reads the environment. The rule: an explicit URL,
else ``$REDIS_URL``, else (for the SDK and ``pagedq submit/stats``) the embedded redis-server a
``pagedq worker`` on this machine advertises, else Redis on localhost's default port.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import overload
from urllib.parse import unquote, urlsplit

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
# Where a worker that started an embedded redis-server writes its URL, in the pagedq cache.
ADVERTISED_FILE = "embedded-redis.json"


@overload
def resolve_redis_url(url: str | None) -> str: ...
@overload
def resolve_redis_url(url: str | None, default: str) -> str: ...
@overload
def resolve_redis_url(url: str | None, default: None) -> str | None: ...


def resolve_redis_url(url: str | None, default: str | None = DEFAULT_REDIS_URL) -> str | None:
    """The URL given, else ``$REDIS_URL``, else ``default``.

    An explicit URL (a flag, an argument) always wins over the environment. Only the fallback
    depends on who asks, and the caller names it: the SDK uses ``client_redis_url`` (which
    looks for a local worker's embedded server before localhost's default port);
    ``pagedq worker`` passes ``default=None`` and then starts an embedded redis-server, so a
    worker runs out of the box on a laptop.
    """
    return url or os.environ.get("REDIS_URL") or default


def client_redis_url(url: str | None) -> str:
    """The Redis a client uses (``Client()``, ``AsyncClient()``, ``pagedq submit/stats``): the
    URL given, else ``$REDIS_URL``, else the embedded server a ``pagedq worker`` on this machine
    advertises, else ``DEFAULT_REDIS_URL``. So the README's ``pagedq worker`` in one terminal
    and ``Client()`` in another find each other."""
    return resolve_redis_url(url, default=None) or find_advertised() or DEFAULT_REDIS_URL


def pagedq_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """pagedq's cache: ``$PAGEDQ_CACHE``, else ``~/.cache/pagedq`` (the worker's
    ``Settings.cache_dir`` is this)."""
    value = env.get("PAGEDQ_CACHE")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "pagedq"


def advertised_path() -> Path:
    """Where a worker that started an embedded redis-server writes its URL."""
    return pagedq_cache_dir() / ADVERTISED_FILE


def find_advertised(path: Path | None = None, timeout: float = 0.5) -> str | None:
    """The URL of the embedded redis-server a worker on this machine advertises, if it still
    answers PING (with the password the URL carries); None otherwise (a stale advertisement is
    ignored)."""
    path = path or advertised_path()
    try:
        url = json.loads(path.read_text())["url"]
        address, password = _local_address(url)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return url if answers_ping(address, timeout, password) else None


def _local_address(url: str) -> tuple[int | str, str]:
    """An advertised URL's (port or unix socket path, password): ``redis://:PW@127.0.0.1:PORT/0``
    or ``unix://:PW@/PATH?db=0``."""
    parts = urlsplit(url)
    password = unquote(parts.password or "")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("a unix URL without a path")
        return unquote(parts.path), password
    if parts.port is None:
        raise ValueError("no port")
    return parts.port, password


def redis_connection_options(url: str) -> dict[str, bool]:
    """Options for redis-py's ``from_url`` that only a TCP connection takes (a unix socket's
    connection refuses ``socket_keepalive``)."""
    return {} if url.startswith("unix:") else {"socket_keepalive": True}


def answers_ping(address: int | str, timeout: float, password: str = "") -> bool:
    """Whether a Redis on 127.0.0.1:``address`` (a port) or on the unix socket ``address`` (a
    path) answers PING (after AUTH when ``password``)."""
    auth = f"AUTH {password}\r\n".encode() if password else b""
    try:
        with _connect(address, timeout) as s:
            s.settimeout(timeout)
            s.sendall(auth + b"PING\r\n")
            reply = b""
            while reply.count(b"\r\n") < (2 if auth else 1):
                chunk = s.recv(64)
                if not chunk:
                    break
                reply += chunk
            return reply.endswith(b"+PONG\r\n")
    except OSError:
        return False


def _connect(address: int | str, timeout: float) -> socket.socket:
    if isinstance(address, int):
        return socket.create_connection(("127.0.0.1", address), timeout=timeout)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(address)
    except OSError:
        s.close()
        raise
    return s
