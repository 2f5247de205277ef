"""The bench's private Redis (the queue and gateway scenarios, when no ``redis_url`` is set) is
started as `pagedq demo` starts its own: another local user must not reach the run's queue."""

from __future__ import annotations

import os
import stat
from urllib.parse import urlsplit

import pytest
import redis

from pagedq.bench.queue_path import redis_url


def test_the_private_redis_is_a_password_protected_unix_socket_with_noeviction():
    with redis_url(None) as url:
        parts = urlsplit(url)
        sock = parts.path
        assert parts.scheme == "unix" and parts.password
        assert stat.S_ISSOCK(os.stat(sock).st_mode)
        assert os.stat(os.path.dirname(sock)).st_mode & 0o777 == 0o700
        r = redis.Redis.from_url(url)
        try:
            config = r.config_get("*")
            assert config["port"] == "0"  # no TCP listener at all
            assert int(config["maxmemory"]) > 0 and config["maxmemory-policy"] == "noeviction"
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(unix_socket_path=sock).ping()
        finally:
            r.close()
    assert not os.path.exists(sock)


def test_a_configured_redis_is_used_as_given():
    with redis_url("redis://h:1/0") as url:
        assert url == "redis://h:1/0"



def test_the_worker_flags_kept_in_the_report_hold_no_password():
    """The queue scenario writes the worker's command line into the bench JSON."""
    from pagedq.bench.queue_path import recorded_flags
    from pagedq.worker.config import QueueConfig
    from pagedq.worker.config_flags import to_flags

    flags = to_flags(QueueConfig(redis_url="redis://u:s3cret@127.0.0.1:9/0", queue="q"))
    kept = recorded_flags(flags)
    assert "redis://u:***@127.0.0.1:9/0" in kept and "s3cret" not in " ".join(kept)
    assert len(kept) == len(flags)
