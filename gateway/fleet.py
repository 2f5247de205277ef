"""What the queue's workers serve right now, read from their checkpoints.

Every worker writes a checkpoint with its model and state each second (TTL'd), so a dead
worker vanishes on its own. The gateway reads them (and the queue depth) through the SDK's
``stats()`` and reuses the reading for ``fleet_cache`` seconds: admission checks cost no
Redis round trip per request, and a burst of requests shares one reading.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from redis.exceptions import RedisError

from pagedq.client import AsyncClient
from pagedq.logging import get_logger

log = get_logger("pagedq.gateway.fleet")

SERVING = "serving"


def model_id(model: str) -> str:
    """The id /v1/models shows for a worker's model: its directory's name."""
    return PurePath(str(model)).name or str(model)


@dataclass
class FleetView:
    """One reading: the models live workers serve (id -> their model path) and the depth."""

    models: dict[str, str] = field(default_factory=dict)
    alive: int = 0
    interactive_depth: int = 0  # jobs waiting at high and normal priority
    read_at: float = 0.0

    def path_of(self, requested: str) -> str | None:
        """The model path a request names, by id or by full path; None if nobody serves it."""
        if requested in self.models:
            return self.models[requested]
        return requested if requested in self.models.values() else None


def fleet_view(stats: dict[str, Any]) -> FleetView:
    view = FleetView(read_at=time.monotonic())
    for worker in stats["workers"]:
        if worker.get("state") != SERVING:
            continue
        view.alive += 1
        model = str(worker.get("model", ""))
        view.models.setdefault(model_id(model), model)
    view.interactive_depth = sum(level["lag"] for name, level in stats["levels"].items()
                                 if name != "low")
    return view


class Fleet:
    """A cached ``FleetView``; concurrent callers share one refresh."""

    def __init__(self, client: AsyncClient, max_age: float):
        self.client = client
        self.max_age = max_age
        self._view = FleetView()
        self._refresh: asyncio.Task | None = None

    async def view(self) -> FleetView:
        if time.monotonic() - self._view.read_at <= self.max_age:
            return self._view
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._refresh)

    async def watch(self, interval: float = 1.0) -> None:
        """Read the fleet until a worker serves, then end: the "ready" line is logged when
        ``serve``'s own worker has loaded its model, not at the first request after."""
        while True:
            try:
                if (await self.view()).alive:
                    return
            except RedisError as exc:  # Redis not up yet (or gone): the routes say so
                log.debug("reading the fleet failed; retrying", error=type(exc).__name__)
            await asyncio.sleep(interval)

    async def _read(self) -> FleetView:
        before, self._view = self._view, fleet_view(await self.client.stats())
        if self._view.alive and not before.alive:  # the first reading, or workers came back
            log.info("workers serving: the gateway is ready", workers=self._view.alive,
                     models=sorted(self._view.models))
        elif before.alive and not self._view.alive:
            log.warning("no worker serves the queue: requests get 503 until one does")
        return self._view
