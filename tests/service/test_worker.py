"""The composed worker in-process (threads) against a real Redis and tiny seeded models: many
jobs on two workers, cancellation, deadlines, readers that come late or reconnect, a Redis
restart mid-job, and the thread the model loads on.

The oracle for every generated token is the in-process Engine (itself checked against
transformers in the engine tests); the oracle for the stream is the raw Redis entries.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from structlog.testing import capture_logs

from pagedq.client import Client, RequestCancelledError, SamplingParams
from pagedq.client.protocol import Keys
from pagedq.embedded_redis import EmbeddedRedis, free_port
from pagedq.worker.service.worker import in_own_thread
from tests.service.harness import raw_events, running_worker, wait_until


def test_two_workers_many_jobs_equal_the_engine(redis_db, redis_client, model, reference):
    jobs = []
    for i in range(14):
        prompt = [1 + i, 7, 9 + 2 * i, 3][: 2 + i % 3]
        if i % 3 == 0:
            params = SamplingParams(temperature=0, max_tokens=10 + i)
        elif i % 3 == 1:
            params = SamplingParams(temperature=0.8, seed=100 + i, max_tokens=12)
        else:
            params = SamplingParams(n=2, temperature=1.0, seed=7 * i, max_tokens=8)
        jobs.append((prompt, params))
    with running_worker(redis_db, model, "w1"), running_worker(redis_db, model, "w2"), \
            Client(redis_db) as client:
        handles = [client.submit(p, sp) for p, sp in jobs]
        streamed = [list(h.stream(timeout=120)) for h in handles]
        results = [h.result(timeout=1) for h in handles]
        assert client.stats()["depth"] == 0
    writers = set()
    for (prompt, params), events, res, h in zip(jobs, streamed, results, handles, strict=True):
        assert [o.token_ids for o in res.outputs] == reference(prompt, params)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert events[-1].type == "finished" and sum(e.terminal for e in events) == 1
        raw = raw_events(redis_client, h.id)
        assert [(e.seq, e.token_ids) for e in raw] == [(e.seq, e.token_ids) for e in events]
        for i, out in enumerate(res.outputs):
            toks = [t for e in raw if e.type == "tokens" and e.index == i for t in e.token_ids]
            assert toks == out.token_ids
        assert res.usage["completion_tokens"] == sum(len(o.token_ids) for o in res.outputs)
        assert res.usage["prompt_tokens"] == len(prompt)
        writers |= {e.worker for e in events}
    assert writers == {"w1", "w2"}
    assert redis_client.xlen(Keys().jobs("normal")) == 0  # acked jobs are deleted


def test_cancel_running_and_queued_jobs(redis_db, redis_client, model):
    # 1000 tokens: the tiny model decodes 200 in ~0.1 s, which a loaded client thread can take
    # between reading the first event and cancelling (then the job ends before the cancel)
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    with Client(redis_db) as client:
        queued = client.submit([1, 2, 3], long)  # no worker yet: cancelled by the client
        assert queued.cancel()
        with pytest.raises(RequestCancelledError):
            queued.result(timeout=5)
        engine = dict(max_num_seqs=1, max_model_len=1024, num_kv_blocks=128)
        with running_worker(redis_db, model, "w1", engine=engine):
            running = client.submit([4, 5, 6], long)
            events = running.stream(timeout=60)
            first = next(events)
            assert first.type == "tokens"
            assert running.cancel()
            with pytest.raises(RequestCancelledError) as info:
                running.result(timeout=30)
            partial = info.value.partial.token_ids
            assert 0 < len(partial) < 1000
            # blocks freed at once: the next job runs (max_num_seqs=1) and finishes
            assert client.submit([7, 8], SamplingParams(max_tokens=3)).result(30).token_ids
            wait_until(lambda: redis_client.xlen(Keys().jobs("normal")) == 0)
        assert not running.cancel()  # already ended
        evs = raw_events(redis_client, queued.id)
        assert [e.type for e in evs] == ["cancelled"]


def test_deadlines(redis_db, model):
    big = dict(max_model_len=1024, num_kv_blocks=128)
    with running_worker(redis_db, model, "w1", engine=big), Client(redis_db) as client:
        expired = client.submit([1, 2], SamplingParams(max_tokens=5), deadline=time.time() - 1)
        res = expired.result(timeout=30)
        assert res.finish_reason == "deadline" and res.token_ids == []
        # the deadline falls a third of the way through the job, however fast this CPU runs
        # it (a Zen 5 core decodes the tiny model's 1000 tokens in under 0.5 s)
        params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)
        started = time.monotonic()
        assert len(client.submit([3, 4], params).result(timeout=60).token_ids) == 1000
        budget = min(0.5, (time.monotonic() - started) / 3)
        running = client.submit([3, 4], params, deadline=time.time() + budget)
        res = running.result(timeout=60)
        assert res.finish_reason == "deadline" and len(res.token_ids) < 1000


def test_late_and_reconnecting_readers_see_the_same_stream(redis_db, model):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with running_worker(redis_db, model, "w1"), Client(redis_db) as client:
        h = client.submit([5, 6, 7], params)
        first = []
        for ev in h.stream(timeout=60):  # a reader that drops after 3 events...
            first.append(ev)
            if len(first) == 3:
                break
        resumed = client.handle(h.id, after=first[-1].entry_id)  # ...and reconnects
        rest = list(resumed.stream(timeout=60))
        assert [e.seq for e in first + rest] == list(range(1, len(first) + len(rest) + 1))
        full = h.result(timeout=60)  # the original handle continues from its cursor too
        late = client.handle(h.id).result(timeout=5)  # joins after the end: replays it all
        joined = [t for e in first + rest for t in e.token_ids]
        assert joined == full.token_ids == late.token_ids and len(joined) == 20


def test_model_loading_thread_ends_with_the_load():
    """The engine is built on a thread that exits afterwards (an idle OpenMP pool left on a
    long-lived thread would stop libgomp spin-waiting for the engine thread)."""
    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x * 2

    async def main():
        assert await in_own_thread(work, 21) == 42
        with pytest.raises(ValueError):
            await in_own_thread(int, "not a number")

    asyncio.run(main())
    seen[0].join(5)
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()


def test_a_redis_restart_mid_job_loses_no_event(tmp_path, model, reference):
    """Redis goes away while a job generates and comes back (same data, AOF): every call of
    the worker waits it out through redis-py's Retry, the engine keeps stepping, and the
    client gets the whole stream, gap-free and equal to the engine's."""
    port = free_port()
    server = EmbeddedRedis.start(port=port, workdir=str(tmp_path), appendonly=True)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    restarted = None
    try:
        with capture_logs() as logs, \
                running_worker(server.url, model, "w1", reclaim_after=30) as worker, \
                Client(server.url) as client:
            h = client.submit([3, 1, 4], params)
            r = redis.Redis.from_url(server.url)
            wait_until(lambda: raw_events(r, h.id))
            r.close()
            server.stop()
            time.sleep(1.0)
            restarted = EmbeddedRedis.start(port=port, workdir=str(tmp_path), appendonly=True,
                                            password=server.password)  # the same server again
            res = h.result(timeout=120)
            r = redis.Redis.from_url(server.url)
            events = raw_events(r, h.id)
            r.close()
            wait_until(lambda: not worker.jobs)
    finally:
        (restarted or server).stop()
    assert res.token_ids == reference([3, 1, 4], params)[0]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [t for e in events for t in e.token_ids] == res.token_ids
    messages = [e["event"] for e in logs]
    assert messages.count("Redis unreachable; every call waits and retries until it is back") == 1, \
        messages
    assert "task failed; carrying on" not in messages


def test_a_model_that_does_not_load_ends_its_wait_as_failed(redis_db):
    """`pagedq worker --model nonexistent`: the load's wait ends "failed", never "done", then
    one error line whose hint names the current Hugging Face CLI; exit code 2."""
    from pagedq.worker.config import WorkerConfig
    from pagedq.worker.service.worker import Worker

    with capture_logs() as logs:
        code = asyncio.run(Worker(WorkerConfig(model="nonexistent/model",
                                               redis_url=redis_db)).run())
    assert code == 2
    events = [e["event"] for e in logs]
    assert "done: loading the model" not in events
    (error,) = [e for e in logs if e["event"] == "cannot load the model"]
    assert "`hf download ORG/NAME`" in error["error"]
    if "loading the model" in events:  # announced (delay 0) before the load failed
        assert events.index("failed: loading the model") < events.index("cannot load the model")
