"""``pagedq submit`` and ``pagedq stats`` against a real Redis: what submit puts on the wire,
what it prints while a real worker answers, and a stats table that prints once and exits."""

from __future__ import annotations

import pytest

from pagedq.client.protocol import Keys, decode_request
from pagedq.worker.cli import main
from tests.service.harness import running_worker


def queued_requests(redis_client, level="normal"):
    return [decode_request(fields[b"p"])
            for _, fields in redis_client.xrange(Keys().jobs(level))]


@pytest.mark.parametrize("flags,shape", [
    ([], "messages"), (["--raw"], "prompt"), (["--token-ids"], "prompt_token_ids"),
])
def test_submit_sends_chat_by_default(redis_db, redis_client, capsys, flags, shape):
    prompt = "1, 2,3" if "--token-ids" in flags else "Tell me a joke"
    code = main(["submit", prompt, *flags, "--redis-url", redis_db, "--timeout", "0.2"])
    assert code == 3  # no worker: it gives up waiting, the job stays queued
    assert "the job stays queued" in capsys.readouterr().err
    (req,) = queued_requests(redis_client)
    expected = {"messages": [{"role": "user", "content": "Tell me a joke"}],
                "prompt": "Tell me a joke", "prompt_token_ids": [1, 2, 3]}[shape]
    assert getattr(req, shape) == expected


