"""SIGTERM's bounds on a real worker process: it exits 0 within ``--drain-timeout`` plus the
fixed exit grace even when Redis is frozen mid-drain, and a SIGTERM while the model loads is a
clean exit 0, never a traceback."""

from __future__ import annotations

import signal
import subprocess

import pytest
import redis

from pagedq.client import Client, SamplingParams
from pagedq.client.protocol import Keys
from pagedq.worker.service.worker import EXIT_GRACE_S
from tests.chaos.servers import RedisServer
from tests.service.test_worker_procs import events, spawn, stop, wait_until

DRAIN_S = 1.0
BOUND_S = DRAIN_S + EXIT_GRACE_S + 30


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.process.send_signal(signal.SIGCONT)
    s.stop()


def test_sigterm_exits_in_time_even_with_redis_frozen(server, tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    proc = spawn(server.url, model, "A", "frozen", tmp_path, "--drain-timeout", str(DRAIN_S))
    r = redis.Redis.from_url(server.url)
    try:
        wait_until(lambda: r.exists(Keys("frozen").worker("A")), proc=proc)
        with Client(server.url, "frozen") as client:
            handle = client.submit([3, 4], SamplingParams(temperature=0, max_tokens=480,
                                                          ignore_eos=True))
            wait_until(lambda: events(r, handle.id, "frozen"), proc=proc)
        server.process.send_signal(signal.SIGSTOP)  # every Redis call now hangs
        proc.send_signal(signal.SIGTERM)
        try:  # the bound the docs promise, with room for a loaded machine's scheduling
            code = proc.wait(BOUND_S)
        except subprocess.TimeoutExpired:
            code = None  # the bound fired: still running (stop() below kills it)
    finally:
        stop(proc)
        r.close()
    log = (tmp_path / "frozen-A.log").read_text()[-3000:]
    assert code is not None, (f"still running {BOUND_S:g} s after SIGTERM with Redis frozen "
                              f"(promised: --drain-timeout {DRAIN_S:g} s + {EXIT_GRACE_S:g} s "
                              f"grace, plus 30 s of scheduling room)", log)
    assert code == 0, (code, log)


def test_sigterm_while_the_model_loads_exits_zero(server, tmp_path, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    proc = spawn(server.url, model, "L", "loading", tmp_path)
    log = tmp_path / "loading-L.log"
    try:
        wait_until(lambda: "loading the model" in log.read_text(), proc=proc)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        stop(proc)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text
