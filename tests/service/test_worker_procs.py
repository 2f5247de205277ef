"""Workers as real processes (``python -m pagedq.worker``): SIGKILL mid-generation and SIGTERM.

Oracles: the in-process Engine for every token, and the raw output streams for seamlessness
(seq 1..N without a gap, positions contiguous, exactly one terminal event).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from pagedq.client import Client, SamplingParams
from pagedq.client.protocol import GROUP, Keys, decode_event
from tests.service.harness import running_worker

ENGINE_ARGS = ["--num-kv-blocks", "160", "--max-num-seqs", "2", "--max-model-len", "512"]
# The SIGTERM test's jobs must outlast the drain (the readers' wait plus --drain-timeout) on a
# loaded machine too: a job that finished before the hand-back left one entry fewer.
TERM_ARGS = ["--drain-timeout", "0.1", "--read-block-ms", "100", "--num-kv-blocks", "400",
             "--max-model-len", "2048"]
TERM_TOKENS = 2000


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(model):
    from pagedq.worker import Engine

    engine = Engine(model, num_kv_blocks=400, max_num_seqs=2, max_model_len=2048)
    return lambda prompt, params: [o.token_ids for o in engine.generate([prompt], params)[0].outputs]


def spawn(redis_url, model, name, queue, log_dir, *extra):
    log = open(log_dir / f"{queue}-{name}.log", "wb")
    cmd = [sys.executable, "-m", "pagedq.worker", "--model", model, "--redis-url", redis_url,
           "--queue", queue, "--consumer-name", name, "--reclaim-after", "1",
           "--checkpoint-interval", "0.2", "--log-format", "json", *ENGINE_ARGS, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def procs(redis_url, model, tmp_path_factory):
    """One worker process per test, started together (start-up is mostly importing torch)."""
    log_dir = tmp_path_factory.mktemp("worker-logs")
    r = redis.Redis.from_url(redis_url)
    for key in r.scan_iter("pagedq:*"):
        r.delete(key)
    started = {"kill": spawn(redis_url, model, "A", "kill", log_dir),
               "term": spawn(redis_url, model, "A", "term", log_dir, *TERM_ARGS)}
    yield started
    for proc in started.values():
        stop(proc)
    r.close()


def wait_until(cond, timeout=90.0, proc=None):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        if proc is not None:
            assert proc.poll() is None, f"worker exited early with {proc.returncode}"
        time.sleep(0.02)


def wait_serving(r, keys, name, proc):
    wait_until(lambda: r.exists(keys.worker(name)), proc=proc)


def events(r, rid, queue="kill"):
    return [decode_event(f, i) for i, f in r.xrange(Keys(queue).out(rid))]


def assert_seamless(evs, expected):
    """seq 1..N, one terminal event last, each sample's positions contiguous and its tokens
    equal to the engine's (``expected``: tokens per sample)."""
    assert [e.seq for e in evs] == list(range(1, len(evs) + 1))
    assert [e.type for e in evs].count("finished") == 1 and evs[-1].type == "finished"
    for index, want in enumerate(expected):
        mine = [e for e in evs[:-1] if e.index == index]
        pos = 0
        for e in mine:
            assert e.position - len(e.token_ids) == pos
            pos = e.position
        assert [t for e in mine for t in e.token_ids] == want


def mid_job(r, handles, worker: str, position: int = 5, queue: str = "kill"):
    """A condition: ``worker`` has streamed ``position`` tokens of a job it is still generating."""
    def check() -> bool:
        for h in handles:
            evs = events(r, h.id, queue)
            if evs and evs[-1].type == "tokens" and evs[-1].worker == worker \
                    and evs[-1].position >= position:
                return True
        return False

    return check


def stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def test_sigkill_mid_generation_another_worker_continues_seamlessly(redis_url, procs, model,
                                                                    reference):
    r = redis.Redis.from_url(redis_url)
    keys, a = Keys("kill"), procs["kill"]
    try:
        wait_serving(r, keys, "A", a)
        jobs = [([3 + i, 9, 4], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
                if i % 2 == 0 else
                ([5, i, 8], SamplingParams(temperature=0.9, seed=1000 + i, max_tokens=200,
                                           ignore_eos=True))
                for i in range(6)]
        with Client(redis_url, "kill") as client:
            handles = [client.submit(p, sp) for p, sp in jobs]
            wait_until(lambda: any(events(r, h.id) for h in handles), proc=a)

            a_mid_job = mid_job(r, handles, "A")
            with running_worker(redis_url, model, "B", queue="kill",
                                engine=dict(num_kv_blocks=160, max_num_seqs=2,
                                            max_model_len=512)):
                wait_until(a_mid_job, proc=a)
                a.send_signal(signal.SIGKILL)
                a.wait(30)
                results = [h.result(timeout=120) for h in handles]
                for (prompt, params), h, res in zip(jobs, handles, results, strict=True):
                    expected = reference(prompt, params)
                    assert [o.token_ids for o in res.outputs] == expected
                    assert_seamless(events(r, h.id), expected)
                writers = [{e.worker for e in events(r, h.id)} for h in handles]
                assert {"A", "B"} in writers  # a job A was generating was finished by B
                assert r.xpending(keys.jobs("normal"), GROUP)["pending"] == 0
                wait_until(lambda: not r.exists(keys.worker("A")), timeout=20)  # A vanishes
                assert r.exists(keys.worker("B"))
    finally:
        r.close()


def test_sigterm_drains_hands_back_and_exits_zero(redis_url, procs, model, reference):
    r = redis.Redis.from_url(redis_url)
    keys, a = Keys("term"), procs["term"]
    # far longer than the 0.1 s drain timeout even for a fast tiny model: they get handed back
    long = SamplingParams(temperature=0, max_tokens=TERM_TOKENS, ignore_eos=True)
    try:
        wait_serving(r, keys, "A", a)
        with Client(redis_url, "term") as client:
            prompts = [[2, 4 + i, 6] for i in range(4)]
            params = [long, SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=TERM_TOKENS,
                                           ignore_eos=True), long, long]
            handles = [client.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]

            def both_running():
                return sum(bool(events(r, h.id, "term")) for h in handles) >= 2

            wait_until(both_running, proc=a)
            a.send_signal(signal.SIGTERM)
            assert a.wait(60) == 0
            assert not r.exists(keys.worker("A"))  # a clean stop removes its checkpoint now
            assert r.xpending(keys.jobs("normal"), GROUP)["pending"] == 0  # nothing held
            assert r.xlen(keys.jobs("normal")) == 4  # 2 handed back + 2 never read
            started = [h for h in handles if events(r, h.id, "term")]
            assert len(started) == 2
            assert all(not events(r, h.id, "term")[-1].terminal for h in started)
            with running_worker(redis_url, model, "B", queue="term",
                                engine=dict(num_kv_blocks=400, max_num_seqs=2,
                                            max_model_len=2048)):
                results = [h.result(timeout=120) for h in handles]
        for prompt, sp, h, res in zip(prompts, params, handles, results, strict=True):
            expected = reference(prompt, sp)
            assert [o.token_ids for o in res.outputs] == expected
            assert_seamless(events(r, h.id, "term"), expected)
        for h in started:
            assert {e.worker for e in events(r, h.id, "term")} == {"A", "B"}
            assert int(r.hget(keys.state(h.id), "deliveries")) == 1  # hand-back: no failure
    finally:
        r.close()
