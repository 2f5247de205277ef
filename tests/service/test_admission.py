"""Admission: priorities, bad and fuzzed entries, a restarted worker's own pending jobs, and the
capacity arithmetic that decides how much to read."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.client import Client, RequestFailedError, SamplingParams
from pagedq.client.protocol import (
    E_BAD_PAYLOAD,
    E_INVALID_PARAMS,
    E_INVALID_REQUEST,
    E_TOO_LONG,
    E_UNSUPPORTED_VERSION,
    F_ID,
    F_PAYLOAD,
    GROUP,
    Keys,
    build_request,
    decode_request,
    job_fields,
    request_digest,
)
from pagedq.worker.config import WorkerConfig
from pagedq.worker.service.admission import Admission, Capacity
from pagedq.worker.service.consumer import Consumer
from pagedq.worker.service.engine_loop import Report
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.metrics_server import Metrics
from pagedq.worker.service.publisher import Publisher
from pagedq.worker.service.shared import Shared
from tests.service.harness import RecordingEngineLoop, raw_events, running_worker, wait_until


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


def test_undecodable_payloads_are_answered_and_bad_ids_never_used(redis_db, redis_client,
                                                                 model):
    """Bugs: (1) a non-msgpack or missing ``p`` under a valid ``id`` got no error event, only a
    dead letter with an empty reason, so its client waited forever; (2) a payload that is not
    a map wrote events under the entry's unvalidated id."""
    keys = Keys()
    stream = keys.jobs("normal")
    with running_worker(redis_db, model, "w1"), Client(redis_db) as client:
        redis_client.xadd(stream, {F_ID: "req1", F_PAYLOAD: b"\xc1\xff"})
        redis_client.xadd(stream, {F_ID: "req2"})  # no payload at all
        redis_client.xadd(stream, {F_ID: "x bad hint!", F_PAYLOAD: msgpack.packb([1, 2])})
        redis_client.xadd(stream, {F_ID: "a}b", F_PAYLOAD: b"\xc1"})
        for rid in ("req1", "req2"):
            with pytest.raises(RequestFailedError) as info:
                client.handle(rid).result(timeout=30)
            assert info.value.code == E_BAD_PAYLOAD and str(info.value)
        wait_until(lambda: redis_client.xlen(stream) == 0)
        wait_until(lambda: redis_client.xlen(keys.dead) == 4)
        reasons = [f[b"reason"] for _, f in redis_client.xrange(keys.dead)]
        assert all(r.startswith(b"bad_payload: ") and len(r) > 20 for r in reasons), reasons
        leaked = [k for k in redis_client.scan_iter("*") if b"bad hint" in k or b"a}b" in k]
        assert leaked == []


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


def test_stable_name_resumes_own_pending_jobs_and_names_are_unique(redis_db, redis_client,
                                                                   model, reference):
    """A worker restarted under its old name takes its own unacked jobs back at once (not after
    --reclaim-after); a second live worker asking for the same name gets a suffix."""
    from pagedq.client.scripts import CLAIM

    keys = Keys()
    params = SamplingParams(temperature=0, max_tokens=9)
    stream = keys.jobs("normal")
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    with Client(redis_db) as client:
        h = client.submit([4, 4, 2], params)
        # "w1" took the job and crashed before writing anything
        ((_, ((eid, fields),)),) = redis_client.xreadgroup(GROUP, "w1", {stream: ">"})
        digest = request_digest(decode_request(fields[F_PAYLOAD]))
        redis_client.register_script(CLAIM)(keys=[keys.state(h.id), stream],
                                            args=["w1", 60, digest, eid, 3])
        with running_worker(redis_db, model, "w1", reclaim_after=600) as first, \
                running_worker(redis_db, model, "w1", reclaim_after=600) as second:
            res = h.result(timeout=30)  # far sooner than the 600 s reclaim
            assert (first.name, second.name) == ("w1", "w1-2")
    assert res.token_ids == reference([4, 4, 2], params)[0]
    assert {e.worker for e in raw_events(redis_client, h.id)} == {"w1"}


def test_capacity_counts_adds_in_flight_and_entries_being_claimed():
    cap = Capacity()
    cap.update(Report(capacity=8, adds_done=0))
    assert cap.free() == 8
    cap.reserved += 3  # three entries read, being claimed
    assert cap.free() == 5
    cap.reserved -= 3
    cap.adds_sent += 3  # ...claimed and sent: the engine has not reported them yet
    assert cap.free() == 5
    cap.update(Report(capacity=5, adds_done=3))  # its report now counts them itself
    assert cap.free() == 5
    cap.adds_sent += 6  # more sent than the last report allowed: over-committed, read nothing
    assert cap.free() == -1
    cap.update(Report(capacity=0, adds_done=9))
    assert cap.free() == 0


def test_the_reader_takes_only_what_fits(redis_db, redis_client):
    """XREADGROUP asks for the free capacity: the rest stays in the stream for other workers
    until the engine reports room again."""
    keys = Keys()
    reqs = [build_request([1, i], SamplingParams(max_tokens=2)) for i in range(5)]

    async def scenario():
        r = redis.asyncio.Redis.from_url(redis_db)
        consumer = Consumer(r, keys, "w")
        await consumer.ensure_groups()
        for req in reqs:
            await r.xadd(keys.jobs("normal"), job_fields(req))
        loop = RecordingEngineLoop()
        shared = Shared(WorkerConfig(read_block_ms=0), loop, Metrics("m"))
        jobs = shared.jobs
        admission = Admission(shared, r, keys, consumer, Leases(r, keys, "w", 60),
                              Publisher(r, keys, 60, "w"))
        admission.capacity.update(Report(capacity=2))
        await admission.read_once()
        first = ([c.engine_id for c in loop.sent], admission.capacity.free(),
                 (await r.xpending(keys.jobs("normal"), GROUP))["pending"])
        await admission.read_once()  # full: waits for a report, reads nothing
        second = len(loop.sent)
        admission.on_report(Report(capacity=3, adds_done=2))
        await admission.read_once()
        await r.aclose()
        return first, second, [c.engine_id for c in loop.sent], jobs

    (sent, free, pending), second, all_sent, jobs = asyncio.run(scenario())
    assert sorted(sent) == sorted(f"{r.id}#1" for r in reqs[:2])  # the oldest two
    assert free == 0 and pending == 2
    assert second == 2
    assert sorted(all_sent) == sorted(f"{r.id}#1" for r in reqs) and set(jobs) == set(all_sent)
