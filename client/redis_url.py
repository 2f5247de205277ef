"""Which Redis to use: the one rule every pagedq command and the SDK follow.

This is the only place pagedq's client side reads the environment.
"""

from __future__ import annotations

import os
from typing import overload

DEFAULT_REDIS_URL = "redis://localhost:6379/0"


@overload
def resolve_redis_url(url: str | None) -> str: ...
@overload
def resolve_redis_url(url: str | None, default: str) -> str: ...
@overload
def resolve_redis_url(url: str | None, default: None) -> str | None: ...


def resolve_redis_url(url: str | None, default: str | None = DEFAULT_REDIS_URL) -> str | None:
    """The URL given, else ``$REDIS_URL``, else ``default``.

    An explicit URL (a flag, an argument) always wins over the environment. Only the fallback
    depends on who asks, and the caller names it: the SDK (``Client``, ``AsyncClient``,
    ``pagedq submit/stats``) falls back to a Redis on localhost's default port;
    ``pagedq worker`` passes ``default=None`` and then starts an embedded redis-server, so a
    worker runs out of the box on a laptop.
    """
    return url or os.environ.get("REDIS_URL") or default


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***``, for messages and logs."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()
