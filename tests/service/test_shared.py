"""RedisFull: a refusal for lack of memory pauses admission briefly, never for good."""

from __future__ import annotations

from redis.exceptions import OutOfMemoryError

from pagedq.worker.service import shared
from pagedq.worker.service.shared import RedisFull


def test_a_full_redis_is_tried_again_even_with_nothing_to_publish(monkeypatch):
    """An idle worker publishes nothing, so only a retry of its own can see that Redis has room
    again: ``full`` lapses RETRY_S after the latest refusal, and each refusal renews it."""
    now = [100.0]
    monkeypatch.setattr(shared.time, "monotonic", lambda: now[0])
    full = RedisFull()
    assert not full.full
    full.failed(OutOfMemoryError("OOM"))
    assert full.full
    now[0] += RedisFull.RETRY_S
    assert not full.full  # admission tries a claim again
    full.failed(OutOfMemoryError("OOM"))  # still full: paused again, the outage goes on
    assert full.full and full.since == 100.0
    full.succeeded()
    assert not full.full and full.since is None
