"""The embedded redis-server's advertisement: how `pagedq submit`/`stats` and other workers on
the same machine find the server a `pagedq worker` started, on a real redis-server."""

from __future__ import annotations

import asyncio
import json
import secrets

import pytest

from pagedq import embedded_redis
from pagedq.embedded_redis import (
    EmbeddedRedis,
    advertise,
    find_advertised,
    free_port,
    withdraw,
)
from pagedq.worker.service.redis_link import RedisLink


def test_advertised_server_is_found_while_it_answers(tmp_path):
    path = tmp_path / "embedded-redis.json"
    assert find_advertised(path) is None  # nothing advertised
    with EmbeddedRedis.start() as server:
        advertise(server, path)
        assert find_advertised(path) == server.url
    assert find_advertised(path) is None  # stale: the server is gone


def test_garbage_and_foreign_advertisements(tmp_path):
    path = tmp_path / "embedded-redis.json"
    path.write_text("{not json")
    assert find_advertised(path) is None
    path.write_text(json.dumps({"url": f"redis://127.0.0.1:{free_port()}/0", "owner_pid": 1}))
    assert find_advertised(path) is None  # nothing listens there
    withdraw(path)  # another process's advertisement stays
    assert path.exists()


def test_a_worker_link_advertises_its_server_and_a_second_one_joins(tmp_path):
    path = tmp_path / "embedded-redis.json"

    async def scenario():
        first = await RedisLink.open(None, discovery=path)
        try:
            assert first.embedded is not None and find_advertised(path) == first.embedded.url
            second = await RedisLink.open(None, discovery=path)
            try:
                assert second.embedded is None and second.url == first.url
                await second.redis.set("k", "from the second")
                assert await first.redis.get("k") == b"from the second"
            finally:
                await second.close()
            assert find_advertised(path) == first.embedded.url  # a joiner withdraws nothing
        finally:
            await first.close()
        return first.embedded

    server = asyncio.run(scenario())
    assert server.process.poll() is not None and not path.exists()


def test_an_explicit_url_is_never_advertised(tmp_path, redis_url):
    path = tmp_path / "embedded-redis.json"

    async def scenario():
        link = await RedisLink.open(redis_url, discovery=path)
        await link.close()

    asyncio.run(scenario())
    assert not path.exists()


def test_generated_passwords_never_read_as_an_option(monkeypatch):
    """redis-server reads an argument starting with "--" as an option: a password that began
    so ("--6T_XiVz...", 1 in 4096 of secrets.token_urlsafe's) failed the start. Generated ones
    never start with '-', and one given that does is refused with a clear error."""
    assert not any(embedded_redis.new_password().startswith("-") for _ in range(5000))
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n=None: "--6T_XiVzTkPlQ8vktqQ9bAzKA")
    with EmbeddedRedis.start() as server:  # the generator no longer draws from token_urlsafe
        assert not server.password.startswith("-")
    with pytest.raises(ValueError, match="cannot start with '-'"):
        EmbeddedRedis.start(password="--6T_XiVzTkPlQ8vktqQ9bAzKA")
