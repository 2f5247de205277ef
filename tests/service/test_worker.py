"""The queue worker in-process (threads) against a real Redis and tiny seeded models.

The oracle for every generated token is the in-process Engine (itself checked against
transformers in the engine tests); the oracle for the stream is the raw Redis entries.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from contextlib import contextmanager

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.client import (
    Client,
    DeadLetteredError,
    RequestCancelledError,
    RequestFailedError,
    SamplingParams,
)
from pagedq.client.protocol import (
    E_DEAD_LETTER,
    E_INVALID_PARAMS,
    E_INVALID_REQUEST,
    E_TOO_LONG,
    E_UNSUPPORTED_VERSION,
    F_ID,
    F_PAYLOAD,
    GROUP,
    Keys,
    build_request,
    decode_event,
    job_fields,
)
from pagedq.worker.config import WorkerConfig
from pagedq.worker.service.worker import Worker, in_own_thread

ENGINE = dict(num_kv_blocks=64, max_num_seqs=4, max_model_len=256)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(model):
    """The in-process engine: what every worker result must equal."""
    from pagedq.worker import Engine

    engine = Engine(model, **ENGINE)

    def run(prompt, params):
        return [o.token_ids for o in engine.generate([prompt], params)[0].outputs]

    return run


@contextmanager
def running_worker(redis_url, model, name, engine_instance=None, **overrides):
    engine = dict(ENGINE, **overrides.pop("engine", {}))
    cfg = WorkerConfig(model=model, redis_url=redis_url, consumer_name=name, reclaim_after=1.0,
                       checkpoint_interval=0.2, poll_interval=0.05, read_block_ms=200,
                       drain_timeout=5, engine=engine)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    worker = Worker(cfg, engine_instance)
    errors = []

    def target():
        try:
            code = asyncio.run(worker.run())
            if code:
                errors.append(f"worker exited with code {code} (see its log)")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while not worker.ready.wait(0.1):
        assert thread.is_alive(), errors
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(90)
        if thread.is_alive():  # show where it hangs rather than a bare "still alive"
            import faulthandler
            import sys

            faulthandler.dump_traceback(sys.stderr)
    assert not thread.is_alive(), "the worker did not stop within 90 s (stacks dumped above)"
    assert not errors, errors


def raw_events(r, request_id):
    return [decode_event(f, i) for i, f in r.xrange(Keys().out(request_id))]


def wait_until(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


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
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with Client(redis_db) as client:
        queued = client.submit([1, 2, 3], long)  # no worker yet: cancelled by the client
        assert queued.cancel()
        with pytest.raises(RequestCancelledError):
            queued.result(timeout=5)
        with running_worker(redis_db, model, "w1", engine=dict(max_num_seqs=1)):
            running = client.submit([4, 5, 6], long)
            events = running.stream(timeout=60)
            first = next(events)
            assert first.type == "tokens"
            assert running.cancel()
            with pytest.raises(RequestCancelledError) as info:
                running.result(timeout=30)
            partial = info.value.partial.token_ids
            assert 0 < len(partial) < 200
            # blocks freed at once: the next job runs (max_num_seqs=1) and finishes
            assert client.submit([7, 8], SamplingParams(max_tokens=3)).result(30).token_ids
            wait_until(lambda: redis_client.xlen(Keys().jobs("normal")) == 0)
        assert not running.cancel()  # already ended
        evs = raw_events(redis_client, queued.id)
        assert [e.type for e in evs] == ["cancelled"]


class GatedEngine:
    """A real engine whose steps wait at a gate: its jobs stay owned but publish nothing,
    so only the poller can notice that they were cancelled."""

    def __init__(self, engine):
        self._engine = engine
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        self.gate.wait()
        return self._engine.step()


@pytest.mark.parametrize("via", ["client", "raw_flag"])
def test_cancel_of_a_job_that_publishes_nothing(redis_db, redis_client, model, via):
    """client.cancel() bumps the queue's cancel hint, so the worker checks at its next tick
    (the sweep is 60 s here); a bare cancel flag (a client that died before the hint) is
    caught by the ownership sweep instead (0.3 s here)."""
    from pagedq.worker import Engine

    gated = GatedEngine(Engine(model, **ENGINE))
    sweep = 60.0 if via == "client" else 0.3
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with Client(redis_db) as client, running_worker(redis_db, model, "w1", gated,
                                                    ownership_check_interval=sweep) as worker:
        try:
            handle = client.submit([4, 5, 6], params)
            wait_until(lambda: redis_client.hexists(Keys().state(handle.id), "owner"))
            wait_until(lambda: any(j.id == handle.id for j in list(worker.jobs.values())))
            if via == "client":
                assert handle.cancel()
            else:
                redis_client.hset(Keys().state(handle.id), "cancel", "1")
            began = time.monotonic()
            with pytest.raises(RequestCancelledError):
                handle.result(timeout=30)
            assert time.monotonic() - began < 20  # the client case's sweep would take 60 s
        finally:
            gated.gate.set()
        assert [e.type for e in raw_events(redis_client, handle.id)] == ["cancelled"]


def test_deadlines(redis_db, model):
    big = dict(max_model_len=1024, num_kv_blocks=128)
    with running_worker(redis_db, model, "w1", engine=big), Client(redis_db) as client:
        expired = client.submit([1, 2], SamplingParams(max_tokens=5), deadline=time.time() - 1)
        res = expired.result(timeout=30)
        assert res.finish_reason == "deadline" and res.token_ids == []
        running = client.submit([3, 4], SamplingParams(max_tokens=1000, ignore_eos=True,
                                                       temperature=0), deadline=time.time() + 0.5)
        res = running.result(timeout=60)
        assert res.finish_reason == "deadline" and len(res.token_ids) < 1000


def test_priorities_read_highest_first(redis_db, model):
    params = SamplingParams(temperature=0, max_tokens=4)
    with Client(redis_db) as client:
        lows = client.submit_many([[1, i] for i in range(3, 9)], params, priority=-1)
        high = client.submit([2, 2], params, priority=5)
        with running_worker(redis_db, model, "w1", engine=dict(max_num_seqs=1)):
            order = []
            for h in [high, *lows]:
                h.result(timeout=60)
            for h in [high, *lows]:
                order.append(h.builder.terminal.entry_id)
    assert order[0] == min(order)  # the high-priority job finished first


def test_bad_requests_get_error_events_and_the_worker_keeps_serving(redis_db, redis_client,
                                                                   model):
    keys = Keys()
    cases = {
        "badver": ({"v": 99}, E_UNSUPPORTED_VERSION),
        "badparams": ({"params": {"top_p": 7}}, E_INVALID_PARAMS),
        "badtypo": ({"params": {"max_token": 3}}, E_INVALID_PARAMS),
        "empty": ({"prompt_token_ids": []}, E_INVALID_REQUEST),
        "oov": ({"prompt_token_ids": [99999]}, E_INVALID_REQUEST),
        "toolong": ({"prompt_token_ids": [1] * 300}, E_TOO_LONG),
        "text": ({"prompt_token_ids": None, "prompt": "no tokenizer here"}, E_INVALID_REQUEST),
    }
    with running_worker(redis_db, model, "w1"), Client(redis_db) as client:
        client._ensure_groups()
        for rid, (over, _) in cases.items():
            body = {"v": 1, "id": rid, "prompt_token_ids": [1, 2], "params": {}}
            body.update(over)
            body = {k: v for k, v in body.items() if v is not None}
            redis_client.xadd(keys.jobs("normal"), {F_ID: rid, F_PAYLOAD: msgpack.packb(body)})
        redis_client.xadd(keys.jobs("normal"), {b"junk": b"\xff\x00"})  # unaddressable
        for rid, (_, code) in cases.items():
            with pytest.raises(RequestFailedError) as info:
                client.handle(rid).result(timeout=30)
            assert info.value.code == code, (rid, info.value)
        assert client.submit([1, 2], SamplingParams(max_tokens=2)).result(30).token_ids
        wait_until(lambda: redis_client.xlen(keys.dead) == 1)
        dead = redis_client.xrange(keys.dead)[0][1]
        assert dead[b"junk"] == b"\xff\x00" and b"bad_payload" in dead[b"reason"]
        wait_until(lambda: redis_client.xlen(keys.jobs("normal")) == 0)


_field = st.sampled_from([F_ID, F_PAYLOAD, b"x"])
_value = (st.binary(max_size=40)
          | st.builds(lambda d: msgpack.packb(d), st.fixed_dictionaries(
              {}, optional={"v": st.sampled_from([1, 2]) | st.none(),
                            "id": st.sampled_from(["fz-1", "fz 2", ""]) | st.integers(),
                            "prompt_token_ids": st.lists(st.integers(-2, 500), max_size=4),
                            "prompt": st.text(max_size=5),
                            "params": st.dictionaries(st.sampled_from(
                                ["max_tokens", "n", "temperature", "seed", "bogus"]),
                                st.integers(-3, 5) | st.floats(allow_nan=True) | st.none(),
                                max_size=3)})))


def test_fuzzed_raw_entries_never_crash_the_worker(redis_db, redis_client, model):
    keys = Keys()
    with running_worker(redis_db, model, "w1", engine=dict(max_num_seqs=8)) as worker, \
            Client(redis_db) as client:
        client._ensure_groups()

        @settings(max_examples=40, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.dictionaries(_field, _value, max_size=3))
        def fuzz(fields):
            fields = fields or {b"x": b""}
            for rid in (b"fz-1", b"fz"):  # fresh per example: old terminal states are cleared
                redis_client.delete(keys.out(rid.decode()), keys.state(rid.decode()))
            redis_client.xadd(keys.jobs("normal"), fields)
            wait_until(lambda: redis_client.xlen(keys.jobs("normal")) == 0
                       and not worker.jobs, timeout=30)

        fuzz()
        pend = redis_client.xpending(keys.jobs("normal"), GROUP)["pending"]
        assert pend == 0
        assert client.submit([1, 2], SamplingParams(max_tokens=2)).result(30).token_ids


def test_dead_letter_after_too_many_deliveries(redis_db, redis_client, model):
    """A ghost worker takes the job and dies twice; the third delivery is dead-lettered."""
    from pagedq.worker.service.scripts import CLAIM

    keys = Keys()
    with Client(redis_db) as client:
        h = client.submit([1, 2, 3], SamplingParams(max_tokens=4))
        redis_client.xreadgroup(GROUP, "ghost", {keys.jobs("normal"): ">"})
        claim = redis_client.register_script(CLAIM)
        claim(keys=[keys.state(h.id)], args=["ghost", 60])  # delivery 1, then the ghost dies
        with running_worker(redis_db, model, "w1", max_deliveries=1, reclaim_after=0.3):
            with pytest.raises(DeadLetteredError) as info:
                h.result(timeout=30)
        assert info.value.code == E_DEAD_LETTER
        dead = redis_client.xrange(keys.dead)
        assert len(dead) == 1 and dead[0][1][F_ID] == h.id.encode()
        assert redis_client.xlen(keys.jobs("normal")) == 0


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


def test_checkpoint_keys_metrics_and_cleanup(redis_db, redis_client, model):
    keys = Keys()
    with running_worker(redis_db, model, "ck", metrics_port=0, ttl=120) as worker, \
            Client(redis_db) as client:
        h = client.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
        h.result(timeout=30)

        def settled():
            w = client.stats()["workers"][0]
            return w["generated_tokens"] >= 8 and w["kv_blocks_used"] == 0 and w["running"] == 0

        wait_until(settled)  # the idle engine's stats reach the next checkpoint
        info = client.stats()["workers"][0]
        assert info["name"] == "ck" and info["kv_blocks_total"] == ENGINE["num_kv_blocks"]
        assert info["waiting"] == 0 and info["jobs"] == 0 and info["state"] == "serving"
        assert info["num_generated_tokens"] == 8 and info["kv_tokens_live"] == 0
        assert {"heartbeat", "kv_tokens_live", "preemptions", "tokens_per_s"} <= info.keys()
        assert 0 < redis_client.pttl(keys.worker("ck")) <= 5000
        assert 0 < redis_client.pttl(keys.stats) <= 5000
        assert 0 < redis_client.ttl(keys.out(h.id)) <= 120
        assert 0 < redis_client.ttl(keys.state(h.id)) <= 120
        base = f"http://127.0.0.1:{worker.metrics_port}"
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
                     "vllm:inter_token_latency_seconds_count", 'finished_reason="length"'):
            assert name in text
        assert urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
    assert not redis_client.exists(keys.worker("ck"))
    assert redis_client.zrange(keys.workers, 0, -1) == []


def test_fenced_worker_writes_nothing(redis_db, redis_client):
    """The publish script refuses a stale epoch; a reclaimed job's stream stays one sequence."""
    from pagedq.client.protocol import TOKENS, Event
    from pagedq.worker.service.leases import Leases
    from pagedq.worker.service.publisher import FENCED, OK, Publication, Publisher

    keys = Keys()
    req = build_request([1, 2])
    redis_client.xgroup_create(keys.jobs("normal"), GROUP, id="0", mkstream=True)
    eid = redis_client.xadd(keys.jobs("normal"), job_fields(req)).decode()

    async def scenario():
        r = redis.asyncio.Redis.from_url(redis_db)
        old, new = Leases(r, keys, "old", 60), Leases(r, keys, "new", 60)
        pub = Publisher(r, keys, 60, "x")
        c_old = await old.claim(req.id)
        ev = Event(type=TOKENS, request_id=req.id, token_ids=[9], position=1)
        first = await pub.send([Publication(req.id, c_old.epoch, keys.jobs("normal"), eid, 0,
                                            [ev])])
        again = await pub.send([Publication(req.id, c_old.epoch, keys.jobs("normal"), eid, 0,
                                            [ev])])  # a retry: idempotent
        c_new = await new.claim(req.id)
        stale = await pub.send([Publication(req.id, c_old.epoch, keys.jobs("normal"), eid, 1,
                                            [ev], terminal=True)])
        await r.aclose()
        return first, again, c_new, stale

    first, again, c_new, stale = asyncio.run(scenario())
    assert first[0].status == OK and again[0].status == OK
    assert c_new.seq == 1 and c_new.deliveries == 2
    assert stale[0].status == FENCED
    assert [e.seq for e in raw_events(redis_client, req.id)] == [1]
    assert redis_client.xlen(keys.jobs("normal")) == 1  # the stale terminal did not ack it


