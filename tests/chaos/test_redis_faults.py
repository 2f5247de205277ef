"""Redis failing under a live queue: every job submitted ends exactly once, with the engine's
tokens, whatever Redis does in between.

Each scenario runs a real redis-server, two workers and a backend submitting jobs and waiting
on their results (the SDK), injects one fault mid-run, and audits every job (harness.audit).
The counts each Redis setting is expected to give are the ones docs/operations.md states.
"""

from __future__ import annotations

import time

import pytest
import redis

from pagedq.client.protocol import Keys
from tests.chaos.harness import Submitter, audit, expected_tokens, report, workload
from tests.chaos.servers import RedisServer
from tests.service.harness import running_worker

AOF_EVERYSEC = ["--appendonly", "yes", "--appendfsync", "everysec"]


def shutdown_restart(server: RedisServer) -> None:
    server.shutdown()
    time.sleep(1.0)
    server.start()


def sigkill_restart(server: RedisServer) -> None:
    server.kill()
    time.sleep(1.0)
    server.start()


def client_pause(server: RedisServer) -> None:
    with server.client() as r:
        r.client_pause(4000)
    time.sleep(4.5)


def out_of_memory(server: RedisServer) -> None:
    with server.client() as r:
        used = r.info("memory")["used_memory"]
        r.config_set("maxmemory", used + 64 * 1024)
        time.sleep(5.0)  # writes are refused meanwhile (noeviction)
        r.config_set("maxmemory", 0)


# Without persistence a restart forgets every stream: only what the clients got can be judged.
CLIENT_VIEW = {"sigkill_restart_no_persistence"}
SCENARIOS = {
    # name: (redis-server options, the fault)
    "shutdown_restart_aof": (AOF_EVERYSEC, shutdown_restart),
    "sigkill_restart_aof_everysec": (AOF_EVERYSEC, sigkill_restart),
    "sigkill_restart_no_persistence": (["--appendonly", "no"], sigkill_restart),
    "client_pause": ([], client_pause),
    "maxmemory_noeviction": (["--maxmemory-policy", "noeviction"], out_of_memory),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_redis_fault_loses_and_duplicates_nothing(name, tmp_path, tiny_model_dir, profile):
    options, fault = SCENARIOS[name]
    model = str(tiny_model_dir("llama"))
    count = 240 if profile == "long" else 30
    jobs = workload(count, seed=hash(name) % 1000)
    expected = expected_tokens(model, jobs)
    server = RedisServer(tmp_path / "redis", options).start()
    keys = Keys(name.replace("_", "-")[:60])
    try:
        with running_worker(server.url, model, "w1", queue=keys.queue, reclaim_after=3.0,
                            engine=dict(num_kv_blocks=256, max_num_seqs=8)), \
                running_worker(server.url, model, "w2", queue=keys.queue, reclaim_after=3.0,
                               engine=dict(num_kv_blocks=256, max_num_seqs=8)):
            sub = Submitter(server.url, keys.queue, jobs, rate=20.0, timeout=300).start()
            _wait_for(lambda: sum(j.result is not None for j in jobs) >= count // 4)
            began = time.monotonic()
            fault(server)
            fault_s = time.monotonic() - began
            assert sub.join(600), "results still outstanding after 10 min"
        with redis.Redis.from_url(server.url) as r:
            result = audit(r, keys, jobs, expected, streams=name not in CLIENT_VIEW,
                           model=model)
            leftovers = r.xlen(keys.jobs("normal")) + r.xlen(keys.jobs("high"))
    finally:
        server.stop()
    report(name, jobs=count, fault_s=round(fault_s, 1), exact=result.done, lost=result.lost,
           duplicated=result.duplicated, mismatched=result.mismatched, flipped=result.flipped,
           failed=result.failed,
           submits_refused=len(sub.refused))
    assert result.clean, (str(result), result.problems[:5])
    assert leftovers == 0


def _wait_for(cond, timeout=300.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)
