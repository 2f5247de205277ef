"""A gateway's stop ends promptly (issue 25): its background tasks stop when cancelled, even when
a cancel lands in the same loop turn as a Redis command's write completes.

On Python 3.11 ``asyncio.wait_for`` (redis-py wraps every command's write in one, with the
socket timeout) drops a cancel that arrives as the awaited write finishes (CPython bpo-42130,
fixed in 3.12). The gateway's batch driver then polled on, and a stop waited out the close
bound (CLOSE_TIMEOUT_S) for it. Each cycle here builds a gateway whose driver polls Redis
without pause, so a cancel lands mid-command; none may need the bound.
"""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from pagedq.gateway.http_metrics import GatewayMetrics
from pagedq.gateway.state import Gateway
from pagedq.worker.config import GatewayConfig

CYCLES = 150


async def start_and_stop(config: GatewayConfig, redis_url: str, metrics: GatewayMetrics,
                         turns: int) -> None:
    """One gateway's life as the app's lifespan runs it, its driver polling without pause."""
    gw = Gateway.build(config, redis_url, metrics)
    gw.driver.interval = 0.0
    gw.spawn(gw.driver.run())
    for _ in range(turns):  # let the driver get into its Redis commands
        await asyncio.sleep(0)
    await gw.close()


def test_a_cancel_lost_in_a_redis_write_does_not_hold_the_stop(redis_db):
    config = GatewayConfig(redis_url=redis_db, queue="close")
    metrics = GatewayMetrics()

    async def cycles() -> list[dict]:
        for i in range(CYCLES):
            with capture_logs() as logs:
                await start_and_stop(config, redis_db, metrics, turns=5 + i % 13)
            stuck = [e for e in logs if e["log_level"] == "warning"]
            if stuck:
                return stuck
        return []

    assert asyncio.run(cycles()) == []
