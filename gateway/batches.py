"""The Batch API: batch state in Redis, driven by whichever gateway holds the batch's lease.

A batch's progress is only ever in Redis, never in one gateway's memory: a gateway restarted
(or killed) mid-batch loses nothing, and another one takes over driving it once the lease
lapses. Keys (``{B}`` = the batch id as a hash tag, so a batch's keys share one slot and its
bookkeeping can be one MULTI):

    P:gw:batch:{B}            hash: obj (the batch JSON), total, next (lines handed out),
                              cancel (1 once asked)
    P:gw:batch:{B}:inflight   hash: line -> {"jobs": [...], "ok": 0|1} (ok: submit confirmed)
    P:gw:batch:{B}:out|err    hash: line -> its output / error line (HSETNX: exactly once)
    P:gw:batch:{B}:lease      the driving gateway's name (PX = batch_lease)
    P:gw:batches              zset id -> creation order (listing; P:gw:batches:order counts)
    P:gw:batches:active:Q     set of batches to drive, per queue Q

The driver keeps at most ``window`` lines of a batch in the queue, each a low-priority job;
a line's in-flight record is written before its job is submitted, so a crash in between
resubmits it (the same id and payload: the worker treats it as the same job).

Failures stay where they happen: a line that cannot be sent, whatever it raises, gets its own
error line; a batch whose driving raises is skipped for the pass (the batches beside it move
on) and, after ``MAX_DRIVE_FAILURES`` passes in a row, is failed with code ``internal``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from pagedq.client import AsyncClient
from pagedq.gateway.api_errors import APIError, too_many_prompts, unexpected
from pagedq.gateway.batch_store import TERMINAL, BatchState, BatchStore
from pagedq.gateway.files import FileStore
from pagedq.gateway.fleet import Fleet, FleetView
from pagedq.gateway.http_metrics import GatewayMetrics
from pagedq.gateway.lines import (
    Line,
    dumps,
    error_line,
    parse_line,
    refused_line,
    result_line,
)
from pagedq.gateway.thinking import fit_tool_format
from pagedq.gateway.tokens import TokenTexts
from pagedq.gateway.translate import submit
from pagedq.logging import get_logger
from pagedq.worker.config import GatewayConfig

log = get_logger("pagedq.gateway.batches")

MAX_DRIVE_FAILURES = 5  # passes in a row a batch's driving may raise before the batch fails


class BatchDriver:
    """Moves every active batch forward; one instance per gateway, batches shared by lease."""

    def __init__(self, r: Redis, client: AsyncClient, files: FileStore, fleet: Fleet,
                 tokens: TokenTexts, config: GatewayConfig, metrics: GatewayMetrics,
                 interval: float = 0.2):
        self.r = r
        self.client = client
        self.files = files
        self.fleet = fleet
        self.tokens = tokens
        self.config = config
        self.metrics = metrics
        self.interval = interval
        self.store = BatchStore(r, config.prefix, config.queue, config.files_ttl)
        self.name = f"gateway-{uuid.uuid4().hex[:12]}"
        self._inputs: dict[str, list[bytes]] = {}
        self._failures: dict[str, int] = {}  # batch -> passes in a row whose driving raised
        self._stopping = False

    def stop(self) -> None:
        """End ``run`` after its current pass: the gateway's stop does not rest on the cancel
        alone, which Python 3.11 can lose inside a Redis command (state.py, _stop_tasks)."""
        self._stopping = True

    async def run(self) -> None:
        while not self._stopping:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except RedisConnectionError as exc:
                log.warning("Redis unreachable; batches wait", error=str(exc))
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("driving batches failed; retrying")
            await asyncio.sleep(self.interval)

    async def tick(self) -> None:
        lease_ms = int(self.config.batch_lease * 1000)
        for bid in await self.store.active():
            if await self.store.lease(bid, self.name, lease_ms):
                await self._drive_alone(bid)
            else:
                self._inputs.pop(bid, None)  # another gateway drives it now

    async def _drive_alone(self, bid: str) -> None:
        """Drive one batch; what it raises (Redis being down aside) stays with it."""
        try:
            await self.drive(bid)
        except (asyncio.CancelledError, RedisConnectionError):
            raise
        except RedisError as exc:  # OOM, a timeout: Redis's state, not the batch's; next pass
            log.warning("driving a batch: Redis refused; retrying", batch=bid, error=str(exc))
            return
        except Exception:
            failures = self._failures[bid] = self._failures.get(bid, 0) + 1
            log.exception("driving a batch failed", batch=bid, failures=failures)
            if failures >= MAX_DRIVE_FAILURES:
                await self._give_up(bid)
            return
        self._failures.pop(bid, None)

    async def _give_up(self, bid: str) -> None:
        """Fail a batch that cannot be driven: cancel its jobs, keep what its record holds."""
        self._failures.pop(bid, None)
        self._inputs.pop(bid, None)
        keys = self.store.keys
        raw = await self.r.hget(keys.batch(bid), "obj")
        try:
            obj = json.loads(raw) if raw else {}
            assert isinstance(obj, dict)
        except (ValueError, AssertionError):
            obj = {}
        for rec in (await self.r.hgetall(keys.part(bid, "inflight"))).values():
            try:
                for jid in json.loads(rec)["jobs"]:
                    await self.client.handle(jid).cancel()
            except (ValueError, KeyError, TypeError):
                continue
        obj.update(id=bid, object="batch", status="failed", failed_at=int(time.time()),
                   errors={"object": "list", "data": [{
                       "code": "internal", "line": None, "param": None,
                       "message": f"the gateway could not drive this batch {MAX_DRIVE_FAILURES} "
                                  "times in a row; its log says why"}]})
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.batch(bid), "obj", json.dumps(obj))
        pipe.expire(keys.batch(bid), self.config.files_ttl)
        pipe.srem(keys.active, bid)
        await pipe.execute()
        log.error("batch failed: it could not be driven", batch=bid)

    async def drive(self, bid: str) -> None:
        state = await self.store.load(bid, with_inflight=True)
        if state is None or state.obj["status"] in TERMINAL:
            await self.r.srem(self.store.keys.active, bid)
            self._inputs.pop(bid, None)
            return
        lines = await self._input(state)
        if lines is None:
            return
        await self._collect(bid, state, lines)
        expired = time.time() >= state.obj["expires_at"]
        if state.cancel or expired:
            await self._stop(state)
            if not state.inflight:
                await self._finalize(state, "expired" if expired and not state.cancel
                                     else "cancelled", lines)
            return
        await self._submit(bid, state, lines)
        if state.next >= state.total and not state.inflight:
            await self._finalize(state, "completed", lines)

    async def _input(self, state: BatchState) -> list[bytes] | None:
        """The batch's input lines (read once per driver); a missing file fails the batch."""
        bid = state.obj["id"]
        if bid not in self._inputs:
            data = await self.files.content(state.obj["input_file_id"])
            if data is None:
                await self._fail(state, "file_not_found",
                                 f"input file {state.obj['input_file_id']} does not exist")
                return None
            self._inputs[bid] = [ln for ln in data.splitlines() if ln.strip()]
        lines = self._inputs[bid]
        if state.obj["status"] == "validating":
            if len(lines) > self.config.max_batch_lines or not lines:
                await self._fail(state, "invalid_file",
                                 f"the input has {len(lines)} lines; a batch takes 1 to "
                                 f"{self.config.max_batch_lines}")
                return None
            twice = duplicate_custom_id(lines)
            if twice is not None:
                await self._fail(state, "duplicate_custom_id", twice)
                return None
            state.total = len(lines)
            state.obj.update(status="in_progress", in_progress_at=int(time.time()))
            await self.store.save_obj(state.obj, total=state.total)
        return lines

    async def _fail(self, state: BatchState, code: str, message: str) -> None:
        state.obj.update(status="failed", failed_at=int(time.time()),
                         errors={"object": "list", "data": [{"code": code, "message": message,
                                                             "param": None, "line": None}]})
        await self.store.save_obj(state.obj)
        await self.r.expire(self.store.keys.batch(state.obj["id"]), self.config.files_ttl)

    async def _line(self, state: BatchState, lines: list[bytes], n: int,
                    fleet: FleetView | None = None) -> Line:
        line = parse_line(lines[n], n, state.obj["endpoint"], f"{state.obj['id']}-{n}")
        if line.spec is not None and fleet is not None:  # tool calls in the served model's format (tools.py)
            await fit_tool_format(line.spec, fleet.path_of(line.spec.view.model),
                                  self.config.tool_call_format)
        return line

    async def _submit(self, bid: str, state: BatchState, lines: list[bytes]) -> None:
        """Hand out the next lines up to the window: record them, then submit their jobs."""
        last = min(state.total, state.next + self.config.batch_window - len(state.inflight))
        if last <= state.next:
            return
        fleet = await self.fleet.view()
        parsed = [await self._line(state, lines, n, fleet) for n in range(state.next, last)]
        keys = self.store.keys
        pipe = self.r.pipeline(transaction=True)
        for line in parsed:
            if line.spec is not None and len(line.spec.prompts) > self.config.max_prompts:
                line.error = too_many_prompts(len(line.spec.prompts), self.config.max_prompts)
            if line.error is None and line.spec is not None and fleet.alive \
                    and fleet.path_of(line.spec.view.model) is None:
                line.error = model_not_found(line.spec.view.model)
            if line.error is not None:
                pipe.hsetnx(keys.part(bid, "err"), line.number,
                            dumps(refused_line(line, line_rid(bid, line), line.error)))
                self.metrics.batch_lines.labels("failed").inc()
            else:
                pipe.hset(keys.part(bid, "inflight"), line.number,
                          json.dumps({"jobs": line.spec.job_ids, "ok": 0}))
        pipe.hset(keys.batch(bid), "next", last)
        await pipe.execute()
        state.next = last
        await self._send(bid, state, [ln for ln in parsed if ln.error is None])

    async def _send(self, bid: str, state: BatchState, lines: list[Line]) -> None:
        keys = self.store.keys
        pipe = self.r.pipeline(transaction=False)
        for line in lines:
            assert line.spec is not None
            try:
                await submit(self.client, line.spec)
            except (asyncio.CancelledError, RedisError):
                raise  # not the line's fault: it stays unconfirmed and is sent again
            except Exception as exc:  # the line fails alone, whatever it raised
                err = exc if isinstance(exc, APIError) else unexpected(exc)
                if err.status >= 500:
                    log.exception("a batch line could not be sent", batch=bid, line=line.number)
                pipe.hsetnx(keys.part(bid, "err"), line.number,
                            dumps(refused_line(line, line_rid(bid, line), err)))
                pipe.hdel(keys.part(bid, "inflight"), line.number)
                state.inflight.pop(line.number, None)
                self.metrics.batch_lines.labels("failed").inc()
                continue
            record = {"jobs": line.spec.job_ids, "ok": 1}
            pipe.hset(keys.part(bid, "inflight"), line.number, json.dumps(record))
            state.inflight[line.number] = record
        await pipe.execute()

    async def _collect(self, bid: str, state: BatchState, lines: list[bytes]) -> None:
        """Lines whose jobs all ended -> their output or error line, exactly once."""
        unconfirmed = [n for n, rec in state.inflight.items() if not rec["ok"]]
        fleet = await self.fleet.view()
        if unconfirmed and not state.cancel:  # a driver died between recording and submitting
            await self._send(bid, state, [await self._line(state, lines, n, fleet)
                                          for n in unconfirmed])
        jobs = [(n, jid) for n, rec in state.inflight.items() for jid in rec["jobs"]]
        if not jobs:
            return
        pipe = self.r.pipeline(transaction=False)
        for _, jid in jobs:
            pipe.hget(self.client.keys.state(jid), "done")
        pending = {n for (n, _), done in zip(jobs, await pipe.execute(), strict=True)
                   if done != b"1"}
        expiring = time.time() >= state.obj["expires_at"] and not state.cancel
        keys = self.store.keys
        for n in [n for n in state.inflight if n not in pending]:
            line = await self._line(state, lines, n, fleet)
            rid = line_rid(bid, line)
            outcome = await outcome_of(self.client, line.spec.job_ids)
            text = self.tokens.lookup(fleet.path_of(line.spec.view.model))
            try:
                ok, record = result_line(line, rid, outcome, text)
            except Exception as exc:  # rendering this answer failed: the line fails alone
                log.exception("a batch line's answer could not be rendered", batch=bid, line=n)
                ok, record = False, error_line(line, rid, unexpected(exc), True)
            if record is None and expiring:
                record = error_line(line, rid, batch_expired(), False)
            pipe = self.r.pipeline(transaction=True)
            if record is not None:
                pipe.hsetnx(keys.part(bid, "out" if ok else "err"), n, dumps(record))
                self.metrics.batch_lines.labels("completed" if ok else "failed").inc()
            pipe.hdel(keys.part(bid, "inflight"), n)
            await pipe.execute()
            del state.inflight[n]

    async def _stop(self, state: BatchState) -> None:
        """Cancel the jobs still in flight (queued ones end at once, running ones soon)."""
        for rec in state.inflight.values():
            for jid in rec["jobs"]:
                await self.client.handle(jid).cancel()

    async def _finalize(self, state: BatchState, status: str, lines: list[bytes]) -> None:
        """Write the output and error files and end the batch (idempotent: fixed file ids)."""
        bid = state.obj["id"]
        keys = self.store.keys
        if status == "expired":
            pipe = self.r.pipeline(transaction=False)
            for n in range(state.next, state.total):
                line = await self._line(state, lines, n)
                pipe.hsetnx(keys.part(bid, "err"), n,
                            dumps(error_line(line, line_rid(bid, line), batch_expired(), False)))
            await pipe.execute()
        out, err = await self.r.hgetall(keys.part(bid, "out")), await self.r.hgetall(
            keys.part(bid, "err"))
        now = int(time.time())
        obj = state.obj
        for name, records, purpose in (("output", out, "batch_output"),
                                       ("error", err, "batch_output")):
            if records:
                data = b"".join(records[k] + b"\n" for k in sorted(records, key=int))
                f = await self.files.put(data, f"{bid}_{name}.jsonl", purpose,
                                         file_id=f"file-{bid}-{name}", owner=state.owner)
                obj[f"{name}_file_id"] = f.id
        obj["request_counts"] = {"total": state.total, "completed": len(out), "failed": len(err)}
        obj.update(status=status, finalizing_at=obj.get("finalizing_at") or now,
                   cancelling_at=obj.get("cancelling_at") or (now if state.cancel else None))
        obj[f"{status}_at"] = now
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.batch(bid), "obj", json.dumps(obj))
        pipe.delete(keys.part(bid, "out"), keys.part(bid, "err"), keys.part(bid, "inflight"))
        pipe.expire(keys.batch(bid), self.config.files_ttl)
        await pipe.execute()
        await self.r.srem(keys.active, bid)
        self._inputs.pop(bid, None)
        log.info("batch ended", batch=bid, status=status, **obj["request_counts"])


