"""Resumable SSE streams: ``id:`` = the event's position, ``Last-Event-ID`` replays exactly
after it (on any gateway), and a stream nobody comes back to is cancelled after the grace."""

from __future__ import annotations

import json
import time

import pytest
import redis

from pagedq.client.protocol import Keys, decode_event
from tests.gateway.harness import serve, wait_until
from tests.service.harness import running_worker

# long enough that a dropped stream is still running when the test reconnects
ENGINE = dict(num_kv_blocks=160, max_model_len=1024, max_num_seqs=4)


@pytest.fixture(scope="module")
def worker(redis_url, tiny_model, queue):
    with running_worker(redis_url, tiny_model, f"{queue}-w", queue=queue, engine=ENGINE) as w:
        yield w


def body(model: str, max_tokens: int, stream: bool = True) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me about Paris"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}


def sdk_args(b: dict) -> dict:
    """The openai SDK takes vLLM's fields in extra_body."""
    b = {k: v for k, v in b.items() if v is not None}
    extra = {"ignore_eos": b.pop("ignore_eos")}
    return {**b, "extra_body": extra}


def read_events(lines, stop_after_id: int | None = None) -> list[tuple[int | None, str]]:
    """SSE lines -> [(last id, data)] (the id in force when each event was dispatched)."""
    out, event_id, last = [], None, None
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            if event_id is not None:
                last = event_id
            out.append((event_id, line[6:]))
            event_id = None
            if stop_after_id is not None and last is not None and last >= stop_after_id:
                break
    return out


def content(events) -> str:
    text = ""
    for _, data in events:
        if data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                text += choice["delta"].get("content") or ""
    return text


def test_last_event_id_resumes_exactly_after_it_on_another_gateway(redis_url, queue, worker,
                                                                  tiny_id):
    with serve(redis_url, queue=queue) as gw1, serve(redis_url, queue=queue) as gw2:
        plain = gw1.openai().chat.completions.create(**sdk_args(body(tiny_id, 300, False)))
        with gw1.http() as http, http.stream("POST", "/v1/chat/completions",
                                             json=body(tiny_id, 300)) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            first = read_events(resp.iter_lines(), stop_after_id=6)
        rid = json.loads(first[-1][1])["id"]
        last_id = max(i for i, _ in first if i is not None)
        with gw2.http() as http:
            with http.stream("GET", f"/v1/requests/{rid}/stream",
                             headers={"Last-Event-ID": str(last_id)}) as resp:
                rest = read_events(resp.iter_lines())
            with http.stream("GET", f"/v1/requests/{rid}/stream") as resp:
                replay = read_events(resp.iter_lines())
    assert rest[-1][1] == "[DONE]" and all(i is None or i > last_id for i, _ in rest)
    assert content(first) + content(rest) == plain.choices[0].message.content
    assert replay[:len(first)] == first and replay[len(first):] == rest  # byte for byte
    usage = json.loads(rest[-2][1])["usage"]
    assert usage["completion_tokens"] == 300 == plain.usage.completion_tokens


def job_seconds(redis_url: str, queue: str, tiny_id: str) -> float:
    """How long the 900-token job of these tests takes here, end to end (about a second on a
    2024 2-core VM, a third of that on a Zen 5 core since the step's Python was cut): a grace
    that must run out while it still runs is set against it."""
    with serve(redis_url, queue=queue) as gw, gw.http() as http:
        started = time.monotonic()
        assert http.post("/v1/chat/completions", json=body(tiny_id, 900, stream=False),
                         timeout=60).status_code == 200
        return time.monotonic() - started


def test_a_dropped_stream_is_cancelled_after_the_grace(redis_url, queue, worker, tiny_id):
    r = redis.Redis.from_url(redis_url)
    keys = Keys(queue)
    grace = min(0.3, job_seconds(redis_url, queue, tiny_id) / 4)
    with serve(redis_url, queue=queue, disconnect_grace=grace) as gw:
        with gw.http() as http, http.stream("POST", "/v1/chat/completions",
                                            json=body(tiny_id, 900)) as resp:
            events = read_events(resp.iter_lines(), stop_after_id=2)
        rid = json.loads(events[-1][1])["id"]
        wait_until(lambda: r.hget(keys.state(rid), "done") == b"1", 30, "the job's end")
        evs = [decode_event(f, i) for i, f in r.xrange(keys.out(rid))]
        assert evs[-1].type == "cancelled"
        assert sum(len(e.token_ids) for e in evs) < 900  # stopped early: its KV freed
        wait_until(lambda: worker.engine.stats()["kv_blocks_used"] == 0, 30, "KV freed")
        with gw.http() as http:
            text = http.get("/metrics").text
        assert "pagedq_gateway_abandoned_streams_total 1.0" in text


def test_a_stream_resumed_within_the_grace_is_not_cancelled(redis_url, queue, worker, tiny_id):
    """Not vacuous: the job is checked to be still running after the first drop's grace ran
    out, so only the resume can have kept it alive."""
    r = redis.Redis.from_url(redis_url)
    keys = Keys(queue)
    # a grace short against the job, timed first, so the job still runs when the grace has passed
    grace = min(0.5, job_seconds(redis_url, queue, tiny_id) / 4)
    with serve(redis_url, queue=queue, disconnect_grace=grace) as gw:
        with gw.http() as http:
            with http.stream("POST", "/v1/chat/completions", json=body(tiny_id, 900)) as resp:
                events = read_events(resp.iter_lines(), stop_after_id=2)
            dropped = time.monotonic()
            rid = json.loads(events[-1][1])["id"]
            time.sleep(grace / 5)
            with http.stream("GET", f"/v1/requests/{rid}/stream",
                             headers={"Last-Event-ID": "2"}) as resp:
                time.sleep(max(0.0, dropped + 1.3 * grace - time.monotonic()))  # past it
                running = r.hget(keys.state(rid), "done") != b"1"
                rest = read_events(resp.iter_lines())
    r.close()
    assert running, ("the job ended within the first drop's grace, so this test proves "
                     "nothing: give it more tokens")
    assert rest[-1][1] == "[DONE]"
    assert json.loads(rest[-2][1])["usage"]["completion_tokens"] == 900


def test_a_reader_leaving_after_the_record_expired_leaves_no_key_without_a_ttl(redis_url,
                                                                               queue):
    """Issue 25, Low-5: ``Readers.detach`` on a stream whose record expired meanwhile recreates
    the hash (HINCRBY); it must come back with the TTL, never as a key kept for good."""
    import asyncio

    import redis.asyncio as aredis

    from pagedq.gateway.sse import Readers

    async def run() -> tuple[int, int]:
        r = aredis.Redis.from_url(redis_url)
        readers = Readers(r, Keys(queue), ttl=60)
        key = readers.key("chatcmpl-expired")
        await r.delete(key)  # as if its TTL ran out while the client was reading
        await readers.detach("chatcmpl-expired", dropped=True)
        after_drop = await r.ttl(key)
        await readers.attach("chatcmpl-expired")
        await readers.detach("chatcmpl-expired", dropped=False)
        after_leave = await r.ttl(key)
        await r.delete(key)
        await r.aclose()
        return after_drop, after_leave

    after_drop, after_leave = asyncio.run(run())
    assert 0 < after_drop <= 60 and 0 < after_leave <= 60
