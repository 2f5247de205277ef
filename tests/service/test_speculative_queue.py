"""Speculative decoding through the queue: a worker SIGKILLed while speculating loses no token
and repeats none; the worker that takes its jobs over (also speculating) finishes them exactly
as the in-process engine without speculation would. Oracle: that engine, and the raw output
streams (seq 1..N, contiguous positions, one terminal event)."""

from __future__ import annotations

import json
import signal

import pytest
import redis

from pagedq.client import Client, SamplingParams
from pagedq.client.protocol import GROUP, Keys
from tests.service.harness import running_worker
from tests.service.test_worker_procs import (
    assert_seamless,
    events,
    mid_job,
    spawn,
    stop,
    wait_until,
)

# adaptive off: drafts in every step, whatever the governor would measure on this machine
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
QUEUE = "spec-kill"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def test_sigkill_while_speculating_loses_and_repeats_nothing(redis_url, model, tmp_path):
    from pagedq.worker import Engine

    reference = Engine(model, num_kv_blocks=160, max_num_seqs=2, max_model_len=512)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(QUEUE)
    a = spawn(redis_url, model, "A", QUEUE, tmp_path, "--speculative-config", json.dumps(SPEC))
    try:
        # a first start on a machine may compile the C++ kernels: give it time
        wait_until(lambda: r.exists(keys.worker("A")), timeout=600, proc=a)
        # greedy and seeded jobs that repeat themselves now and then, so some drafts are
        # accepted (not all: a job must still be running when A is killed)
        jobs = [([3 + i, 9, 4, 3 + i, 9], SamplingParams(
                    temperature=0 if i % 2 == 0 else 0.9, seed=1000 + i, max_tokens=400,
                    ignore_eos=True, repetition_penalty=0.6))
                for i in range(6)]
        with Client(redis_url, QUEUE) as client:
            handles = [client.submit(p, sp) for p, sp in jobs]
            wait_until(mid_job(r, handles, "A", position=20, queue=QUEUE), proc=a)
            with running_worker(redis_url, model, "B", queue=QUEUE,
                                engine=dict(num_kv_blocks=160, max_num_seqs=2, max_model_len=512,
                                            speculative_config=SPEC)) as b:
                a.send_signal(signal.SIGKILL)
                a.wait(30)
                results = [h.result(timeout=120) for h in handles]
                for (prompt, params), h, res in zip(jobs, handles, results, strict=True):
                    expected = [o.token_ids for o in reference.generate([prompt], params)[0].outputs]
                    assert [o.token_ids for o in res.outputs] == expected
                    assert_seamless(events(r, h.id, QUEUE), expected)
                writers = [{e.worker for e in events(r, h.id, QUEUE)} for h in handles]
                assert {"A", "B"} in writers  # a job A was generating was finished by B
                assert r.xpending(keys.jobs("normal"), GROUP)["pending"] == 0
                assert b.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        stop(a)
        r.close()
