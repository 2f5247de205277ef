"""A worker in a thread against the test Redis, and the helpers its tests share.

The oracle for every generated token is the in-process Engine (itself checked against
transformers in the engine tests); the oracle for a stream is its raw Redis entries.
"""

from __future__ import annotations

import asyncio
import faulthandler
import sys
import threading
import time
from contextlib import contextmanager

from pagedq.client.protocol import Keys, decode_event
from pagedq.worker.config import WorkerConfig
from pagedq.worker.service.worker import Worker

ENGINE = dict(num_kv_blocks=64, max_num_seqs=4, max_model_len=256)
# A worker that is not serving by then hangs (a lost cancel once held one before "ready" for
# good): fail with its stacks instead of waiting for pytest-timeout's 600 s.
READY_TIMEOUT_S = 420.0  # under pytest-timeout's 600 s; a cold model cache loads in far less


@contextmanager
def running_worker(redis_url, model, name, engine_instance=None, **overrides):
    engine = dict(ENGINE, **overrides.pop("engine", {}))
    knobs = dict(reclaim_after=1.0, checkpoint_interval=0.2, poll_interval=0.05,
                 read_block_ms=200, drain_timeout=5)
    cfg = WorkerConfig(model=model, redis_url=redis_url, consumer_name=name, engine=engine,
                       **{**knobs, **overrides})
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
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not worker.ready.wait(0.1):
        assert thread.is_alive(), errors
        if time.monotonic() > deadline:
            faulthandler.dump_traceback(sys.stderr)
            worker.stop()
            raise AssertionError(f"the worker was not serving after {READY_TIMEOUT_S:.0f} s "
                                 "(stacks dumped above)")
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(90)
        if thread.is_alive():  # show where it hangs rather than a bare "still alive"
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


class RecordingEngineLoop:
    """Stands in for the engine thread: records the commands it is sent."""

    def __init__(self):
        self.sent = []
        self.aborted = []

    def send(self, cmd):
        self.sent.append(cmd)

    def abort(self, engine_id):
        self.aborted.append(engine_id)
