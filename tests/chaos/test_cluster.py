"""Scale-out on a real Redis Cluster: 3 masters with a replica each, created by
``redis-cli --cluster create``; three workers and a backend through redis-py's cluster client.

The master holding the queue's slot (every key of a queue shares one, ``P:{Q}:...``) is killed
mid-load; its replica takes over. Every job still ends exactly once with the engine's tokens.
The spread of generated tokens across the three workers is reported (the goal is 10%).
"""

from __future__ import annotations

import time

import pytest
import redis
from redis.cluster import RedisCluster

from pagedq.client.protocol import Keys
from tests.chaos.harness import (
    Fleet,
    Submitter,
    audit,
    expected_tokens,
    report,
    spread,
    tokens_per_worker,
    wait_serving,
    workload,
)
from tests.chaos.servers import LocalCluster

NAMES = ["c1", "c2", "c3"]
PROFILES = {"short": 30, "long": 300}


@pytest.mark.timeout(1800)
def test_a_master_killed_mid_load_loses_nothing(tmp_path, tiny_model_dir, profile):
    count = PROFILES[profile]
    model = str(tiny_model_dir("llama"))
    jobs = workload(count, seed=23, max_tokens=(40, 160), shuffle_seed=29)
    expected = expected_tokens(model, jobs)
    cluster = LocalCluster(tmp_path / "cluster")
    keys = Keys("scale")
    fleet = Fleet(cluster.url, model, keys.queue, tmp_path, "--reclaim-after", "5",
                  "--checkpoint-interval", "0.5")
    try:
        cluster.start()  # stops its own nodes when it fails or skips
        r = RedisCluster.from_url(cluster.url)
        for name in NAMES:
            fleet.spawn(name)
        wait_serving(r, keys, NAMES)
        victim = cluster.master_of(keys.jobs("normal"))
        sub = Submitter(cluster.url, keys.queue, jobs, rate=max(5.0, count / 20),
                        timeout=900).start()
        _wait_for(lambda: sum(j.result is not None for j in jobs) >= count // 3)
        victim.kill()
        killed_at = time.monotonic()
        assert sub.join(1200), "results still outstanding"
        recovered_s = time.monotonic() - killed_at
        cluster.wait_ok()
        result = audit(r, keys, jobs, expected, model=model)
        per_worker = tokens_per_worker(r, keys, jobs, NAMES)
        r.close()
        crashed = fleet.crashed()
    finally:
        fleet.stop()
        cluster.stop()
    report(f"cluster[{profile}]", jobs=count, exact=result.done, lost=result.lost,
           duplicated=result.duplicated, mismatched=result.mismatched, flipped=result.flipped,
           failed=result.failed,
           all_done_s_after_kill=round(recovered_s, 1), tokens_per_worker=dict(per_worker),
           spread=f"{100 * spread(per_worker):.1f}%", submits_retried=len(sub.refused))
    assert not crashed, crashed
    # shuffled jobs mix batches as test_spread.py's do (near-ties at ~3% of jobs there too)
    assert result.explained, (str(result), result.problems[:5])


def _wait_for(cond, timeout=600.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.1)


# what the client library and the test's own set-up send besides pagedq's commands
HANDSHAKE = {"client|setinfo", "script|flush"}


def test_commands_stay_in_the_shared_subset(redis_db, tiny_model_dir):
    """Every command a worker and a client send (their scripts' included) is one ACL rule
    names, and all exist in Redis 6.2 through 8 and Valkey (client/acl.py)."""
    from pagedq.client import Client, SamplingParams
    from pagedq.client.acl import COMMANDS
    from tests.service.harness import running_worker

    seen: set[str] = set()
    monitor_client = redis.Redis.from_url(redis_db, socket_timeout=120)
    with monitor_client.monitor() as monitor:
        import threading

        stop = threading.Event()

        def listen():
            try:
                for command in monitor.listen():
                    parts = command["command"].split()
                    if parts:
                        name = parts[0].strip('"').lower()
                        sub = parts[1].strip('"').lower() if len(parts) > 1 else ""
                        pair = f"{name}|{sub}"  # Valkey logs redis-py's CLIENT SETINFO
                        seen.add(pair if pair in COMMANDS or pair in HANDSHAKE else name)
                    if stop.is_set():
                        return
            except redis.TimeoutError:  # idle after the stop
                return

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        model = str(tiny_model_dir("llama"))
        with running_worker(redis_db, model, "m1", reclaim_after=0.3), Client(redis_db) as c:
            h = c.submit([1, 2], SamplingParams(max_tokens=3))
            h.result(30)
            c.submit([3], SamplingParams(max_tokens=200, ignore_eos=True)).cancel()
            c.stats()
            time.sleep(1.0)
        stop.set()
        monitor_client.ping()  # wake the listener
        thread.join(5)
    allowed = set(COMMANDS) | HANDSHAKE | {"monitor", "auth", "select", "flushdb"}
    allowed |= {c.split("|")[0] for c in COMMANDS}
    assert seen - allowed == set(), seen - allowed
    assert {"evalsha", "xreadgroup", "xadd", "hset", "xack"} <= seen  # scripts' calls too
