"""The queue worker: a coordinator over the parts that serve one queue, each with one job.

``run()`` connects to Redis (redis_link.py), loads the model, claims a consumer name
(checkpoints.py) and assembles the parts:

- the engine thread (engine_loop.py) steps the engine, never on the event loop;
- admission (admission.py) reads only what the engine can start, claims it and starts it;
- the outbox (outbox.py) publishes each step's events in one fenced round trip and settles
  what each publish says about its job;
- the lease keeper (lease_keeper.py) renews this worker's jobs, notices cancelled and lost ones,
  takes over jobs of dead workers and hands jobs back;
- checkpoints (checkpoints.py) write the worker's state and the queue's depth;
- the metrics server (metrics.py), when a port is given.

Each loop runs as an asyncio task (uvloop where available). SIGTERM drains: stop pulling, hand
back jobs not started yet, let running ones finish within ``drain_timeout``, hand back the
rest, exit 0 within ``drain_timeout + EXIT_GRACE_S`` whatever Redis does. A SIGTERM while the
model loads exits 0 at once. A Redis that cannot be reached, refuses the login, or denies a
command the worker needs (an ACL) is one log line and exit 1, never a traceback.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from redis.exceptions import NoPermissionError, OutOfMemoryError, RedisError

from pagedq.cancel import stop_tasks
from pagedq.client.connection import redact_url
from pagedq.client.protocol import Keys, Request
from pagedq.embedded_redis import advertised_path
from pagedq.logging import get_logger
from pagedq.progress import waiting
from pagedq.redis_url import resolve_redis_url
from pagedq.worker.config import WorkerConfig, settings
from pagedq.worker.service.admission import Admission
from pagedq.worker.service.checkpoints import Checkpoints, Starting, claim_name
from pagedq.worker.service.consumer import Consumer
from pagedq.worker.service.engine_loop import EngineLoop, Report
from pagedq.worker.service.job import Jobs
from pagedq.worker.service.lease_keeper import LeaseKeeper
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.metrics_server import Metrics, MetricsServer
from pagedq.worker.service.outbox import Outbox
from pagedq.worker.service.publisher import Publisher
from pagedq.worker.service.redis_link import RedisLink
from pagedq.worker.service.shared import RedisFull, Shared
from pagedq.worker.service.tokenizer_thread import Intake

log = get_logger("pagedq.worker")

ERROR_PAUSE_S = 1.0  # after an unexpected error a task waits this long before carrying on
# Once the drain's running jobs had their --drain-timeout, everything left (hand-backs, the
# last events, the checkpoint keys, the engine thread) shares this many seconds.
EXIT_GRACE_S = 5.0
ACL_HINT = ("the Redis user lacks a command or key the worker needs: grant the ACL in "
            "docs/operations.md")


async def in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a daemon thread that ends with it, not on the loop's long-lived executor.

    libgomp keeps an OpenMP thread pool for every thread that ever ran a parallel region, for
    as long as that thread lives. A pool left behind by model loading on an executor thread
    makes libgomp count more OpenMP threads than cores, and it then stops spin-waiting between
    parallel regions: every torch op of the engine thread would pay a futex wake-up. A daemon
    thread also lets the process exit on SIGTERM while a model still loads.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            result: Any = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(_settle, done, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=target, name="pagedq-load", daemon=True).start()
    return await done


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def build_engine(config: WorkerConfig) -> Any:
    # torch (seconds), loaded in the loading thread while the worker already announces itself
    from pagedq.worker import Engine

    return Engine(config.model, **config.engine)


async def repeat(name: str, once: Callable[[], Awaitable[None]],
                 stopping: asyncio.Event | None = None, full: RedisFull | None = None,
                 denied: Callable[[Exception], None] | None = None) -> None:
    """Call ``once`` until ``stopping`` is set or the task is cancelled.

    Redis outages never surface here (the client's Retry waits them out), a Redis out of
    memory is noted in ``full`` (logged once), and a command the ACL denies goes to ``denied``
    (the worker stops: it cannot do its job). Any other exception is a bug: it is logged with
    its traceback, and the loop carries on after a pause rather than leave the worker without
    that task.
    """
    while stopping is None or not stopping.is_set():
        try:
            await once()
        except asyncio.CancelledError:
            raise
        except OutOfMemoryError as exc:
            if full is not None:
                full.failed(exc)
            await asyncio.sleep(ERROR_PAUSE_S)
        except NoPermissionError as exc:
            if denied is None:
                raise
            denied(exc)
            return
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


class _StoppedLoading(Exception):
    """A stop came while the model was loading (ends the load's wait as "failed")."""


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
        self.denied = False  # the Redis user may not run a command the worker needs
        self._stopping = asyncio.Event()  # set by stop(): the drain begins
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: Starting | None = None  # says "loading" on the queue until serving

    # -- life cycle -----------------------------------------------------------------------
    def stop(self) -> None:
        """Begin a graceful drain; safe from signal handlers and other threads."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    async def run(self) -> int:
        """Serve until stop()/SIGTERM, then drain. Exit code: 0 ok, 1 no Redis (or denied),
        2 no model."""
        self._loop = asyncio.get_running_loop()
        self._install_signals()
        url = resolve_redis_url(self.config.redis_url, default=None)
        try:
            link = await RedisLink.open(url, self.config.tls, discovery=advertised_path())
        except NoPermissionError as exc:
            log.error(f"Redis denied a command: {ACL_HINT}", error=redact_url(str(exc)))
            return 1
        except (RedisError, OSError, RuntimeError) as exc:
            log.error("cannot reach Redis: check that it runs, --redis-url / REDIS_URL (or pass "
                      "neither for an embedded one) and the TLS flags",
                      url=redact_url(url or "embedded"),
                      error=redact_url(str(exc)) or type(exc).__name__)
            return 1
        self.redis_url = link.url
        self._starting = Starting(link.redis, self.keys, self.config.checkpoint_ttl_s,
                                  self.config.checkpoint_interval)
        self._starting.start()
        try:
            if self.engine is None and not await self._load():
                return 0 if self._stopping.is_set() else 2
            try:
                parts = await self._assemble(link)
            except NoPermissionError as exc:
                log.error(f"Redis denied a command: {ACL_HINT}", error=redact_url(str(exc)))
                return 1
            await self._serve(parts)
            return 1 if self.denied else 0
        finally:
            await self._starting.stop()  # a no-op once serving began
            await link.close()

    async def _load(self) -> bool:
        """Load the model; False when it fails (logged) or a stop came first. The wait's own
        lines end in "failed: loading the model" then, never "done"."""
        load = asyncio.ensure_future(in_own_thread(build_engine, self.config))
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            with waiting("loading the model", log, delay=0, model=self.config.model or "default"):
                await asyncio.wait([load, stop], return_when=asyncio.FIRST_COMPLETED)
                if not load.done():
                    raise _StoppedLoading
                self.engine = load.result()
        except _StoppedLoading:
            load.cancel()
            log.info("stopped while the model was loading")
            return False
        except Exception as exc:
            log.error("cannot load the model", model=self.config.model, error=str(exc))
            return False
        finally:
            stop.cancel()
        return True

    async def _assemble(self, link: RedisLink) -> Parts:
        """Claim a consumer name and build every part around it."""
        cfg, r, keys = self.config, link.redis, self.keys
        base = cfg.consumer_name or settings().consumer_name or socket.gethostname()
        self.name = name = await claim_name(r, keys, base, cfg.checkpoint_ttl_s)
        self.model_name = str(getattr(self.engine, "model_path", None) or self.model_name)
        consumer = Consumer(r, keys, name, cfg.dead_letter_entry_bytes, cfg.dead_letter_max_bytes)
        await consumer.ensure_groups()
        leases = Leases(r, keys, name, cfg.ttl, cfg.max_deliveries)
        publisher = Publisher(r, keys, cfg.ttl, name)
        shared = Shared(cfg, EngineLoop(self.engine, cfg.prompt_len_hint),
                        Metrics(self.model_name), self.jobs, self._stopping)
        shared.metrics.engine = self.engine.stats()
        outbox = Outbox(shared, publisher)
        admission = Admission(shared, r, keys, consumer, leases, publisher,
                              Intake(self.engine, cfg.max_prompt_tokens))
        admission.capacity.engine_free = self.engine.free_capacity(cfg.prompt_len_hint)
        keeper = LeaseKeeper(shared, leases, consumer, admission, outbox)
        outbox.give_back = keeper.hand_back
        checkpoints = Checkpoints(shared, r, keys, name, self.model_name)
        return Parts(link, shared, admission, outbox, keeper, checkpoints)

    async def _serve(self, parts: Parts) -> None:
        loop = asyncio.get_running_loop()
        parts.shared.engine_loop.start(lambda report: loop.call_soon_threadsafe(
            self._on_report, parts, report))
        server = await self._start_metrics(parts)
        await parts.checkpoints.write()
        if self._starting is not None:  # stats now name this worker among the serving ones
            await self._starting.stop()
        full = parts.shared.redis_full
        tasks = [asyncio.create_task(repeat(name, once, None, full, self._denied), name=name)
                 for name, once in [
            ("publisher", parts.outbox.publish_once), ("renewer", parts.keeper.renew_once),
            ("poller", parts.keeper.poll_once), ("checkpointer", parts.checkpoints.tick)]]
        pullers = [asyncio.create_task(self._read(parts), name="reader"),
                   asyncio.create_task(repeat("reclaimer", parts.keeper.reclaim_once,
                                              self._stopping, full, self._denied),
                                       name="reclaimer")]
        self._serving = True
        self.ready.set()
        log.info("worker serving", worker=self.name, queue=self.config.queue,
                 redis=self.redis_url, reclaim_after=self.config.reclaim_after,
                 model=self.model_name)
        await self._stopping.wait()
        end = await self._drain(parts, pullers)
        # cancelled until they end: one cancel can be lost on Python 3.11 (pagedq.cancel)
        stuck = await stop_tasks(tasks, max(0.1, end - time.monotonic()))
        if stuck:
            log.warning("background tasks did not stop", tasks=[t.get_name() for t in stuck])
        await self._shutdown(parts, server, end)

    async def _read(self, parts: Parts) -> None:
        await parts.admission.admit_own_pending()
        await repeat("reader", parts.admission.read_once, self._stopping,
                     parts.shared.redis_full, self._denied)

    def _denied(self, exc: Exception) -> None:
        """A command the Redis user may not run: one line, then stop (exit 1)."""
        if not self.denied:
            log.error(f"Redis denied a command: {ACL_HINT}", error=redact_url(str(exc)))
        self.denied = True
        self._stopping.set()

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

    async def _drain(self, parts: Parts, pullers: list[asyncio.Task]) -> float:
        """Stop pulling, let running jobs finish within --drain-timeout, hand back the rest.

        Returns the monotonic time by which everything left must be done: the hand-backs and
        the last events share EXIT_GRACE_S after the drain, so SIGTERM always exits in time.
        """
        self._serving = False
        # --drain-timeout counts from the signal: the wait for the readers below is part of it.
        drained = time.monotonic() + self.config.drain_timeout
        log.info("draining: no new jobs", worker=self.name, jobs=len(self.jobs))
        parts.admission.capacity_changed.set()  # a reader waiting for room sees the stop
        await asyncio.wait(pullers, timeout=min(self.config.read_block_ms / 1000, 1.0) + 0.5)
        for task in pullers:
            task.cancel()
        await self._hand_back(parts, [j for j in self.jobs.values()
                                      if j.first_token is None and not j.closing])
        while any(not j.closing for j in self.jobs.values()) and time.monotonic() < drained:
            await asyncio.sleep(0.05)
        end = time.monotonic() + EXIT_GRACE_S
        await self._hand_back(parts, [j for j in self.jobs.values() if not j.closing])
        while (self.jobs or not parts.outbox.empty) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return end

    @staticmethod
    async def _hand_back(parts: Parts, jobs: list) -> None:
        """Hand ``jobs`` back at once, all in parallel (each bounded by its own timeout)."""
        await asyncio.gather(*(parts.keeper.hand_back(j) for j in jobs))

    async def _shutdown(self, parts: Parts, server: MetricsServer | None, end: float) -> None:
        def left() -> float:
            return max(0.1, end - time.monotonic())

        await asyncio.get_running_loop().run_in_executor(
            None, partial(parts.shared.engine_loop.stop, left()))
        parts.admission.intake.close()
        try:
            await asyncio.wait_for(parts.checkpoints.remove(), left())
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
        import uvloop  # optional dependency: not on Windows

        return uvloop.run(worker.run())
    except ImportError:
        return asyncio.run(worker.run())


__all__ = ["Request", "Worker", "WorkerConfig", "run_worker"]
