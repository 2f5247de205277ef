"""The gateway's shared state: what every route reads, in one module the routes import.

``Gateway`` (one per app, built in the app's lifespan so it binds to uvicorn's loop) holds the
Redis pool, the SDK client, the fleet view, the stream readers, the file and batch stores and
the metrics; ``Tenant`` says whose request it is. app.py builds the app from the routes, and
the routes (completions.py, batch_api.py, tokenize.py) import this module, never app.py: the
imports only go one way.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aredis
from starlette.requests import Request

from pagedq.cancel import stop_tasks
from pagedq.client import AsyncClient
from pagedq.gateway.batch_store import BatchStore
from pagedq.gateway.batches import BatchDriver
from pagedq.gateway.files import DirFileStore, FileStore, RedisFileStore
from pagedq.gateway.fleet import Fleet
from pagedq.gateway.http_metrics import GatewayMetrics
from pagedq.gateway.sse import Readers
from pagedq.gateway.tokens import TokenTexts
from pagedq.logging import get_logger
from pagedq.redis_url import redis_connection_options
from pagedq.worker.config import GatewayConfig

log = get_logger("pagedq.gateway")
CLOSE_TIMEOUT_S = 5.0  # the bound on each step of a stop: a safety net, never the normal path


@dataclass
class Gateway:
    """Everything the routes share; one per app."""

    config: GatewayConfig
    r: aredis.Redis
    client: AsyncClient
    fleet: Fleet
    readers: Readers
    files: FileStore
    batches: BatchStore
    driver: BatchDriver
    tokens: TokenTexts
    metrics: GatewayMetrics
    tasks: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background coroutine, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @classmethod
    def build(cls, config: GatewayConfig, redis_url: str, metrics: GatewayMetrics) -> Gateway:
        pool = aredis.BlockingConnectionPool.from_url(  # wait for a connection, don't fail
            redis_url, max_connections=config.redis_max_connections,
            timeout=config.redis_pool_timeout, health_check_interval=30,
            **redis_connection_options(redis_url),
            **(config.tls.kwargs() if config.tls else {}))
        r = aredis.Redis.from_pool(pool)  # closes the pool with the client
        client = AsyncClient(queue=config.queue, prefix=config.prefix, ttl=config.ttl,
                             connection=r)
        fleet = Fleet(client, config.fleet_cache)
        files: FileStore = (DirFileStore(config.files_dir, config.files_ttl) if config.files_dir
                            else RedisFileStore(r, config.prefix, config.files_ttl))
        tokens = TokenTexts()
        driver = BatchDriver(r, client, files, fleet, tokens, config, metrics)
        return cls(config, r, client, fleet, Readers(r, client.keys, config.ttl), files,
                   driver.store, driver, tokens, metrics)

    async def close(self) -> None:
        """Stop the background tasks, then close Redis, each within CLOSE_TIMEOUT_S: a stop
        must end even when a task or a pooled connection does not answer."""
        self.driver.stop()
        await self._stop_tasks()
        try:
            await asyncio.wait_for(self.r.aclose(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("the Redis connections did not close in time")

    async def _stop_tasks(self) -> None:
        """Cancel the background tasks until they end (pagedq.cancel: one cancel is not enough
        on Python 3.11; the batch driver, polling Redis, lost its cancel and ran on)."""
        pending = await stop_tasks(self.tasks, CLOSE_TIMEOUT_S)
        if pending:
            log.warning("background tasks did not stop", tasks=len(pending))


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


@dataclass(frozen=True)
class Tenant:
    """Who made a request: ``owner`` is its API key's fingerprint ("" on an open gateway);
    files, batches and streams carry their owner, and only it (or an admin key) sees them."""

    owner: str = ""
    admin: bool = False

    def sees(self, owner: str) -> bool:
        return self.admin or hmac.compare_digest(owner, self.owner)


OPEN = Tenant("", admin=True)  # no keys configured: one trust domain, as before
TENANT = "pagedq.tenant"  # the scope key the middleware sets


def key_owner(key: bytes) -> str:
    """A key's tenant id: a fingerprint, so Redis never holds the key itself."""
    return "key-" + hashlib.sha256(key).hexdigest()[:24]


def tenant(request: Request) -> Tenant:
    return request.scope.get(TENANT, OPEN)
