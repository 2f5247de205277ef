"""``pagedq serve`` with no Redis URL: it joins the embedded Redis a local `pagedq worker`
advertises instead of starting a second, idle stack."""

from __future__ import annotations

from pagedq.embedded_redis import EmbeddedRedis, advertise, find_advertised, withdraw
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
            with queue_stack(None, "default", "pagedq") as url:
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
    from pagedq.worker.config_flags import to_flags

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
    with queue_stack(None, "default", "pagedq", to_flags(engine)) as url:
        assert url.startswith("unix://:") and find_advertised() == url
        (worker,) = [p for p in psutil.Process().children() if "pagedq.worker" in p.cmdline()]
        line = " ".join(worker.cmdline())
        assert all(f in line for f in ("--num-threads 1", "--cpu-isa avx2", "--quantization none",
                                       "--no-adaptive-threads", f"--model {model}"))
    settings.cache_clear()


def test_the_embedded_redis_wants_its_password_and_only_its_user_reads_the_file(tmp_path):
    import os

    import pytest
    import redis

    with EmbeddedRedis.start() as server:
        assert server.password and f":{server.password}@127.0.0.1:" in server.url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=server.port).ping()
        assert redis.Redis.from_url(server.url).config_get("bind")["bind"] == "127.0.0.1"
        path = advertise(server, tmp_path / "embedded-redis.json")
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert find_advertised(path) == server.url


def test_the_embedded_redis_on_a_unix_socket_only_its_user_enters(tmp_path):
    """`serve`'s and `worker`'s embedded Redis: no TCP port, a socket in a 0700 directory, the
    password still asked; the advertisement finds it and redis-py connects through it."""
    import os
    import stat

    import pytest
    import redis

    with EmbeddedRedis.start(unix_socket=True) as server:
        sock = server.socket
        assert sock is not None and server.port == 0
        assert server.url == f"unix://:{server.password}@{sock}?db=0"
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        assert os.stat(sock.parent).st_mode & 0o777 == 0o700
        r = redis.Redis.from_url(server.url)
        assert r.ping() and r.config_get("port")["port"] == "0"  # no TCP listener at all
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(unix_socket_path=str(sock)).ping()
        path = advertise(server, tmp_path / "embedded-redis.json")
        assert find_advertised(path) == server.url
        r.close()
    assert not sock.exists() and find_advertised(path) is None


def test_a_flood_meets_maxmemory_and_never_evicts_a_queue_key():
    """maxmemory with noeviction: writes past it get Redis's OOM error, and the keys already
    there (a queue's stream, a lease) all stay."""
    import pytest
    import redis

    from pagedq.embedded_redis import MIN_MAXMEMORY, default_maxmemory

    assert default_maxmemory() >= MIN_MAXMEMORY
    with EmbeddedRedis.start(unix_socket=True, maxmemory=8 << 20) as server:
        r = redis.Redis.from_url(server.url)
        config = r.config_get("maxmemory*")
        assert (config["maxmemory"], config["maxmemory-policy"]) == (str(8 << 20), "noeviction")
        r.xadd("pagedq:q:default:normal", {"job": "1"})
        r.set("pagedq:lease:w1", "held")
        blob = b"x" * (1 << 20)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(64):
                r.set(f"pagedq:gw:file:flood-{i}:data", blob)
        assert r.xlen("pagedq:q:default:normal") == 1 and r.get("pagedq:lease:w1") == b"held"
        assert r.info("stats")["evicted_keys"] == 0
        r.close()


def test_a_second_embedded_redis_never_displaces_a_live_advertisement(tmp_path):
    """`pagedq demo` (or `serve`) beside a running `pagedq worker`: the worker's advertisement
    stays, and the newcomer's stop withdraws nothing; alone, the newcomer is advertised."""
    from pagedq.embedded_redis import advertised

    path = tmp_path / "embedded-redis.json"
    with EmbeddedRedis.start(unix_socket=True) as first, \
            EmbeddedRedis.start(unix_socket=True) as second:
        with advertised(first, path) as written:
            assert written == path and find_advertised(path) == first.url
            with advertised(second, path) as displaced:
                assert displaced is None and find_advertised(path) == first.url
            assert find_advertised(path) == first.url
        assert not path.exists()
        with advertised(second, path):
            assert find_advertised(path) == second.url
