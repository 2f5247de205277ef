"""Which Redis a command uses: the URL given, else $REDIS_URL, else the caller's fallback."""

from __future__ import annotations

from pagedq.client.redis_url import DEFAULT_REDIS_URL, resolve_redis_url


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