def test_submit_rejects_bad_input_before_enqueueing(redis_db, redis_client, capsys):
    for argv in (["submit", ""], ["submit", "x", "--temperature", "-2"],
                 ["submit", "1,a", "--token-ids"]):
        assert main([*argv, "--redis-url", redis_db]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err
    assert queued_requests(redis_client) == []


def test_submit_streams_the_answer_and_ends_with_a_sentence(redis_db, tiny_text_model_dir,
                                                            capsys):
    from pagedq.worker import Engine

    expected = Engine(str(tiny_text_model_dir), num_kv_blocks=16).chat(
        [{"role": "user", "content": "Hello"}], _greedy(6))[0].outputs[0].text
    with running_worker(redis_db, str(tiny_text_model_dir), "cli"):
        code = main(["submit", "Hello", "--redis-url", redis_db, "--max-tokens", "6",
                     "--ignore-eos", "--timeout", "60"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out.strip() == expected.strip()
    assert "-- done: it reached the token limit (--max-tokens) (6 tokens generated" in err
    assert "[" not in err.split("-- done:")[1].split("(--max-tokens)")[1]  # no Python reprs


def _greedy(max_tokens):
    from pagedq.params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_stats_prints_one_table_and_exits(redis_db, tiny_text_model_dir, capsys):
    with running_worker(redis_db, str(tiny_text_model_dir), "cli"):
        assert main(["stats", "--redis-url", redis_db]) == 0
    out = capsys.readouterr().out
    assert out.startswith("queue default: depth 0")
    assert "\x1b[2J" not in out  # no screen clearing without --watch
    row = next(line for line in out.splitlines() if line.startswith("cli "))
    assert "serving" in row and "0/64" in row


def test_stats_watch_is_opt_in():
    from pagedq.worker.cli import build_parser

    assert build_parser().parse_args(["stats"]).watch is None
    assert build_parser().parse_args(["stats", "--watch"]).watch == 2.0
    assert build_parser().parse_args(["stats", "--watch", "0.5"]).watch == 0.5


def test_submit_without_a_worker_warns_at_once_and_waits_only_if_asked(redis_db, capsys):
    assert main(["submit", "hi", "--redis-url", redis_db]) == 3
    err = capsys.readouterr().err
    assert "no worker has checkpointed on queue 'default'" in err and "--wait" in err
    assert main(["submit", "hi", "--redis-url", redis_db, "--wait", "--timeout", "0.3"]) == 3
    err = capsys.readouterr().err
    assert "Waiting for one" in err and "no answer within 0.3 s; the job stays queued" in err


@pytest.mark.parametrize("command", [["submit", "hi"], ["stats"]])
def test_unreachable_redis_is_one_line(command, capsys):
    from pagedq.embedded_redis import free_port

    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    assert main([*command, "--redis-url", url]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert url.replace("hunter2", "***") in err and "hunter2" not in err
    assert "pagedq worker" in err and "--redis-url" in err


def test_a_password_protected_redis_says_so(capsys):
    import redis

    from pagedq.embedded_redis import EmbeddedRedis

    with EmbeddedRedis.start(password="") as server:
        redis.Redis.from_url(server.url).config_set("requirepass", "s3cret")
        assert main(["stats", "--redis-url", server.url]) == 1
        err = capsys.readouterr().err
        assert "refused the credentials" in err and "redis://:PASSWORD@" in err
        ok = server.url.replace("redis://", "redis://:s3cret@")
        assert main(["stats", "--redis-url", ok]) == 0


def test_worker_in_one_terminal_submit_in_another(tiny_text_model_dir, tmp_path, monkeypatch,
                                                  capsys):
    """`pagedq worker` with no URL and `pagedq submit` with none find each other."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from pagedq.worker.config import settings

    # PAGEDQ_CPU_KERNEL=0: what is tested is discovery, not a first compile of the C++ kernels
    env = {**os.environ, "PAGEDQ_CACHE": str(tmp_path), "PAGEDQ_CPU_KERNEL": "0"}
    env.pop("REDIS_URL", None)
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagedq.worker.cli", "worker", "--model", str(tiny_text_model_dir),
         "--num-kv-blocks", "64", "--checkpoint-interval", "0.2", "--log-format", "console"],
        env=env, stderr=subprocess.PIPE, text=True)
    try:
        monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
        monkeypatch.delenv("REDIS_URL", raising=False)
        settings.cache_clear()
        advertised = tmp_path / "embedded-redis.json"
        end = time.monotonic() + 120
        while not advertised.exists():
            assert worker.poll() is None and time.monotonic() < end, "the worker did not start"
            time.sleep(0.1)
        assert main(["submit", "Hello", "--max-tokens", "4", "--ignore-eos", "--wait",
                     "--timeout", "120"]) == 0
        assert "done: it reached the token limit" in capsys.readouterr().err
        assert main(["stats"]) == 0
        assert "serving" in capsys.readouterr().out
    finally:
        worker.send_signal(signal.SIGTERM)
        _, log = worker.communicate(timeout=60)
        settings.cache_clear()
    assert worker.returncode == 0, log
    assert "started an embedded redis-server" in log
    assert not (tmp_path / "embedded-redis.json").exists()  # withdrawn on exit


def _worker_loading_until(redis_db, model, release, monkeypatch, fail=False):
    """A worker in a thread whose model load waits for ``release`` (then builds the real
    engine, or fails): the window between `pagedq worker` and its first checkpoint, held open."""
    import asyncio
    import threading

    from pagedq.worker.config import WorkerConfig
    from pagedq.worker.service import worker as service

    real = service.build_engine

    def held_build(config):
        assert release.wait(120), "the test never released the load"
        if fail:
            raise FileNotFoundError("no such model")
        return real(config)

    monkeypatch.setattr(service, "build_engine", held_build)
    cfg = WorkerConfig(model=model, redis_url=redis_db, consumer_name="late",
                       checkpoint_interval=0.2, read_block_ms=200, drain_timeout=5,
                       engine=dict(num_kv_blocks=64, max_num_seqs=4, max_model_len=256))
    worker = service.Worker(cfg)
    codes = []
    thread = threading.Thread(target=lambda: codes.append(asyncio.run(worker.run())),
                              daemon=True)
    thread.start()
    return worker, thread, codes


def test_submit_right_after_worker_waits_for_the_starting_one(redis_db, tiny_text_model_dir,
                                                              capsys, monkeypatch):
    """A worker announces itself while its model loads: submit says "a worker is starting"
    and waits (no --wait needed), and the job it left queued is the worker's first."""
    import re
    import threading

    from pagedq.client import Client
    from tests.service.harness import wait_until

    release = threading.Event()
    worker, thread, codes = _worker_loading_until(redis_db, str(tiny_text_model_dir), release,
                                                  monkeypatch)
    try:
        with Client(redis_db) as client:
            wait_until(lambda: client.stats()["starting"] == 1, timeout=60)
            assert main(["stats", "--redis-url", redis_db]) == 0
            assert "1 worker(s) starting" in capsys.readouterr().out
            assert main(["submit", "Hello", "--redis-url", redis_db, "--max-tokens", "4",
                         "--ignore-eos", "--timeout", "0.5"]) == 3
            err = capsys.readouterr().err
            assert "a worker is starting on queue 'default' (loading its model)" in err, err
            assert "no worker has checkpointed" not in err and "no answer within 0.5 s" in err
            job_id = re.search(r"id ([^)\s,]+)\)", err).group(1)
            release.set()
            result = client.handle(job_id).result(timeout=120)
            assert result.usage["completion_tokens"] == 4
            # the claim is withdrawn by its own Redis call beside the first checkpoint: the
            # state must settle, not be there at the instant the answer arrives
            wait_until(lambda: client.stats()["starting"] == 0, timeout=30)
            stats = client.stats()
            assert stats["starting"] == 0 and [w["name"] for w in stats["workers"]] == ["late"]
    finally:
        release.set()
        worker.stop()
        thread.join(90)
    assert codes == [0]


def test_a_failed_load_withdraws_the_announcement(redis_db, monkeypatch):
    import threading

    from pagedq.client import Client
    from tests.service.harness import wait_until

    release = threading.Event()
    worker, thread, codes = _worker_loading_until(redis_db, "nonexistent", release, monkeypatch,
                                                  fail=True)
    with Client(redis_db) as client:
        wait_until(lambda: client.stats()["starting"] == 1, timeout=60)
        release.set()
        thread.join(60)
        assert codes == [2] and client.stats()["starting"] == 0
