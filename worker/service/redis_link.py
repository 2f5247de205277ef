"""The worker's Redis connection: one client whose Retry rides outages, and the embedded
redis-server when no Redis is named.

Every Redis call of the worker goes through redis-py's own Retry (exponential backoff, no
attempt limit) on connection errors and timeouts, so no task carries a retry loop of its own
and a Redis restart costs waiting, never a lost event: the engine keeps stepping, the outbox
keeps its events, and every call completes once Redis is back (publishes are idempotent).
An outage is logged once when the first call fails and once when a call succeeds again,
however many tasks were waiting.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

from pagedq.worker.logging import get_logger
from pagedq.worker.service.embedded_redis import (
    EmbeddedRedis,
    advertise,
    find_advertised,
    withdraw,
)

log = get_logger("pagedq.worker.redis")

BACKOFF_BASE_S = 0.05  # the first retry waits about this long...
BACKOFF_CAP_S = 2.0  # ...and the waits double up to this
# At start-up an unreachable Redis is a mistake in the configuration, not an outage: the
# worker gives up after this long and exits 1.
CONNECT_TIMEOUT_S = 10.0


class Outage:
    """Whether Redis answers, as the worker's last call saw it; each change is logged once.

    redis-py deep-copies the Retry into every connection, and every copy must report to this
    one object, so it is never copied.
    """

    def __init__(self, url: str, embedded: EmbeddedRedis | None = None):
        self.url = url
        self.embedded = embedded  # the server this worker started, if any
        self.since: float | None = None  # monotonic time of the first failed call

    def __deepcopy__(self, memo: dict[int, Any]) -> Outage:
        return self

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, error: Exception) -> None:
        if self.since is None:
            self.since = time.monotonic()
            if self.embedded is not None and self.embedded.process.poll() is not None:
                log.error("the embedded redis-server this worker started has exited; its "
                          "queue is gone: stop this worker (Ctrl-C) and start it again",
                          url=self.url, exit_code=self.embedded.process.returncode)
                return
            log.warning("Redis unreachable; every call waits and retries until it is back",
                        url=self.url, error=str(error) or type(error).__name__)

    def succeeded(self) -> None:
        if self.since is not None:
            log.info("Redis reachable again", url=self.url,
                     down_s=round(time.monotonic() - self.since, 2))
            self.since = None


class RetryForever(Retry):
    """redis-py's Retry with no attempt limit that reports failures and recoveries to an
    Outage.

    A call that fails once and then succeeds met a connection Redis had closed (a restart,
    an idle timeout), not an outage: only a call that fails twice running reports one.
    """

    def __init__(self, outage: Outage):
        super().__init__(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries=-1)
        self.outage = outage

    async def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        failures = 0

        async def report(error: Exception, *count: int) -> Any:
            nonlocal failures
            failures += 1
            if failures >= 2:  # a stale pooled connection fails once, then reconnects fine
                self.outage.failed(error)
            return await fail(error, *count)

        result = await super().call_with_retry(do, report, *args, **kwargs)
        self.outage.succeeded()
        return result


@dataclass
class RedisLink:
    """The worker's Redis client, its outage state, and the embedded server it started."""

    redis: Redis
    url: str
    outage: Outage
    embedded: EmbeddedRedis | None = None
    discovery: Path | None = None  # where the embedded server is advertised

    @classmethod
    async def open(cls, url: str | None, discovery: Path | None = None) -> RedisLink:
        """Connect to ``url`` and check that it answers within CONNECT_TIMEOUT_S. None: the
        embedded redis-server advertised at ``discovery`` by another worker on this machine,
        else a new one (advertised there, so ``pagedq submit``/``stats`` find it)."""
        embedded = None
        if url is None and discovery is not None:
            url = find_advertised(discovery)
            if url is not None:
                log.info("no --redis-url or REDIS_URL: joining the embedded redis-server "
                         "another worker on this machine started", url=url)
        if url is None:
            embedded = EmbeddedRedis.start()
            url = embedded.url
            if discovery is not None:
                advertise(embedded, discovery)
            log.info("no --redis-url or REDIS_URL: started an embedded redis-server; "
                     "`pagedq submit` and `pagedq stats` on this machine find it",
                     url=url, pid=embedded.process.pid)
        outage = Outage(url, embedded)
        r = Redis.from_url(url, retry=RetryForever(outage),
                           retry_on_error=[ConnectionError, TimeoutError],
                           health_check_interval=30, socket_keepalive=True)
        link = cls(r, url, outage, embedded, discovery if embedded else None)
        try:
            await asyncio.wait_for(r.ping(), CONNECT_TIMEOUT_S)
        except BaseException:
            await link.close()
            raise
        return link

    async def close(self) -> None:
        await self.redis.aclose()
        if self.embedded is not None:
            if self.discovery is not None:
                withdraw(self.discovery)
            self.embedded.stop()
