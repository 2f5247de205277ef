"""The asyncio client against a real Redis and a worker: the same protocol as the blocking one."""

from __future__ import annotations

import asyncio

import pytest

from pagedq.client import AsyncClient, RequestCancelledError, SamplingParams
from pagedq.worker.cli.queue import render_stats
from tests.service.harness import running_worker


def test_async_client_end_to_end(redis_db, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=6)

    async def scenario():
        async with AsyncClient(redis_db) as client:
            h = await client.submit([1, 4, 9], params)
            streamed = [e async for e in h.stream(timeout=60)]
            res = await h.result(timeout=5)
            many = await client.generate([[2, 3], [4, 5, 6]], params, timeout=60)
            long = await client.submit([3, 3], SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in long.stream(timeout=60):
                break
            assert await long.cancel()
            with pytest.raises(RequestCancelledError):
                await long.result(timeout=30)
            stats = await client.stats()
            return streamed, res, many, stats

    with running_worker(redis_db, model, "aw"):
        streamed, res, many, stats = asyncio.run(scenario())
    assert [t for e in streamed for t in e.token_ids] == res.token_ids and len(res.token_ids) == 6
    assert [len(r.token_ids) for r in many] == [6, 6]
    assert stats["workers"][0]["name"] == "aw"
    table = render_stats(stats)
    assert "aw" in table and "normal" in table