def duplicate_custom_id(lines: list[bytes]) -> str | None:
    """The first custom_id two lines share, as a message (OpenAI refuses such a batch)."""
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines):
        try:
            custom_id = json.loads(raw).get("custom_id")
        except (ValueError, AttributeError, RecursionError):
            continue  # a malformed line fails alone later
        if not isinstance(custom_id, str):
            continue
        if custom_id in seen:
            return (f"custom_id {custom_id[:64]!r} is on lines {seen[custom_id] + 1} and {n + 1}: "
                    "give each line its own")
        seen[custom_id] = n
    return None


def line_rid(bid: str, line: Line) -> str:
    return line.spec.id if line.spec is not None else f"{bid}-{line.number}"


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist: no live worker serves it",
                    "invalid_request_error", "model_not_found", "model")


def batch_expired() -> APIError:
    return APIError(400, "this request was not completed before the batch expired",
                    "invalid_request_error", "batch_expired")


async def outcome_of(client: AsyncClient, job_ids: list[str],
                     timeout: float | None = 2.0) -> list[Any] | Exception:
    """Each job's Result, or the first job's error. The driver calls it once the jobs are done
    (a short timeout only guards against expired streams); ``pagedq batch`` waits."""
    results = []
    for jid in job_ids:
        try:
            results.append(await client.handle(jid).result(timeout=timeout))
        except Exception as exc:
            return exc
    return results