def test_parse_autoclaim_both_reply_shapes(redis_client):
    from pagedq.worker.service.consumer import parse_autoclaim

    s = "pq-test"
    redis_client.xgroup_create(s, GROUP, id="0", mkstream=True)
    a = redis_client.xadd(s, {"k": "1"})
    b = redis_client.xadd(s, {"k": "2"})
    redis_client.xreadgroup(GROUP, "c1", {s: ">"})
    redis_client.xdel(s, a)  # deleted while pending
    redis_client.response_callbacks.pop("XAUTOCLAIM", None)
    reply = redis_client.execute_command("XAUTOCLAIM", s, GROUP, "c2", 0, "0-0")
    cursor, entries, deleted, nils = parse_autoclaim(reply)
    assert cursor == "0-0" and entries == [(b.decode(), {b"k": b"2"})]
    version = int(redis_client.info()["redis_version"].split(".")[0])
    if version >= 7:
        assert deleted == [a.decode()] and nils == 0
    else:  # 6.2: a bare nil per deleted entry
        assert deleted == [] and nils == 1
    seven = [b"0-0", [[b"5-0", [b"k", b"v"]]], [b"4-0"]]
    assert parse_autoclaim(seven) == ("0-0", [("5-0", {b"k": b"v"})], ["4-0"], 0)
    six = [b"0-0", [None, [b"5-0", [b"k", b"v"]]]]
    assert parse_autoclaim(six) == ("0-0", [("5-0", {b"k": b"v"})], [], 1)


