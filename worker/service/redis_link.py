"""The worker's Redis connection: one client that rides outages, and the embedded redis-server
when no Redis is named.

Every Redis call of the worker waits out an outage (exponential backoff, no attempt limit), so
no task carries a retry loop of its own and a Redis restart costs waiting, never a lost event:
the engine keeps stepping, the outbox keeps its events, and every call completes once Redis is
back (publishes are idempotent). On a standalone server redis-py's own Retry does it; on a
Redis Cluster (a failover moves a slot's master) ``PatientCluster`` does it for commands and
pipelines alike. An outage is logged once when it begins and once when it ends, however many
tasks were waiting, with the URL's credentials redacted. A server that answers ``LOADING``
(restarted, reading its AOF or RDB) is up, not out: calls wait for it without an outage.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    NoPermissionError,
    RedisClusterException,
    TryAgainError,
)

from pagedq.client.connection import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    TRANSIENT,
    TLSFiles,
    is_cluster,
    redact_url,
)
from pagedq.embedded_redis import (
    EmbeddedRedis,
    advertise,
    find_advertised,
    withdraw,
)
from pagedq.logging import get_logger
from pagedq.redis_url import redis_connection_options

log = get_logger("pagedq.worker.redis")

# At start-up an unreachable Redis is a mistake in the configuration, not an outage: the
# worker gives up after this long and exits 1.
CONNECT_TIMEOUT_S = 10.0
# What a cluster answers while a failover is under way, besides the connection errors.
CLUSTER_TRANSIENT = (*TRANSIENT, ClusterDownError, TryAgainError, RedisClusterException)
# What is never an outage: a wrong password, a denied command.
NOT_TRANSIENT = (AuthenticationError, NoPermissionError)
# How often a server that is still loading its data set is logged while calls wait for it.
LOADING_LOG_EVERY_S = 30.0


class Outage:
    """Whether Redis answers, as the worker's last call saw it; each change is logged once.

    redis-py deep-copies the Retry into every connection, and every copy must report to this
    one object, so it is never copied.
    """

    def __init__(self, url: str, embedded: EmbeddedRedis | None = None):
        self.url = redact_url(url)
        self.embedded = embedded  # the server this worker started, if any
        self.since: float | None = None  # monotonic time of the first failed call
        self.loading_logged: float | None = None  # monotonic time "still loading" was logged

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
                        url=self.url, error=redact_url(str(error)) or type(error).__name__)

    def saw(self, error: Exception, failures: int) -> None:
        """A call's ``failures``-th failure in a row. LOADING: the server is up and reading
        its data set (logged, at most every LOADING_LOG_EVERY_S). Else an outage from the
        second failure: a stale pooled connection fails once, then reconnects fine."""
        if isinstance(error, BusyLoadingError):
            now = time.monotonic()
            if self.loading_logged is None or now - self.loading_logged >= LOADING_LOG_EVERY_S:
                self.loading_logged = now
                log.info("Redis is loading its data set; calls wait until it has loaded",
                         url=self.url)
        elif failures >= 2:
            self.failed(error)

    def succeeded(self) -> None:
        if self.since is not None:
            log.info("Redis reachable again", url=self.url,
                     down_s=round(time.monotonic() - self.since, 2))
            self.since = None


class RetryForever(Retry):
    """redis-py's Retry with no attempt limit that reports failures and recoveries to an
    Outage.

    A call that fails once and then succeeds met a connection Redis had closed (a restart,
    an idle timeout), not an outage: only a call that fails twice running reports one. Any call
    that succeeds ends one, so the connections skip the call for a connect that has nothing to
    do (``ConnectOnce``).
    """

    def __init__(self, outage: Outage):
        super().__init__(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries=-1,
                         supported_errors=TRANSIENT)
        self.outage = outage

    async def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        failures = 0

        async def report(error: Exception, *count: int) -> Any:
            nonlocal failures
            if isinstance(error, NOT_TRANSIENT):  # a wrong password is no outage
                raise error
            failures += 1
            self.outage.saw(error, failures)
            return await fail(error, *count)

        result = await super().call_with_retry(do, report, *args, **kwargs)
        self.outage.succeeded()
        return result


class ConnectOnce:
    """A connection mix-in: ``connect()`` of a connection that holds a socket returns before
    redis-py's retry wraps it.

    Why: that call succeeds at once, Redis down or not (the socket is not yet seen closed), and
    through RetryForever it reported "reachable again" a few ms into an outage, which then began
    a second time.
    """

    async def connect(self) -> None:
        if not getattr(self, "is_connected", False):
            await super().connect()  # type: ignore[misc]


def connect_once(client: Redis) -> Redis:
    """``client`` with its pool's connections (TCP, TLS or unix socket alike) ConnectOnce."""
    pool = client.connection_pool
    base = pool.connection_class
    pool.connection_class = type(f"ConnectOnce{base.__name__}", (ConnectOnce, base), {})
    return client


