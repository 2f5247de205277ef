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
        address = url.split("://", 1)[1].split("/", 1)[0]
        password = address.rsplit("@", 1)[0].lstrip(":") if "@" in address else ""
        port = int(address.rsplit(":", 1)[1])
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return url if answers_ping(port, timeout, password) else None


def answers_ping(port: int, timeout: float, password: str = "") -> bool:
    """Whether a Redis on 127.0.0.1:``port`` answers PING (after AUTH when ``password``)."""
    auth = f"AUTH {password}\r\n".encode() if password else b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
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