def test_reclaim_acks_entries_deleted_while_pending(redis_db, redis_client):
    """Whatever the server version, a pending entry that was deleted is found and acked."""
    from pagedq.worker.service.consumer import Consumer

    keys = Keys()

    async def scenario():
        r = redis.asyncio.Redis.from_url(redis_db)
        ghost, me = Consumer(r, keys, "ghost"), Consumer(r, keys, "me")
        await ghost.ensure_groups()
        stream = keys.jobs("normal")
        gone = (await r.xadd(stream, {"k": "1"})).decode()
        kept = (await r.xadd(stream, {"k": "2"})).decode()
        await ghost.read(10, 0)
        await r.xdel(stream, gone)
        entries = await me.reclaim(10, 0)
        for e in entries:
            if e.fields is None:
                await me.ack_delete(e.stream, e.entry_id)
        pending = await r.xpending(stream, GROUP)
        await r.aclose()
        return entries, pending, gone, kept

    entries, pending, gone, kept = asyncio.run(scenario())
    assert {(e.entry_id, e.fields is None) for e in entries} == {(gone, True), (kept, False)}
    assert pending["pending"] == 1


def test_stable_name_resumes_own_pending_jobs_and_names_are_unique(redis_db, redis_client,
                                                                   model, reference):
    """A worker restarted under its old name takes its own unacked jobs back at once (not after
    --reclaim-after); a second live worker asking for the same name gets a suffix."""
    from pagedq.worker.service.scripts import CLAIM

    keys = Keys()
    params = SamplingParams(temperature=0, max_tokens=9)
    with Client(redis_db) as client:
        h = client.submit([4, 4, 2], params)
        # "w1" took the job and crashed before writing anything
        redis_client.xreadgroup(GROUP, "w1", {keys.jobs("normal"): ">"})
        redis_client.register_script(CLAIM)(keys=[keys.state(h.id)], args=["w1", 60])
        with running_worker(redis_db, model, "w1", reclaim_after=600) as first, \
                running_worker(redis_db, model, "w1", reclaim_after=600) as second:
            res = h.result(timeout=30)  # far sooner than the 600 s reclaim
            assert (first.name, second.name) == ("w1", "w1-2")
    assert res.token_ids == reference([4, 4, 2], params)[0]
    assert {e.worker for e in raw_events(redis_client, h.id)} == {"w1"}


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
