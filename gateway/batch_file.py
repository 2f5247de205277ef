"""``pagedq batch IN.jsonl -o OUT.jsonl``: an OpenAI batch file through the queue, offline
(vLLM's ``run-batch``), with a progress bar.

Each line becomes a low-priority job; at most ``window`` are in the queue at once. OUT gets
one line per input line, in input order, in the Batch API's output format; lines that failed
carry their error there too (``response.status_code`` >= 400: the answer the HTTP route would
give, or ``error`` for a line that never became a request), so one file tells the whole story.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aredis
from tqdm import tqdm

from pagedq.client import AsyncClient
from pagedq.client.connection import TLSFiles
from pagedq.gateway.api_errors import unexpected
from pagedq.gateway.batches import model_not_found, outcome_of
from pagedq.gateway.fleet import Fleet
from pagedq.gateway.lines import Line, dumps, parse_line, refused_line, result_line
from pagedq.gateway.tokens import TokenTexts
from pagedq.gateway.translate import submit


async def run_batch(in_path: Path, out_path: Path, redis_url: str, queue: str, prefix: str,
                    window: int, ready_timeout: float, progress: bool = True,
                    tls: TLSFiles | None = None) -> tuple[int, int]:
    """Run every line; returns (succeeded, failed). ``tls``: the files for a rediss:// URL."""
    raws = [ln for ln in in_path.read_bytes().splitlines() if ln.strip()]
    r = aredis.Redis.from_url(redis_url, max_connections=window + 16,
                              **(tls.kwargs() if tls else {}))
    client = AsyncClient(queue=queue, prefix=prefix, connection=r)
    fleet = Fleet(client, 1.0)
    tokens = TokenTexts()
    run = f"offline-{uuid.uuid4().hex[:12]}"
    gate = asyncio.Semaphore(window)
    try:
        await _wait_for_worker(fleet, ready_timeout)
        bar = tqdm(total=len(raws), unit="line", disable=not progress)

        async def one(n: int) -> tuple[bool, dict[str, Any]]:
            line = parse_line(raws[n], n, None, f"{run}-{n}")
            try:
                return await _run_line(line, client, fleet, tokens, gate)
            finally:
                bar.update(1)

        records = await asyncio.gather(*(one(n) for n in range(len(raws))))
        bar.close()
    finally:
        await r.aclose()
    out_path.write_text("".join(dumps(rec) + "\n" for _, rec in records))
    ok = sum(1 for good, _ in records if good)
    return ok, len(records) - ok


async def _run_line(line: Line, client: AsyncClient, fleet: Fleet, tokens: TokenTexts,
                    gate: asyncio.Semaphore) -> tuple[bool, dict[str, Any]]:
    rid = line.spec.id if line.spec is not None else f"line-{line.number}"
    if line.error is None and line.spec is not None \
            and (await fleet.view()).path_of(line.spec.view.model) is None:
        line.error = model_not_found(line.spec.view.model)  # refused, never answered by another
    if line.error is not None:
        return False, refused_line(line, rid, line.error)
    assert line.spec is not None
    async with gate:
        try:
            await submit(client, line.spec)
        except Exception as exc:  # the line fails alone, whatever it raised
            return False, refused_line(line, rid, unexpected(exc))
        outcome = await outcome_of(client, line.spec.job_ids, timeout=None)
    path = (await fleet.view()).path_of(line.spec.view.model)
    ok, record = result_line(line, rid, outcome, tokens.lookup(path))
    assert record is not None  # nothing cancels these jobs
    return ok, record


async def _wait_for_worker(fleet: Fleet, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not (await fleet.view()).alive:
        if time.monotonic() > end:
            raise TimeoutError(f"no live worker on the queue after {timeout:.0f}s")
        await asyncio.sleep(0.5)


def summary(ok: int, failed: int, out_path: Path) -> str:
    return json.dumps({"succeeded": ok, "failed": failed, "output": str(out_path)})
