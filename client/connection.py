"""Connecting to Redis: one place that turns a URL (and TLS files) into a redis-py client.

The URL names a standalone server or any node of a Redis Cluster; which one is asked once
(``HELLO``'s ``mode``), so ``--redis-url redis://node-1:7000`` works for both, and the cluster
client follows the slots from there. ``rediss://`` is TLS; ``TLSFiles`` adds a private CA and a
client certificate (mutual TLS), or the URL carries them as redis-py query arguments
(``?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...``). Credentials ride in the URL
(``redis://user:password@host``) and never reach a log line (``redact_url``, from the ground
floor's pagedq/redact.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import BusyLoadingError, ConnectionError, RedisError, TimeoutError
from redis.retry import Retry

from pagedq.redact import redact_url as redact_url  # re-exported: its home was here

# Errors worth a retry: the server is away, restarting or still loading its data.
TRANSIENT = (ConnectionError, TimeoutError, BusyLoadingError)
SDK_RETRIES = 8  # ~10 s of backoff (50 ms doubling to 2 s) before a command gives up
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
PROBE_TIMEOUT_S = 5.0
# A client's connections to a standalone Redis: calls beyond this many at once wait for a free
# one (up to POOL_WAIT_S, then ConnectionError) instead of failing at once. redis-py 8's pool
# caps at 100 and raises MaxConnectionsError past it: 200 concurrent AsyncClient.submit calls
# failed on a fast CPU, where they all reach the pool before any returns its connection.
POOL_CONNECTIONS = 100
POOL_WAIT_S = 30.0



@dataclass(frozen=True)
class TLSFiles:
    """Files for a TLS connection (``rediss://``): a private CA, and a client certificate for
    servers that ask for one (``tls-auth-clients yes``)."""

    ca: str | None = None
    """CA certificate bundle the server's certificate must chain to (default: the system's)."""
    cert: str | None = None
    """Client certificate (PEM), for mutual TLS."""
    key: str | None = None
    """The client certificate's private key (PEM)."""

    def kwargs(self) -> dict[str, Any]:
        out = {"ssl_ca_certs": self.ca, "ssl_certfile": self.cert, "ssl_keyfile": self.key}
        return {k: v for k, v in out.items() if v}


def _retry(retries: int, aio: bool) -> Retry | AsyncRetry:
    """``retries`` tries with backoff on TRANSIENT errors; ``aio``: redis.asyncio's class
    (redis-py 8 warns when an asyncio client is given the blocking one)."""
    return (AsyncRetry if aio else Retry)(
        ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries,
        supported_errors=TRANSIENT)


def sdk_retry(aio: bool = False) -> Retry | AsyncRetry:
    """The SDK's retry: a command waits out a short outage (a Redis restart), then raises."""
    return _retry(SDK_RETRIES, aio)


def no_retry(aio: bool = False) -> Retry | AsyncRetry:
    """For callers that handle outages themselves and must see each one."""
    return _retry(0, aio)


def _options(tls: TLSFiles | None, extra: dict[str, Any]) -> dict[str, Any]:
    return {**(tls.kwargs() if tls else {}), **extra}


def is_cluster(url: str, tls: TLSFiles | None = None) -> bool:
    """Whether ``url`` names a Redis Cluster node (HELLO reports ``mode: cluster``).

    Asked on a connection of its own, closed at once. A server that does not answer HELLO
    (before Redis 6, or an ACL that denies it) is taken for a standalone one.
    """
    probe = redis.Redis.from_url(url, socket_timeout=PROBE_TIMEOUT_S,
                                 socket_connect_timeout=PROBE_TIMEOUT_S, **_options(tls, {}))
    try:
        reply = probe.execute_command("HELLO")
    except (ConnectionError, TimeoutError):
        raise
    except RedisError:
        return False
    finally:
        probe.close()
    if isinstance(reply, list):  # RESP2 without redis-py's callback: a flat key/value list
        reply = dict(zip(reply[::2], reply[1::2], strict=False))
    mode = reply.get(b"mode", reply.get("mode")) if isinstance(reply, dict) else None
    return mode in (b"cluster", "cluster")


def connect(url: str, tls: TLSFiles | None = None, **kwargs: Any) -> Any:
    """A blocking client for ``url``: ``redis.Redis`` or ``redis.cluster.RedisCluster``."""
    options = _options(tls, {"retry": sdk_retry(), **kwargs})
    if is_cluster(url, tls):
        return RedisCluster.from_url(url, **options)
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=POOL_CONNECTIONS,
                                                 timeout=POOL_WAIT_S, **options)
    return redis.Redis.from_pool(pool)  # closes the pool with the client


async def aconnect(url: str, tls: TLSFiles | None = None, **kwargs: Any) -> Any:
    """An asyncio client for ``url``: ``redis.asyncio.Redis`` or its ``RedisCluster``."""
    options = _options(tls, {"retry": sdk_retry(aio=True), **kwargs})
    if await asyncio.to_thread(is_cluster, url, tls):
        return AsyncRedisCluster.from_url(url, **options)
    pool = aredis.BlockingConnectionPool.from_url(url, max_connections=POOL_CONNECTIONS,
                                                  timeout=POOL_WAIT_S, **options)
    return aredis.Redis.from_pool(pool)  # closes the pool with the client
