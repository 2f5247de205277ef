"""The publisher: one fenced, idempotent PUBLISH per job per batch."""

from __future__ import annotations

import asyncio

import redis

from pagedq.client.protocol import GROUP, TOKENS, Event, Keys, build_request, job_fields
from pagedq.worker.service.job import LiveJob
from pagedq.worker.service.leases import Leases
from pagedq.worker.service.publisher import (
    FENCED,
    OK,
    Publication,
    Publisher,
    merge,
    publication,
)
from tests.service.harness import raw_events


def test_fenced_worker_writes_nothing(redis_db, redis_client):
    """The publish script refuses a stale epoch; a reclaimed job's stream stays one sequence."""
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


def test_merge_joins_a_jobs_queued_steps_and_stops_at_its_terminal_event():
    def pub(rid, epoch, seq, token, terminal=False):
        return Publication(rid, epoch, "s", "1-0", seq,
                           [Event(type=TOKENS, request_id=rid, token_ids=[token])], terminal)

    merged = merge([pub("a", 1, 0, 1), pub("b", 1, 0, 9), pub("a", 1, 1, 2, terminal=True),
                    pub("a", 1, 2, 3), pub("a", 2, 0, 7)])
    assert [(p.request_id, p.epoch, p.base_seq, [e.token_ids[0] for e in p.events], p.terminal)
            for p in merged] == [("a", 1, 0, [1, 2], True), ("b", 1, 0, [9], False),
                                 ("a", 2, 0, [7], False)]


def test_publication_advances_the_jobs_seq():
    req = build_request([1, 2])
    job = LiveJob(req, "s", "1-0", job_fields(req), epoch=3, seq=4, generated=[0],
                  finished=[None])
    events = [Event(type=TOKENS, request_id=req.id), Event(type=TOKENS, request_id=req.id)]
    pub = publication(job, events, terminal=False)
    assert (pub.epoch, pub.base_seq, job.seq) == (3, 4, 6)
