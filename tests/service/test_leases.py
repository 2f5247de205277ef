"""Leases: cancellations noticed by the poller, deliveries counted by claims, jobs of a dead
worker reclaimed and dead-lettered once they were delivered too often."""

from __future__ import annotations

import threading
import time

import pytest

from pagedq.client import Client, DeadLetteredError, RequestCancelledError, SamplingParams
from pagedq.client.protocol import E_DEAD_LETTER, F_ID, GROUP, Keys
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


def test_dead_letter_after_too_many_deliveries(redis_db, redis_client, model):
    """A ghost worker takes the job and dies twice; the third delivery is dead-lettered."""
    from pagedq.client.scripts import CLAIM

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
