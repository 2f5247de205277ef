"""The queue worker: asyncio (uvloop) around an engine stepping in its own thread.

Tasks on the loop: the reader (XREADGROUP, only what the engine can admit), the reclaimer
(XAUTOCLAIM of jobs whose owner died), the renewer (keeps this worker's leases), the poller
(cancellations and lost leases), the publisher (each step's events in one round trip), the
checkpointer and the optional metrics server. SIGTERM drains: stop pulling, hand back jobs not
started yet, let running ones finish within ``drain_timeout``, hand back the rest, exit 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pagedq.client.protocol import (
    CANCELLED,
    E_DEAD_LETTER,
    E_INTERNAL,
    E_INVALID_PARAMS,
    E_INVALID_REQUEST,
    E_TOO_LONG,
    F_ID,
    F_PAYLOAD,
    Event,
    Keys,
    ProtocolError,
    Request,
    decode_event,
    decode_request,
)
from pagedq.errors import InvalidParamsError, InvalidRequestError, RequestTooLongError
from pagedq.worker.config import WorkerConfig
from pagedq.worker.logging import get_logger
from pagedq.worker.service.checkpoint import Checkpointer
from pagedq.worker.service.consumer import Consumer, Entry
from pagedq.worker.service.embedded_redis import EmbeddedRedis, resolve_redis_url
from pagedq.worker.service.engine_loop import AbortCmd, AddCmd, EngineLoop, Report
from pagedq.worker.service.job import LiveJob
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.metrics import Metrics, MetricsServer
from pagedq.worker.service.publisher import (
    FENCED,
    OK,
    Publication,
    Publisher,
    error_event,
    finished_event,
    merge,
    publication,
    token_events,
)

log = get_logger("pagedq.worker")


async def in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in a thread that ends with it, not on the loop's long-lived executor.

    Why: libgomp keeps an OpenMP thread pool for every thread that ever ran a parallel region,
    for as long as that thread lives. A pool left behind by model loading on an executor thread
    makes libgomp count more OpenMP threads than cores, and it then stops spin-waiting between
    parallel regions: every torch op of the engine thread paid a futex wake-up (under load 12%
    of the CPU sat idle and steps ran ~10% slower than the same engine in-process).
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedq-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    finally:
        pool.shutdown(wait=False)  # its one thread exits as soon as fn has returned


def build_engine(config: WorkerConfig) -> Any:
    from pagedq.worker import Engine

    return Engine(config.model, **config.engine)


class Worker:
    """One worker process's service. ``await run()``; ``stop()`` from any thread or a signal."""

    def __init__(self, config: WorkerConfig, engine: Any = None):
        self.config = config
        self.engine = engine
        self.keys = Keys(config.queue, config.prefix)
        self.jobs: dict[str, LiveJob] = {}  # engine id -> job
        self.stopping = False
        self.healthy = False
        self.ready = threading.Event()  # set once serving (for callers in other threads)
        self.name = ""
        self.redis_url = ""
        self._stop_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._capacity = 0
        self._adds_sent = 0
        self._adds_done = 0
        self._reserved = 0
        self._capacity_changed = asyncio.Event()
        self._outbox: asyncio.Queue[Report | Publication] = asyncio.Queue()
        self._engine_stats: dict[str, Any] = {}
        self._generated_tokens = 0
        self._publishing = False
        self._cancel_hint: bytes | None = None  # last value of the queue's cancel counter
        self._closing = False  # set after the drain: background loops end
        self._embedded: EmbeddedRedis | None = None

    # -- life cycle -----------------------------------------------------------------------
    def stop(self) -> None:
        """Begin a graceful drain; safe from signal handlers and other threads."""
        if self._loop is not None and self._stop_event is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)

    async def run(self) -> int:
        """Serve until stop()/SIGTERM, then drain. Exit code: 0 ok, 1 no Redis, 2 no model."""
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        code = await self._setup()
        if code:
            return code
        metrics_server = await self._start_metrics()
        await self._checkpoint()
        tasks = [asyncio.create_task(self._forever(name, fn), name=name) for name, fn in [
            ("publisher", self._publish_once), ("renewer", self._renew_once),
            ("poller", self._poll_once), ("checkpointer", self._checkpoint_tick)]]
        pullers = [asyncio.create_task(self._reader(), name="reader"),
                   asyncio.create_task(self._reclaimer(), name="reclaimer")]
        self.healthy = True
        self.ready.set()
        log.info("worker serving", worker=self.name, queue=self.config.queue,
                 redis=self.redis_url, reclaim_after=self.config.reclaim_after,
                 model=self.model_name)
        await self._stop_event.wait()
        await self._drain(pullers)
        self._closing = True
        for task in tasks:
            task.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=10)
        if stuck:
            log.warning("background tasks did not stop", tasks=[t.get_name() for t in stuck])
        await self._shutdown(metrics_server)
        return 0

    async def _setup(self) -> int:
        """Connect, load the model, claim a consumer name, start the engine thread."""
        try:
            await self._connect()
        except (RedisError, OSError, RuntimeError) as exc:
            log.error("cannot reach Redis: check --redis-url / REDIS_URL", error=str(exc))
            return 1
        if self.engine is None:
            log.info("loading model", model=self.config.model or "default")
            try:
                self.engine = await in_own_thread(build_engine, self.config)
            except Exception as exc:
                log.error("cannot load the model", model=self.config.model, error=str(exc))
                await self._close_redis()
                return 2
        self.name = await self._pick_name()
        self.model_name = str(getattr(self.engine, "model_path", None) or self.config.model
                              or "default")
        self.consumer = Consumer(self.r, self.keys, self.name)
        self.leases = Leases(self.r, self.keys, self.name, self.config.ttl)
        self.publisher = Publisher(self.r, self.keys, self.config.ttl, self.name)
        self.checkpointer = Checkpointer(self.r, self.keys, self.name,
                                         self.config.checkpoint_ttl_s, self.model_name)
        self.metrics = Metrics(self.model_name)
        await self.consumer.ensure_groups()
        self._capacity = self.engine.free_capacity(self.config.prompt_len_hint)
        self._engine_stats = self.engine.stats()
        self.engine_loop = EngineLoop(self.engine, self._on_report_threadsafe,
                                      self.config.prompt_len_hint)
        self.engine_loop.start()
        self._install_signals()
        return 0

    async def _start_metrics(self) -> MetricsServer | None:
        if self.config.metrics_port is None:
            return None
        server = MetricsServer(self.metrics, lambda: self.healthy, self.config.metrics_host,
                               self.config.metrics_port)
        self.metrics_port = await server.start()
        return server

    async def _connect(self) -> None:
        url = resolve_redis_url(self.config.redis_url)
        if url is None:
            self._embedded = EmbeddedRedis.start()
            url = self._embedded.url
            log.info("no --redis-url or REDIS_URL: started an embedded redis-server",
                     url=url, pid=self._embedded.process.pid)
        self.redis_url = url
        self.r = Redis.from_url(url, health_check_interval=30, socket_keepalive=True)
        await self.r.ping()

    async def _pick_name(self) -> str:
        """A stable consumer name (flag, $PAGEDQ_CONSUMER_NAME or the host name), suffixed only
        while another live worker holds it, so a restarted worker resumes its own pending jobs."""
        base = (self.config.consumer_name or os.environ.get("PAGEDQ_CONSUMER_NAME")
                or socket.gethostname())
        ttl_ms = int(self.config.checkpoint_ttl_s * 1000)
        for i in range(1000):
            name = base if i == 0 else f"{base}-{i + 1}"
            if await self.r.set(self._lock_key(name), name, nx=True, px=ttl_ms):
                return name
        raise RuntimeError(f"1000 live workers already use the consumer name {base!r}")

    def _lock_key(self, name: str | None = None) -> str:
        return f"{self.keys.prefix}:{self.keys.queue}:lock:{name or self.name}"

    def _install_signals(self) -> None:
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self._stop_event.set)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (tests run workers in threads): stop() instead

    async def _drain(self, pullers: list[asyncio.Task]) -> None:
        self.stopping = True
        self.healthy = False
        log.info("draining: no new jobs", worker=self.name, jobs=len(self.jobs))
        self._capacity_changed.set()
        await asyncio.wait(pullers, timeout=self.config.read_block_ms / 1000 + 5)
        for task in pullers:
            task.cancel()
        for job in list(self.jobs.values()):
            if job.first_token is None and not job.closing:
                await self._hand_back(job)
        end = time.monotonic() + self.config.drain_timeout
        while any(not j.closing for j in self.jobs.values()) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for job in list(self.jobs.values()):
            if not job.closing:
                await self._hand_back(job)
        end = time.monotonic() + 5
        while (self.jobs or self._publishing or not self._outbox.empty()) \
                and time.monotonic() < end:
            await asyncio.sleep(0.02)

    async def _shutdown(self, metrics_server: MetricsServer | None) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop)
        try:
            await self.checkpointer.remove(self._lock_key())
        except Exception:
            log.exception("could not remove the checkpoint keys (they expire on their own)")
        if metrics_server is not None:
            await metrics_server.stop()
        await self._close_redis()
        log.info("worker stopped", worker=self.name)

    async def _close_redis(self) -> None:
        if getattr(self, "r", None) is not None:
            await self.r.aclose()
        if self._embedded is not None:
            self._embedded.stop()

    async def _forever(self, name: str, once: Callable[[], Awaitable[None]]) -> None:
        """Run ``once`` in a loop; a failure (Redis blip, bug) is logged and retried."""
        backoff = 0.1
        while not self._closing:
            try:
                await once()
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception:
                task = asyncio.current_task()
                if self._closing or (task is not None and task.cancelling()):
                    # a library turned our cancellation into another error (e.g. a timeout
                    # racing the cancel): honour the cancellation
                    raise asyncio.CancelledError from None
                log.exception("task iteration failed; retrying", task=name)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    # -- capacity -------------------------------------------------------------------------
    def _on_report_threadsafe(self, report: Report) -> None:
        self._loop.call_soon_threadsafe(self._on_report, report)

    def _on_report(self, report: Report) -> None:
        self._capacity = report.capacity
        self._adds_done = report.adds_done
        if report.stats is not None:
            self._engine_stats = report.stats
            self.metrics.engine = report.stats
        self._capacity_changed.set()
        if report.outputs or report.rejected or report.step_error:
            self._outbox.put_nowait(report)

    def free_capacity(self) -> int:
        in_flight = self._adds_sent - self._adds_done
        return self._capacity - in_flight - self._reserved

    # -- pulling --------------------------------------------------------------------------
    async def _reader(self) -> None:
        await self._admit_all(await self.consumer.own_pending())
        backoff = 0.1
        while not self.stopping:
            try:
                cap = self.free_capacity()
                if cap <= 0:
                    self._capacity_changed.clear()
                    try:
                        await asyncio.wait_for(self._capacity_changed.wait(), 0.5)
                    except TimeoutError:
                        pass
                    continue
                entries = await self.consumer.read(cap, self.config.read_block_ms)
                await self._admit_all(entries)
                backoff = 0.1
            except Exception:
                log.exception("reading jobs failed; retrying")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _reclaimer(self) -> None:
        interval = max(0.1, min(self.config.reclaim_after / 4, 5.0))
        while not self.stopping:
            try:
                await asyncio.wait_for(self._stop_event.wait(), interval)
                return
            except TimeoutError:
                pass
            try:
                await self._reclaim_once()
            except Exception:
                log.exception("reclaiming jobs failed; retrying")

    async def _reclaim_once(self) -> None:
        cap = self.free_capacity()
        if cap <= 0:
            return
        entries = await self.consumer.reclaim(cap, int(self.config.reclaim_after * 1000))
        if entries:
            log.info("reclaimed jobs from a silent worker", count=len(entries))
            self.metrics.inc("pagedq:jobs_reclaimed_total", len(entries))
        await self._admit_all(entries)

    async def _admit_all(self, entries: list[Entry]) -> None:
        self._reserved += len(entries)
        await asyncio.gather(*(self._admit(e) for e in entries))

    async def _admit(self, entry: Entry) -> None:
        """Claim one entry and start it, or end it at once (bad, done, cancelled, expired...)."""
        try:
            await self._admit_inner(entry)
        except Exception:
            # Left pending: it is reclaimed after --reclaim-after and dead-lettered if it keeps
            # failing, so one poisonous job can never wedge the worker.
            log.exception("admitting a job failed", stream=entry.stream, entry_id=entry.entry_id)
        finally:
            self._reserved -= 1

    async def _admit_inner(self, entry: Entry) -> None:
        if entry.fields is None:  # deleted while pending: nothing to run
            await self.consumer.ack_delete(entry.stream, entry.entry_id)
            return
        hint = entry.fields.get(F_ID)
        try:
            req = decode_request(entry.fields.get(F_PAYLOAD),
                                 hint.decode(errors="replace") if hint else None)
        except ProtocolError as exc:
            await self._reject_entry(entry, exc)
            return
        claim = await self.leases.claim(req.id)
        if claim.done:
            await self.consumer.ack_delete(entry.stream, entry.entry_id)
            return
        job = LiveJob(req, entry.stream, entry.entry_id, entry.fields, claim.epoch, claim.seq,
                      [0] * req.params.n, [None] * req.params.n)
        if claim.deliveries > self.config.max_deliveries:
            await self._dead_letter(job, entry, claim.deliveries)
            return
        if claim.cancel:
            await self._end_now(job, Event(type=CANCELLED, request_id=req.id, worker=self.name))
            self.metrics.inc("pagedq:jobs_cancelled_total")
            return
        if req.deadline is not None and req.deadline <= time.time():
            job.finished = ["deadline"] * job.n
            await self._end_now(job, finished_event(job, self.name))
            return
        resume = await self._restore(job) if claim.seq > 0 else None
        if job.all_finished:
            await self._end_now(job, finished_event(job, self.name))
            return
        self.metrics.queue_time.observe(max(0.0, time.time() - (req.created or time.time())))
        self.jobs[job.engine_id] = job
        self._adds_sent += 1
        self.engine_loop.send(AddCmd(
            job.engine_id, req.params, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            messages=req.messages, priority=req.priority, resume=resume, deadline=req.deadline))

    async def _restore(self, job: LiveJob) -> list[list[int]] | None:
        """A previous owner wrote events: recover each sample's tokens to resume after them."""
        tokens: list[list[int]] = [[] for _ in range(job.n)]
        last = "-"
        while True:
            entries = await self.r.xrange(self.keys.out(job.id), min=last, count=1000)
            if last != "-":
                entries = entries[1:]
            if not entries:
                break
            for entry_id, fields in entries:
                ev = decode_event(fields, entry_id)
                if ev.type == "tokens" and 0 <= ev.index < job.n:
                    tokens[ev.index] += ev.token_ids
                    if ev.finish_reason is not None:
                        job.finished[ev.index] = ev.finish_reason
                last = ev.entry_id or last
        job.generated = [len(t) for t in tokens]
        job.resumed_tokens = sum(job.generated)
        log.info("resuming a job", request_id=job.id, epoch=job.epoch, tokens=job.generated)
        return tokens if job.resumed_tokens or any(job.finished) else None

    async def _reject_entry(self, entry: Entry, exc: ProtocolError) -> None:
        log.warning("bad job entry", stream=entry.stream, entry_id=entry.entry_id,
                    code=exc.code, error=str(exc), request_id=exc.request_id)
        if exc.request_id is None:  # nobody to tell: keep it for inspection
            await self.consumer.dead_letter(entry, f"{exc.code}: {exc}")
            self.metrics.inc("pagedq:jobs_dead_lettered_total")
            return
        claim = await self.leases.claim(exc.request_id)
        if claim.done:
            await self.consumer.ack_delete(entry.stream, entry.entry_id)
            return
        await self.publisher.send([Publication(
            exc.request_id, claim.epoch, entry.stream, entry.entry_id, claim.seq,
            [error_event(exc.request_id, exc.code, str(exc), self.name)], terminal=True)])
        self.metrics.failed[exc.code] = self.metrics.failed.get(exc.code, 0) + 1

    async def _dead_letter(self, job: LiveJob, entry: Entry, deliveries: int) -> None:
        reason = (f"delivered {deliveries} times (max {self.config.max_deliveries}): the "
                  "workers running it kept dying")
        log.error("dead-lettering a job", request_id=job.id, deliveries=deliveries)
        await self.r.xadd(self.keys.dead, {**entry.fields, b"stream": entry.stream,
                                           b"entry_id": entry.entry_id, b"reason": reason,
                                           b"consumer": self.name},
                          maxlen=10_000, approximate=True)
        self.metrics.inc("pagedq:jobs_dead_lettered_total")
        await self._end_now(job, error_event(job.id, E_DEAD_LETTER,
                                             reason + "; see the queue's dead-letter stream",
                                             self.name))

    async def _end_now(self, job: LiveJob, event: Event) -> None:
        """Write a terminal event for a job that never reached the engine (acks it)."""
        await self.publisher.send([publication(job, [event], terminal=True)])

    # -- engine outputs -> Redis ------------------------------------------------------------
    async def _publish_once(self) -> None:
        items = [await self._outbox.get()]
        self._publishing = True
        try:
            while not self._outbox.empty():
                items.append(self._outbox.get_nowait())
            await self._publish(items)
        finally:
            self._publishing = False

    async def _publish(self, items: list[Report | Publication]) -> None:
        pubs: list[Publication] = []
        for item in items:
            pubs += [item] if isinstance(item, Publication) else self._publications(item)
        pubs = merge(pubs)
        if not pubs:
            return
        backoff = 0.05
        while True:  # Redis away: keep the events (the engine keeps going) and retry
            try:
                outcomes = await self.publisher.send(pubs)
                break
            except RedisError:
                log.exception("publishing failed; retrying (publishes are idempotent)")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
        for pub, outcome in zip(pubs, outcomes, strict=True):
            self._settle(pub, outcome.status, outcome.cancel)

    def _publications(self, report: Report) -> list[Publication]:
        pubs = []
        by_job: dict[str, list[Any]] = {}
        for out in report.outputs:
            by_job.setdefault(out.request_id, []).append(out)
        now = time.time()
        for engine_id, outputs in by_job.items():
            job = self.jobs.get(engine_id)
            if job is None or job.closing:
                continue  # aborted, handed back or lost: its late outputs are dropped
            events = token_events(job, outputs, self.name)
            self._observe_tokens(job, events, now)
            if job.all_finished:
                events.append(finished_event(job, self.name))
                job.closing = True
            if events:
                pubs.append(publication(job, events, terminal=job.closing))
        for engine_id, exc in report.rejected:
            job = self.jobs.get(engine_id)
            if job is not None and not job.closing:
                pubs.append(self._fail(job, _error_code(exc), str(exc)))
        if report.step_error is not None:
            message = f"the engine failed on this batch: {report.step_error!r}"
            pubs += [self._fail(job, E_INTERNAL, message) for job in self._owned()]
        return pubs

    def _observe_tokens(self, job: LiveJob, events: list[Event], now: float) -> None:
        n = sum(len(e.token_ids) for e in events)
        if not n:
            return
        self._generated_tokens += n
        self.metrics.generation_tokens += n
        if job.first_token is None:
            job.first_token = now
            self.metrics.ttft.observe(now - job.admitted)
        elif job.last_token is not None:
            gap = (now - job.last_token) / n
            for _ in range(min(n, 64)):
                self.metrics.itl.observe(gap)
        job.last_token = now

    def _settle(self, pub: Publication, status: int, cancel: bool) -> None:
        """Act on a publish outcome: done, lost (fenced) or cancel requested."""
        engine_id = f"{pub.request_id}#{pub.epoch}"
        job = self.jobs.get(engine_id)
        if status == OK and pub.terminal:
            self.jobs.pop(engine_id, None)
            if job is not None:
                self._count_end(job, pub)
            return
        if status != OK:
            if status == FENCED:
                self.metrics.inc("pagedq:jobs_fenced_total")
                log.warning("lost a job to another worker; dropping it", request_id=pub.request_id)
            else:
                log.error("output stream out of sync; giving the job up",
                          request_id=pub.request_id)
            if job is not None:
                self._drop(job)
            return
        if job is not None:
            job.checked = time.monotonic()  # the script just read its epoch and cancel flag
        if cancel and job is not None and not job.closing:
            self._cancel(job)

    def _count_end(self, job: LiveJob, pub: Publication) -> None:
        last = pub.events[-1] if pub.events else None
        if last is not None and last.type == "finished":
            self.metrics.e2e.observe(time.time() - job.admitted)
            self.metrics.counters["vllm:prompt_tokens_total"] += job.prompt_tokens
            for reason in job.finished:
                key = reason or "stop"
                self.metrics.success[key] = self.metrics.success.get(key, 0) + 1

    def _drop(self, job: LiveJob) -> None:
        self.jobs.pop(job.engine_id, None)
        job.closing = True
        self.engine_loop.send(AbortCmd(job.engine_id))

    def _cancel(self, job: LiveJob) -> None:
        log.info("cancelling a job", request_id=job.id)
        job.closing = True
        self.engine_loop.send(AbortCmd(job.engine_id))
        self.metrics.inc("pagedq:jobs_cancelled_total")
        self._outbox.put_nowait(publication(
            job, [Event(type=CANCELLED, request_id=job.id, worker=self.name)], terminal=True))

    def _fail(self, job: LiveJob, code: str, message: str) -> Publication:
        """End ``job`` with an error event (returned for the caller's batch)."""
        job.closing = True
        self.engine_loop.send(AbortCmd(job.engine_id))
        self.metrics.failed[code] = self.metrics.failed.get(code, 0) + 1
        return publication(job, [error_event(job.id, code, message, self.name)], terminal=True)

    async def _hand_back(self, job: LiveJob) -> None:
        job.closing = True
        self.engine_loop.send(AbortCmd(job.engine_id))
        self.jobs.pop(job.engine_id, None)
        try:
            ok = await self.leases.handback(job)
        except Exception:
            log.exception("hand-back failed; the job is reclaimed after --reclaim-after",
                          request_id=job.id)
            return
        if ok:
            self.metrics.inc("pagedq:jobs_handed_back_total")
            log.info("handed a job back to the queue", request_id=job.id,
                     tokens=sum(job.generated))

    # -- leases, cancellation, checkpoints --------------------------------------------------
    def _owned(self) -> list[LiveJob]:
        return [j for j in self.jobs.values() if not j.closing]

    async def _renew_once(self) -> None:
        await asyncio.sleep(max(0.05, self.config.reclaim_after / 3))
        # closing jobs too: their terminal event is queued, and they stay ours until it is out
        for job in await self.leases.renew(list(self.jobs.values())):
            if self.jobs.get(job.engine_id) is job and not job.closing:
                log.warning("lease lost; dropping the job", request_id=job.id)
                self.metrics.inc("pagedq:jobs_fenced_total")
                self._drop(job)

    async def _poll_once(self) -> None:
        """Cancellations and lost ownership, without asking Redis about every job each time.

        Each tick reads one key, the queue's cancel hint (clients bump it after cancelling a
        running job): if it moved, every job is checked now. Otherwise only jobs whose state
        nothing has read for ``ownership_check_interval`` are: a successful publish reads the
        epoch and the cancel flag anyway, and the sweep still catches a cancel whose hint was
        lost (a client that died in between, or one on another queue name).
        """
        await asyncio.sleep(self.config.poll_interval)
        owned = self._owned()
        if not owned:
            return
        hint = await self.r.get(self.keys.cancels)
        now = time.monotonic()
        if hint != self._cancel_hint:
            self._cancel_hint = hint
            jobs = owned
        else:
            jobs = [j for j in owned if now - j.checked >= self.config.ownership_check_interval]
        if not jobs:
            return
        for job in jobs:
            job.checked = now
        for res in await self.leases.poll(jobs):
            if res.job.closing or self.jobs.get(res.job.engine_id) is not res.job:
                continue
            if res.lost:
                log.warning("job owned elsewhere now; dropping it", request_id=res.job.id)
                self.metrics.inc("pagedq:jobs_fenced_total")
                self._drop(res.job)
            elif res.cancel:
                self._cancel(res.job)

    async def _checkpoint_tick(self) -> None:
        await asyncio.sleep(self.config.checkpoint_interval)
        await self._checkpoint()

    async def _checkpoint(self) -> None:
        try:
            values = await self.checkpointer.write(
                self._engine_stats, len(self.jobs), "draining" if self.stopping else "serving",
                self._generated_tokens, self._lock_key())
        except Exception:
            self.healthy = False
            raise
        self.healthy = not self.stopping
        self.metrics.queue = values["queue"]


def _error_code(exc: Exception) -> str:
    if isinstance(exc, RequestTooLongError):
        return E_TOO_LONG
    if isinstance(exc, InvalidParamsError):
        return E_INVALID_PARAMS
    if isinstance(exc, (InvalidRequestError, ValueError, TypeError)):
        return E_INVALID_REQUEST
    return E_INTERNAL


def run_worker(config: WorkerConfig, engine: Any = None) -> int:
    """Run a worker until SIGTERM/SIGINT (on uvloop where available); returns the exit code."""
    worker = Worker(config, engine)
    try:
        import uvloop

        return uvloop.run(worker.run())
    except ImportError:
        return asyncio.run(worker.run())


__all__ = ["Request", "Worker", "WorkerConfig", "run_worker"]
