"""Leases: cancellations noticed by the poller, deliveries counted by claims, jobs of a dead
worker reclaimed and dead-lettered once they were delivered too often."""

from __future__ import annotations

import threading
import time

import pytest

from pagedq.client import Client, DeadLetteredError, RequestCancelledError, SamplingParams
from pagedq.client.protocol import (
    E_DEAD_LETTER,
    F_ID,
    F_PAYLOAD,
    GROUP,
    Keys,
    decode_request,
    request_digest,
)
from tests.service.harness import ENGINE, raw_events, running_worker, wait_until


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


def ghost_claims(r, keys, times, max_deliveries):
    """A ghost worker takes the queue's oldest job and dies, ``times`` times over."""
    from pagedq.client.scripts import CLAIM

    stream = keys.jobs("normal")
    for stream_group in keys.all_jobs():
        try:
            r.xgroup_create(stream_group, GROUP, id="0", mkstream=True)
        except Exception:  # BUSYGROUP
            pass
    ((_, ((eid, fields),)),) = r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=1)
    req = decode_request(fields[F_PAYLOAD])
    for _ in range(times):
        r.register_script(CLAIM)(keys=[keys.state(req.id), stream],
                                 args=["ghost", 60, request_digest(req), eid, max_deliveries])
    return req.id


def test_a_job_whose_lone_runs_die_is_dead_lettered(redis_db, redis_client, model):
    """Delivered past --max-deliveries, then its run alone died too: a proven poison."""
    keys = Keys()
    with Client(redis_db) as client:
        h = client.submit([1, 2, 3], SamplingParams(max_tokens=4))
        ghost_claims(redis_client, keys, 2, max_deliveries=1)  # the 2nd claim ran it alone
        with running_worker(redis_db, model, "w1", max_deliveries=1, solo_deaths=1,
                            reclaim_after=0.3):
            with pytest.raises(DeadLetteredError) as info:
                h.result(timeout=30)
        assert info.value.code == E_DEAD_LETTER and "beside it" in str(info.value)
        dead = redis_client.xrange(keys.dead)
        assert len(dead) == 1 and dead[0][1][F_ID] == h.id.encode()
        assert redis_client.xlen(keys.jobs("normal")) == 0


def test_a_suspect_runs_alone_and_a_healthy_one_is_not_dead_lettered(redis_db, redis_client,
                                                                    model, reference):
    """A job delivered past --max-deliveries whose workers died under it (a crash loop, not
    its fault) runs once more with nothing beside it, finishes, and is never dead-lettered;
    the job running beside it when it was reclaimed finishes first."""
    keys = Keys()
    params = SamplingParams(temperature=0, max_tokens=6)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    with Client(redis_db) as client:
        suspect = client.submit([3, 1, 4], params)
        ghost_claims(redis_client, keys, 3, max_deliveries=3)
        with running_worker(redis_db, model, "w1", max_deliveries=3, reclaim_after=0.5):
            other = client.submit([2, 7], long)
            wait_until(lambda: raw_events(redis_client, other.id))
            res = suspect.result(timeout=60)
            other.result(timeout=60)
    assert res.token_ids == reference([3, 1, 4], params)[0]
    assert redis_client.xlen(keys.dead) == 0
    first_suspect = raw_events(redis_client, suspect.id)[0].entry_id
    other_end = raw_events(redis_client, other.id)[-1].entry_id
    assert tuple(map(int, other_end.split("-"))) < tuple(map(int, first_suspect.split("-")))
    assert int(redis_client.hget(keys.state(suspect.id), "solo")) == 1
