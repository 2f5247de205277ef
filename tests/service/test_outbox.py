"""The outbox: engine reports become one fenced publish per job, and each publish outcome
settles its job (finished and acked, lost to another worker, cancelled by its client)."""

from __future__ import annotations

import asyncio

import redis

from pagedq.client.protocol import (
    E_INTERNAL,
    E_INVALID_PARAMS,
    E_INVALID_REQUEST,
    E_TOO_LONG,
    Keys,
    build_request,
    job_fields,
    request_digest,
)
from pagedq.errors import (
    EngineError,
    InvalidParamsError,
    InvalidRequestError,
    RequestTooLongError,
)
from pagedq.params import SamplingParams
from pagedq.worker.config import WorkerConfig
from pagedq.worker.engine.outputs import StepOutput
from pagedq.worker.service.consumer import Consumer
from pagedq.worker.service.engine_loop import Report
from pagedq.worker.service.job import LiveJob
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.metrics_server import Metrics
from pagedq.worker.service.outbox import Outbox, error_code
from pagedq.worker.service.publisher import Publisher
from pagedq.worker.service.shared import Shared
from tests.service.harness import RecordingEngineLoop, raw_events

KEYS = Keys()


async def start_job(r, leases, jobs, prompt, params):
    """Enqueue, claim and register a job as admission would (without an engine)."""
    req = build_request(prompt, params)
    eid = (await r.xadd(KEYS.jobs("normal"), job_fields(req))).decode()
    claim = await leases.claim(req.id, KEYS.jobs("normal"), eid, request_digest(req))
    n = params.n
    job = LiveJob(req, KEYS.jobs("normal"), eid, job_fields(req), claim.epoch, claim.seq,
                  [0] * n, [None] * n)
    jobs[job.engine_id] = job
    return job


def step(job, tokens, generated, finished=False):
    return StepOutput(job.engine_id, 0, tokens, "", generated, finished,
                      "length" if finished else None,
                      usage={"prompt_tokens": 2} if finished else {})


def scenario(redis_db, body):
    async def run():
        r = redis.asyncio.Redis.from_url(redis_db)
        try:
            shared = Shared(WorkerConfig(), RecordingEngineLoop(), Metrics("m"))
            loop, jobs, metrics = shared.engine_loop, shared.jobs, shared.metrics
            outbox = Outbox(shared, Publisher(r, KEYS, 60, "w"))
            await Consumer(r, KEYS, "w").ensure_groups()
            return await body(r, Leases(r, KEYS, "w", 60), outbox, loop, jobs, metrics)
        finally:
            await r.aclose()

    return asyncio.run(run())


def test_queued_steps_merge_into_one_publish_and_a_finished_job_settles(redis_db,
                                                                       redis_client):
    async def body(r, leases, outbox, loop, jobs, metrics):
        job = await start_job(r, leases, jobs, [1, 2], SamplingParams(max_tokens=3))
        outbox.put_report(Report(outputs=[step(job, [5, 6], 2)]))
        outbox.put_report(Report(outputs=[step(job, [7], 3, finished=True)]))
        await outbox.publish_once()  # both steps and the terminal event in one call
        return job

    job = scenario(redis_db, body)
    events = raw_events(redis_client, job.id)
    assert [(e.seq, e.type, e.token_ids, e.position) for e in events] == [
        (1, "tokens", [5, 6], 2), (2, "tokens", [7], 3), (3, "finished", [], 0)]
    assert events[1].finish_reason == "length" and events[2].usage == {
        "prompt_tokens": 2, "completion_tokens": 3}
    assert redis_client.xlen(KEYS.jobs("normal")) == 0  # acked with its terminal event


