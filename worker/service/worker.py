"""The queue worker: a coordinator over the parts that serve one queue, each with one job.

``run()`` connects to Redis (redis_link.py), loads the model, claims a consumer name
(checkpoints.py) and assembles the parts:

- the engine thread (engine_loop.py) steps the engine, never on the event loop;
- admission (admission.py) reads only what the engine can start, claims it and starts it;
- the outbox (outbox.py) publishes each step's events in one fenced round trip and settles
  what each publish says about its job;
- the lease keeper (leases.py) renews this worker's jobs, notices cancelled and lost ones,
  takes over jobs of dead workers and hands jobs back;
- checkpoints (checkpoints.py) write the worker's state and the queue's depth;
- the metrics server (metrics.py), when a port is given.

Each loop runs as an asyncio task (uvloop where available). SIGTERM drains: stop pulling, hand
back jobs not started yet, let running ones finish within ``drain_timeout``, hand back the
rest, exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from redis.exceptions import RedisError

from pagedq.client.protocol import Keys, Request
from pagedq.client.redis_url import redacted, resolve_redis_url
from pagedq.progress import waiting
from pagedq.worker.config import WorkerConfig, settings
from pagedq.worker.logging import get_logger
from pagedq.worker.service.admission import Admission
from pagedq.worker.service.checkpoints import Checkpoints, claim_name
from pagedq.worker.service.consumer import Consumer
from pagedq.worker.service.embedded_redis import advertised_path
from pagedq.worker.service.engine_loop import EngineLoop, Report
from pagedq.worker.service.job import Jobs
from pagedq.worker.service.leases import LeaseKeeper, Leases
from pagedq.worker.service.metrics import Metrics, MetricsServer
from pagedq.worker.service.outbox import Outbox
from pagedq.worker.service.publisher import Publisher
from pagedq.worker.service.redis_link import RedisLink
from pagedq.worker.service.shared import Shared

log = get_logger("pagedq.worker")

ERROR_PAUSE_S = 1.0  # after an unexpected error a task waits this long before carrying on
STOP_TASKS_S = 10.0  # background tasks get this long to end once cancelled
FLUSH_S = 5.0  # after the drain, queued events get this long to reach Redis


async def in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a thread that ends with it, not on the loop's long-lived executor.

    libgomp keeps an OpenMP thread pool for every thread that ever ran a parallel region, for
    as long as that thread lives. A pool left behind by model loading on an executor thread
    makes libgomp count more OpenMP threads than cores, and it then stops spin-waiting between
    parallel regions: every torch op of the engine thread would pay a futex wake-up.
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedq-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    finally:
        pool.shutdown(wait=False)  # its one thread exits as soon as fn has returned


def build_engine(config: WorkerConfig) -> Any:
    from pagedq.worker import Engine

    return Engine(config.model, **config.engine)


async def repeat(name: str, once: Callable[[], Awaitable[None]],
                 stopping: asyncio.Event | None = None) -> None:
    """Call ``once`` until ``stopping`` is set or the task is cancelled.

    Redis outages never surface here (the client's Retry waits them out), so an exception is
    a bug: it is logged with its traceback, and the loop carries on after a pause rather than
    leave the worker without that task.
    """
    while stopping is None or not stopping.is_set():
        try:
            await once()
        except asyncio.CancelledError:
            raise
        except Exception:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # a library turned our cancellation into another error (e.g. a timeout
                # racing the cancel): honour the cancellation
                raise asyncio.CancelledError from None
            log.exception("task failed; carrying on", task=name)
            await asyncio.sleep(ERROR_PAUSE_S)


@dataclass
class Parts:
    """What serving is made of, once Redis answers, the model is loaded and a name is ours."""

    link: RedisLink
    shared: Shared
    admission: Admission
    outbox: Outbox
    keeper: LeaseKeeper
    checkpoints: Checkpoints


class Worker:
    """One worker process's service. ``await run()``; ``stop()`` from any thread or a signal."""

    def __init__(self, config: WorkerConfig, engine: Any = None):
        self.config = config
        self.engine = engine
        self.keys = Keys(config.queue, config.prefix)
        self.jobs: Jobs = {}  # the jobs this worker owns, shared by its parts
        self.ready = threading.Event()  # set once serving (for callers in other threads)
        self.name = ""  # the consumer name, once claimed
        self.redis_url = ""
        self.model_name = config.model or "default"
        self.metrics_port: int | None = None
        self._serving = False
        self._stopping = asyncio.Event()  # set by stop(): the drain begins
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- life cycle -----------------------------------------------------------------------
    def stop(self) -> None:
        """Begin a graceful drain; safe from signal handlers and other threads."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    async def run(self) -> int:
        """Serve until stop()/SIGTERM, then drain. Exit code: 0 ok, 1 no Redis, 2 no model."""
        self._loop = asyncio.get_running_loop()
        url = resolve_redis_url(self.config.redis_url, default=None)
        try:
            link = await RedisLink.open(url, discovery=advertised_path())
        except (RedisError, OSError, RuntimeError) as exc:
            log.error("cannot reach Redis: check that it runs, and --redis-url / REDIS_URL "
                      "(or pass neither for an embedded one)", url=redacted(url or "embedded"),
                      error=str(exc) or type(exc).__name__)
            return 1
        self.redis_url = link.url
        try:
            if self.engine is None:
                try:
                    with waiting("loading the model", log, delay=0,
                                 model=self.config.model or "default"):
                        self.engine = await in_own_thread(build_engine, self.config)
                except Exception as exc:
                    log.error("cannot load the model", model=self.config.model, error=str(exc))
                    return 2
            await self._serve(await self._assemble(link))
            return 0
        finally:
            await link.close()

    async def _assemble(self, link: RedisLink) -> Parts:
        """Claim a consumer name and build every part around it."""
        cfg, r, keys = self.config, link.redis, self.keys
        base = cfg.consumer_name or settings().consumer_name or socket.gethostname()
        self.name = name = await claim_name(r, keys, base, cfg.checkpoint_ttl_s)
        self.model_name = str(getattr(self.engine, "model_path", None) or self.model_name)
        consumer = Consumer(r, keys, name)
        await consumer.ensure_groups()
        leases = Leases(r, keys, name, cfg.ttl)
        publisher = Publisher(r, keys, cfg.ttl, name)
        shared = Shared(cfg, EngineLoop(self.engine, cfg.prompt_len_hint),
                        Metrics(self.model_name), self.jobs, self._stopping)
        shared.metrics.engine = self.engine.stats()
        outbox = Outbox(shared, publisher)
        admission = Admission(shared, r, keys, consumer, leases, publisher)
        admission.capacity.engine_free = self.engine.free_capacity(cfg.prompt_len_hint)
        keeper = LeaseKeeper(shared, leases, consumer, admission, outbox)
        checkpoints = Checkpoints(shared, r, keys, name, self.model_name)
        return Parts(link, shared, admission, outbox, keeper, checkpoints)

    async def _serve(self, parts: Parts) -> None:
        loop = asyncio.get_running_loop()
        parts.shared.engine_loop.start(lambda report: loop.call_soon_threadsafe(
            self._on_report, parts, report))
        self._install_signals()
        server = await self._start_metrics(parts)
        await parts.checkpoints.write()
        tasks = [asyncio.create_task(repeat(name, once), name=name) for name, once in [
            ("publisher", parts.outbox.publish_once), ("renewer", parts.keeper.renew_once),
            ("poller", parts.keeper.poll_once), ("checkpointer", parts.checkpoints.tick)]]
        pullers = [asyncio.create_task(self._read(parts), name="reader"),
                   asyncio.create_task(repeat("reclaimer", parts.keeper.reclaim_once,
                                              self._stopping), name="reclaimer")]
        self._serving = True
        self.ready.set()
        log.info("worker serving", worker=self.name, queue=self.config.queue,
                 redis=self.redis_url, reclaim_after=self.config.reclaim_after,
                 model=self.model_name)
        await self._stopping.wait()
        await self._drain(parts, pullers)
        for task in tasks:
            task.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=STOP_TASKS_S)
        if stuck:
            log.warning("background tasks did not stop", tasks=[t.get_name() for t in stuck])
        await self._shutdown(parts, server)

    async def _read(self, parts: Parts) -> None:
        await parts.admission.admit_own_pending()
        await repeat("reader", parts.admission.read_once, self._stopping)

    def _on_report(self, parts: Parts, report: Report) -> None:
        """An engine report, on the event loop: capacity to admission, outputs to the outbox."""
        if report.stats is not None:
            parts.shared.metrics.engine = report.stats
        parts.admission.on_report(report)
        parts.outbox.put_report(report)

    def _healthy(self, parts: Parts) -> bool:
        return self._serving and parts.checkpoints.ok and not parts.link.outage.down

    async def _start_metrics(self, parts: Parts) -> MetricsServer | None:
        if self.config.metrics_port is None:
            return None
        server = MetricsServer(parts.shared.metrics, partial(self._healthy, parts),
                               self.config.metrics_host, self.config.metrics_port)
        self.metrics_port = await server.start()
        return server

    def _install_signals(self) -> None:
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, self._stopping.set)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests run workers in threads): stop() instead

    async def _drain(self, parts: Parts, pullers: list[asyncio.Task]) -> None:
        self._serving = False
        log.info("draining: no new jobs", worker=self.name, jobs=len(self.jobs))
        parts.admission.capacity_changed.set()  # a reader waiting for room sees the stop
        await asyncio.wait(pullers, timeout=self.config.read_block_ms / 1000 + 5)
        for task in pullers:
            task.cancel()
        for job in list(self.jobs.values()):
            if job.first_token is None and not job.closing:
                await parts.keeper.hand_back(job)
        end = time.monotonic() + self.config.drain_timeout
        while any(not j.closing for j in self.jobs.values()) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for job in list(self.jobs.values()):
            if not job.closing:
                await parts.keeper.hand_back(job)
        end = time.monotonic() + FLUSH_S
        while (self.jobs or not parts.outbox.empty) and time.monotonic() < end:
            await asyncio.sleep(0.02)

    async def _shutdown(self, parts: Parts, server: MetricsServer | None) -> None:
        await asyncio.get_running_loop().run_in_executor(None, parts.shared.engine_loop.stop)
        try:
            await asyncio.wait_for(parts.checkpoints.remove(), FLUSH_S)
        except Exception as exc:
            log.warning("could not remove the checkpoint keys (they expire on their own)",
                        error=repr(exc))
        if server is not None:
            await server.stop()
        log.info("worker stopped", worker=self.name)


def run_worker(config: WorkerConfig, engine: Any = None) -> int:
    """Run a worker until SIGTERM/SIGINT (on uvloop where available); returns the exit code."""
    worker = Worker(config, engine)
    try:
        import uvloop

        return uvloop.run(worker.run())
    except ImportError:
        return asyncio.run(worker.run())


__all__ = ["Request", "Worker", "WorkerConfig", "run_worker"]
