"""``pagedq serve`` with no Redis URL: it joins the embedded Redis a local `pagedq worker`
advertises instead of starting a second, idle stack."""

from __future__ import annotations

from pagedq.worker.config import settings
from pagedq.worker.gateway.local import queue_stack
from pagedq.worker.service.embedded_redis import EmbeddedRedis, advertise, withdraw


def test_serve_joins_an_advertised_embedded_redis(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    settings.cache_clear()
    with EmbeddedRedis.start() as server:
        path = advertise(server)
        assert path.parent == tmp_path
        try:
            with queue_stack(None, "default", "pagedq", None) as url:
                assert url == server.url
        finally:
            withdraw(path)
    settings.cache_clear()
