"""``pagedq serve`` with no Redis URL: it joins the embedded Redis a local `pagedq worker`
advertises instead of starting a second, idle stack."""

from __future__ import annotations

from pagedq.embedded_redis import EmbeddedRedis, advertise, withdraw
from pagedq.gateway.local import queue_stack
from pagedq.worker.config import settings


def test_serve_joins_an_advertised_embedded_redis(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings.cache_clear()
    with EmbeddedRedis.start() as server:
        path = advertise(server)
        assert path.parent == tmp_path
        try:
            with queue_stack(None, "default", "pagedq", None) as url:
                assert url == server.url
        finally:
            withdraw(path)
    settings.cache_clear()


def test_serve_and_batch_hand_every_engine_flag_to_their_worker(tmp_path, monkeypatch,
                                                                 tiny_model_dir):
    """`serve` and `batch` take the worker's engine flags (--num-threads, --quantization,
    --cpu-isa, ...) and start their embedded worker with them."""
    import psutil

    from pagedq.gateway.commands import engine_config
    from pagedq.worker.cli import build_parser

    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings.cache_clear()
    model = tiny_model_dir()
    flags = ["--model", str(model), "--num-threads", "1", "--cpu-isa", "avx2",
             "--quantization", "none", "--no-adaptive-threads"]
    for command in (["serve"], ["batch", "in.jsonl", "-o", "out.jsonl"]):
        engine = engine_config(build_parser().parse_args([*command, *flags]))
        assert (engine.model, engine.num_threads, engine.cpu_isa, engine.quantization,
                engine.adaptive_threads) == (str(model), 1, "avx2", "none", False)
    with queue_stack(None, "default", "pagedq", engine):
        (worker,) = [p for p in psutil.Process().children() if "pagedq.worker" in p.cmdline()]
        line = " ".join(worker.cmdline())
        assert all(f in line for f in ("--num-threads 1", "--cpu-isa avx2", "--quantization none",
                                       "--no-adaptive-threads", f"--model {model}"))
    settings.cache_clear()


def test_the_embedded_redis_wants_its_password_and_only_its_user_reads_the_file(tmp_path):
    import os

    import pytest
    import redis

    from pagedq.embedded_redis import find_advertised

    with EmbeddedRedis.start() as server:
        assert server.password and f":{server.password}@127.0.0.1:" in server.url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port).ping()
        assert redis.Redis.from_url(server.url).config_get("bind")["bind"] == "127.0.0.1"
        path = advertise(server, tmp_path / "embedded-redis.json")
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert find_advertised(path) == server.url
