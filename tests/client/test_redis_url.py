"""Which Redis a command uses: the URL given, else $REDIS_URL, else the caller's fallback."""

from __future__ import annotations

from pagedq.redis_url import (
    ADVERTISED_FILE,
    DEFAULT_REDIS_URL,
    client_redis_url,
    resolve_redis_url,
)


def test_an_explicit_url_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://env:1/0")
    assert resolve_redis_url("redis://flag:2/0") == "redis://flag:2/0"
    assert resolve_redis_url("redis://flag:2/0", default=None) == "redis://flag:2/0"


def test_the_environment_wins_over_the_fallback(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://env:1/0")
    assert resolve_redis_url(None) == "redis://env:1/0"
    assert resolve_redis_url(None, default=None) == "redis://env:1/0"


def test_the_fallback_is_the_callers(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert resolve_redis_url(None) == DEFAULT_REDIS_URL == "redis://localhost:6379/0"  # SDK
    assert resolve_redis_url(None, default=None) is None  # pagedq worker: embedded server
    monkeypatch.setenv("REDIS_URL", "")  # set but empty counts as unset
    assert resolve_redis_url("", default=None) is None


def test_a_client_finds_the_embedded_redis_a_local_worker_advertises(monkeypatch, tmp_path):
    """`pagedq worker` (no URL) in one terminal, ``Client()`` in another: the SDK reads the same
    advertisement `pagedq submit` and `stats` read, and ignores a stale one."""
    from pagedq.client import AsyncClient, Client
    from pagedq.embedded_redis import EmbeddedRedis, advertise

    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
    assert client_redis_url(None) == DEFAULT_REDIS_URL  # nothing advertised
    with EmbeddedRedis.start() as server:
        advertise(server)
        assert (tmp_path / ADVERTISED_FILE).is_file()
        with Client() as client:
            assert client.url == server.url and client.redis.ping()
        assert AsyncClient().url == server.url
        assert client_redis_url("redis://flag:2/0") == "redis://flag:2/0"  # a URL still wins
        monkeypatch.setenv("REDIS_URL", "redis://env:1/0")
        assert client_redis_url(None) == "redis://env:1/0"  # and so does $REDIS_URL
        monkeypatch.delenv("REDIS_URL")
    assert client_redis_url(None) == DEFAULT_REDIS_URL  # stale: the server is gone
