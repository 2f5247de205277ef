"""``pagedq demo`` end to end on a tiny model: an embedded Redis, a worker in the process, the
prompts submitted together, every answer printed, and a final stats row written after the
last answer (nothing running, no KV block held)."""

from __future__ import annotations

from pagedq.worker.cli import main


def test_demo_streams_every_prompt_and_ends_on_fresh_stats(tiny_text_model_dir, capsys):
    prompts = ["Hello world", "The capital of France is", "Queues and workers"]
    code = main(["demo", *prompts, "--model", str(tiny_text_model_dir), "--max-tokens", "12",
                 "--ignore-eos", "--num-kv-blocks", "512", "--block-size", "4"])
    out = capsys.readouterr().out
    assert code == 0
    for i, prompt in enumerate(prompts, 1):
        assert f"[{i}] >>> {prompt}" in out
    assert out.count("it reached the token limit (--max-tokens) (12 tokens generated") == 3
    row = next(line for line in out.splitlines() if line.startswith("demo "))
    name, state, jobs, running, waiting, kv, *_ = row.split()
    assert (state, jobs, running, waiting, kv) == ("serving", "0", "0", "0", "0/512")


def test_demo_rejects_a_bad_prompt_before_starting_anything(capsys):
    assert main(["demo", ""]) == 2
    assert "empty" in capsys.readouterr().err


def test_demo_runs_its_redis_on_a_private_socket_that_other_commands_find(
        tiny_text_model_dir, tmp_path, monkeypatch, capsys):
    """The demo's Redis is `serve`'s and `worker`'s: a unix socket in a 0700 directory (no TCP
    port), a password, maxmemory with noeviction. While the demo runs, ``Client()`` with no URL
    finds it through the advertisement and sees the demo's worker; after, the file is gone."""
    import os
    import threading
    from pathlib import Path
    from urllib.parse import urlsplit

    import pytest
    import redis

    from pagedq.client import Client
    from pagedq.redis_url import find_advertised
    from pagedq.worker.config import settings

    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings.cache_clear()
    seen: dict = {}
    done = threading.Event()

    def watch() -> None:  # another terminal: `pagedq stats` while the demo runs
        while not done.is_set() and "workers" not in seen:
            url = find_advertised()
            if url is None:
                continue
            with Client() as client:
                names = [w.get("name") for w in client.stats()["workers"]]
            r = redis.Redis.from_url(url)
            seen.update(url=url, client_url=client.url, config=r.config_get("*"),
                        mode=os.stat(Path(urlsplit(url).path).parent).st_mode & 0o777)
            r.close()
            if "demo" in names:
                seen["workers"] = names

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code = main(["demo", "Hello world", "--model", str(tiny_text_model_dir), "--max-tokens",
                     "48", "--ignore-eos", "--num-kv-blocks", "512", "--block-size", "4"])
    finally:
        done.set()
        watcher.join(30)
        settings.cache_clear()
    out = capsys.readouterr().out
    assert code == 0 and seen.get("workers") == ["demo"]
    url = seen["url"]
    assert url.startswith("unix://:") and seen["client_url"] == url
    password, sock = urlsplit(url).password, Path(urlsplit(url).path)
    assert password and password not in out and "embedded redis-server on unix://:***@" in out
    config = seen["config"]
    assert config["port"] == "0" and int(config["maxmemory"]) > 0  # no TCP listener at all
    assert config["maxmemory-policy"] == "noeviction" and config["unixsocketperm"] == "700"
    assert seen["mode"] == 0o700  # the socket's directory: only this user enters
    assert not sock.exists() and find_advertised() is None  # stopped, and withdrawn
    assert not os.path.exists(tmp_path / "embedded-redis.json")
    with pytest.raises(redis.ConnectionError):
        redis.Redis(unix_socket_path=str(sock)).ping()