async def wait_out(outage: Outage, attempt: Any) -> Any:
    """Run ``attempt()`` until it does not fail with a cluster's transient error."""
    delay = BACKOFF_BASE_S
    failures = 0
    while True:
        try:
            result = await attempt()
        except NOT_TRANSIENT:
            raise
        except CLUSTER_TRANSIENT as exc:
            failures += 1
            outage.saw(exc, failures)
            await asyncio.sleep(delay)
            delay = min(BACKOFF_CAP_S, delay * 2)
            continue
        outage.succeeded()
        return result


class PatientPipeline:
    """A cluster pipeline that is replayed until it goes through.

    redis-py's cluster pipeline forgets its commands once ``execute`` fails, so this one
    records them and queues them again on a fresh pipeline for every attempt (the worker's
    pipelines are idempotent: fenced scripts, reads, acks, checkpoint writes).
    """

    def __init__(self, cluster: PatientCluster, transaction: bool | None):
        self._cluster = cluster
        self._transaction = transaction
        self._calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> PatientPipeline:
            self._calls.append((name, args, kwargs))
            return self

        return record

    def __len__(self) -> int:
        return len(self._calls)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        async def attempt() -> list[Any]:
            pipe = RedisCluster.pipeline(self._cluster, transaction=self._transaction)
            for name, args, kwargs in self._calls:
                getattr(pipe, name)(*args, **kwargs)
            replies = await pipe.execute(raise_on_error=raise_on_error)
            for reply in replies:  # a node that went away mid-pipeline: try it all again
                if isinstance(reply, CLUSTER_TRANSIENT) and not isinstance(reply, NOT_TRANSIENT):
                    raise reply
            return replies

        try:
            return await wait_out(self._cluster.outage, attempt)
        finally:
            self._calls = []


class PatientCluster(RedisCluster):
    """redis-py's asyncio RedisCluster whose commands and pipelines wait out failovers."""

    outage: Outage

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        parent = super().execute_command
        return await wait_out(self.outage, lambda: parent(*args, **kwargs))

    def pipeline(self, transaction: bool | None = None, shard_hint: Any = None) -> Any:
        return PatientPipeline(self, transaction)


@dataclass
class RedisLink:
    """The worker's Redis client, its outage state, and the embedded server it started."""

    redis: Redis | RedisCluster
    url: str  # with the credentials redacted: safe to log
    outage: Outage
    embedded: EmbeddedRedis | None = None
    discovery: Path | None = None  # where the embedded server is advertised

    @property
    def cluster(self) -> bool:
        return isinstance(self.redis, RedisCluster)

    @classmethod
    async def open(cls, url: str | None, tls: TLSFiles | None = None,
                   discovery: Path | None = None) -> RedisLink:
        """Connect to ``url`` and check that it answers within CONNECT_TIMEOUT_S; a denied
        login or command raises at once. None: the embedded redis-server advertised at
        ``discovery`` by another worker on this machine, else a new one (advertised there, so
        ``pagedq submit``/``stats`` find it)."""
        embedded = None
        if url is None and discovery is not None:
            url = find_advertised(discovery)
            if url is not None:
                log.info("no --redis-url or REDIS_URL: joining the embedded redis-server "
                         "another worker on this machine started", url=url)
        if url is None:
            embedded = EmbeddedRedis.start(unix_socket=True)
            url = embedded.url
            if discovery is not None:
                advertise(embedded, discovery)
            log.info("no --redis-url or REDIS_URL: started an embedded redis-server; "
                     "`pagedq submit` and `pagedq stats` on this machine find it",
                     url=url, pid=embedded.process.pid)
        outage = Outage(url, embedded)
        try:
            r = await asyncio.wait_for(cls._client(url, tls, outage), CONNECT_TIMEOUT_S)
        except BaseException:
            if embedded is not None:
                embedded.stop()
            raise
        link = cls(r, outage.url, outage, embedded, discovery if embedded else None)
        try:
            await asyncio.wait_for(r.ping(), CONNECT_TIMEOUT_S)
        except BaseException:
            await link.close()
            raise
        return link

    @staticmethod
    async def _client(url: str, tls: TLSFiles | None, outage: Outage) -> Redis | RedisCluster:
        options = {**(tls.kwargs() if tls else {}), **redis_connection_options(url)}
        if await asyncio.to_thread(is_cluster, url, tls):
            # the cluster's own retry re-reads the slots a few times; PatientCluster then
            # waits out the rest (a retry-forever connection would never fail over)
            cluster = PatientCluster.from_url(url, retry=Retry(ExponentialBackoff(), 3),
                                              **options)
            cluster.outage = outage
            return cluster
        return connect_once(Redis.from_url(url, retry=RetryForever(outage),
                                           health_check_interval=30, **options))

    async def close(self) -> None:
        await self.redis.aclose()
        if self.embedded is not None:
            if self.discovery is not None:
                withdraw(self.discovery)
            self.embedded.stop()