def test_fenced_jobs_are_dropped_and_cancelled_ones_end_cancelled(redis_db, redis_client):
    async def body(r, leases, outbox, loop, jobs, metrics):
        lost = await start_job(r, leases, jobs, [1, 2], SamplingParams(max_tokens=9))
        cancelled = await start_job(r, leases, jobs, [3, 4], SamplingParams(max_tokens=9))
        await Leases(r, KEYS, "other", 60).claim(lost.id, lost.stream, lost.entry_id,
                                                 request_digest(lost.request))
        await r.hset(KEYS.state(cancelled.id), "cancel", "1")  # a client flagged it
        outbox.put_report(Report(outputs=[step(lost, [5], 1), step(cancelled, [6], 1)]))
        await outbox.publish_once()
        after_first = (set(jobs), list(loop.aborted), outbox.empty)
        await outbox.publish_once()  # the queued CANCELLED event
        return lost, cancelled, after_first, jobs, metrics

    lost, cancelled, (table, aborted, empty), jobs, metrics = scenario(redis_db, body)
    assert table == {cancelled.engine_id} and not empty
    assert aborted == [lost.engine_id, cancelled.engine_id]
    assert raw_events(redis_client, lost.id) == []  # the fenced publish wrote nothing
    assert [e.type for e in raw_events(redis_client, cancelled.id)] == ["tokens", "cancelled"]
    assert jobs == {}
    assert metrics.counters["pagedq:jobs_fenced_total"] == 1
    assert metrics.counters["pagedq:jobs_cancelled_total"] == 1


def test_rejected_and_failed_requests_end_with_their_error_code(redis_db, redis_client):
    async def body(r, leases, outbox, loop, jobs, metrics):
        too_long = await start_job(r, leases, jobs, [1, 2], SamplingParams())
        running = await start_job(r, leases, jobs, [3, 4], SamplingParams())
        outbox.put_report(Report(rejected=[(too_long.engine_id, RequestTooLongError("long"))]))
        await outbox.publish_once()
        outbox.put_report(Report(step_error=RuntimeError("boom")))  # retried by the thread
        await outbox.publish_once()
        untouched = (raw_events(redis_client, running.id), set(jobs))
        outbox.put_report(Report(rejected=[(running.engine_id, EngineError("blamed"))]))
        await outbox.publish_once()
        return too_long, running, jobs, metrics, untouched

    too_long, running, jobs, metrics, (events, table) = scenario(redis_db, body)
    assert events == [] and table == {running.engine_id}  # a failed step fails nobody yet
    (ev,) = raw_events(redis_client, too_long.id)
    assert (ev.type, ev.error_code, ev.error) == ("error", E_TOO_LONG, "long")
    (ev,) = raw_events(redis_client, running.id)
    assert ev.error_code == E_INTERNAL and "blamed" in ev.error
    assert jobs == {} and metrics.failed == {E_TOO_LONG: 1, E_INTERNAL: 1}
    assert metrics.counters["pagedq:engine_step_failures_total"] == 1


def test_a_stream_behind_the_worker_hands_the_job_back(redis_db, redis_client):
    """A failover that lost some writes leaves the stream behind this worker's seq: the job is
    handed back (its next owner resumes from the stream) rather than given up."""
    async def body(r, leases, outbox, loop, jobs, metrics):
        job = await start_job(r, leases, jobs, [1, 2], SamplingParams(max_tokens=9))
        given_back = []

        async def give_back(j):
            given_back.append(j)

        outbox.give_back = give_back
        job.seq = 5  # the worker wrote 5 events; Redis holds none of them
        outbox.put_report(Report(outputs=[step(job, [5], 1)]))
        await outbox.publish_once()
        await asyncio.sleep(0)
        return job, given_back

    job, given_back = scenario(redis_db, body)
    assert given_back == [job] and raw_events(redis_client, job.id) == []


def test_error_codes_of_engine_exceptions():
    assert error_code(RequestTooLongError("x")) == E_TOO_LONG
    assert error_code(InvalidParamsError("x")) == E_INVALID_PARAMS
    for exc in (InvalidRequestError("x"), ValueError("x"), TypeError("x")):
        assert error_code(exc) == E_INVALID_REQUEST
    assert error_code(RuntimeError("x")) == E_INTERNAL
