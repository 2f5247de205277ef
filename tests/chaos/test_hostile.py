"""Hostile input: thousands of malformed entries mixed with good jobs.

Random bytes, deeply nested msgpack, 20 MB payloads, ids with forbidden characters, absurd
numbers (max_tokens 1e12, n 1e6 and 2**63, logprobs 1e6, top_k 2**62, negative and huge token
ids), huge stop lists, and good-looking entries that reuse a good job's id with another payload.
Zero crashes; every entry that names a valid id of its own is answered with an error event;
the good jobs finish with the engine's tokens, untouched; nothing is left pending; the
dead-letter stream stays within its byte budget.
"""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import redis

from pagedq.client.protocol import F_ID, F_PAYLOAD, GROUP, PROTOCOL_VERSION, Keys, decode_event
from tests.chaos.harness import (
    Fleet,
    Job,
    Submitter,
    audit,
    expected_tokens,
    report,
    wait_serving,
)
from tests.chaos.servers import RedisServer

PROFILES = {"short": (1000, 20, 2), "long": (10_000, 50, 20)}  # bad, good, 20 MB payloads
DEAD_LETTER_MAX_BYTES = 4 << 20


def body(rid, **over):
    base = {"v": PROTOCOL_VERSION, "id": rid, "prompt_token_ids": [1, 2, 3],
            "params": {"max_tokens": 4}}
    base.update(over)
    return msgpack.packb(base)


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"  # [[[...[1]...]]]


def hostile(k: int, rng: random.Random, good_ids: list[str]) -> tuple[dict, str | None]:
    """The k-th malformed entry and the id it can be answered under (None: unaddressable)."""
    rid = f"bad-{k}"
    kind = k % 16
    if kind == 0:
        return {F_ID: rid, F_PAYLOAD: rng.randbytes(rng.randrange(1, 200))}, rid
    if kind == 1:
        return {F_PAYLOAD: rng.randbytes(64)}, None
    if kind == 2:
        return {F_ID: rid, F_PAYLOAD: nested(rng.choice([50, 5000, 200_000]))}, rid
    if kind == 3:
        bad = rng.choice(["a}b", "x y", "{q}", "é", "z" * 200, "", "a#1", "-\n-"])
        return {F_ID: bad, F_PAYLOAD: body(bad)}, None
    if kind == 4:
        return {F_ID: rid, F_PAYLOAD: body(rid, params={"max_tokens": 10**12})}, rid
    if kind == 5:
        n = rng.choice([10**6, 10**12, 2**63, -1, 0])
        return {F_ID: rid, F_PAYLOAD: body(rid, params={"n": n})}, rid
    if kind == 6:
        return {F_ID: rid, F_PAYLOAD: body(rid, params={"logprobs": 10**6})}, rid
    if kind == 7:
        ids = rng.choice([[-1], [2**40], [2**63], [1, 10**9], [True]])
        return {F_ID: rid, F_PAYLOAD: body(rid, prompt_token_ids=ids)}, rid
    if kind == 8:
        stops = ["s"] * rng.choice([100_000, 2000]) if k % 3 else ["x" * 100_000]
        return {F_ID: rid, F_PAYLOAD: body(rid, params={"stop": stops})}, rid
    if kind == 9:
        return {F_ID: rid, F_PAYLOAD: body(rid, params={"top_k": 2**62,
                                                        "temperature": 0.5})}, rid
    if kind == 10:
        return {F_ID: rid, F_PAYLOAD: body(rid, params={"stop_token_ids": [2**63]})}, rid
    if kind == 11:  # another payload under a good job's id: dropped, the good job untouched
        return {F_ID: rng.choice(good_ids), F_PAYLOAD: body(rng.choice(good_ids),
                                                          prompt_token_ids=[9, 9])}, None
    if kind == 12:
        return {F_ID: rid, F_PAYLOAD: msgpack.packb({"v": 1, "id": rid, "prompt": 5,
                                                     "metadata": {"k": [1] * 1000}})}, rid
    if kind == 13:
        return {F_ID: rid, F_PAYLOAD: body(rid, deadline=float("nan"), priority=10**9)}, rid
    if kind == 14:
        return {F_ID: rid, F_PAYLOAD: body(rid, params={"temperature": "hot",
                                                        "seed": 2**64 - 1})}, rid
    return {F_ID: rid, b"junk" * 3: rng.randbytes(32), F_PAYLOAD: b""}, rid


@pytest.mark.timeout(3600)
def test_hostile_entries_crash_nothing_and_every_addressable_one_is_answered(
        tmp_path, tiny_model_dir, profile):
    bad_count, good_count, huge_count = PROFILES[profile]
    model = str(tiny_model_dir("llama"))
    rng = random.Random(3)
    from pagedq.params import SamplingParams

    good = [Job([rng.randrange(3, 300) for _ in range(5)],
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
            for _ in range(good_count)]
    expected = expected_tokens(model, good)
    server = RedisServer(tmp_path / "redis").start()
    keys = Keys("hostile")
    stream = keys.jobs("normal")
    fleet = Fleet(server.url, model, keys.queue, tmp_path, "--reclaim-after", "5",
                  "--dead-letter-max-bytes", str(DEAD_LETTER_MAX_BYTES))
    rss_max: dict[str, int] = {}
    try:
        for name in ("h1", "h2"):
            fleet.spawn(name)
        with redis.Redis.from_url(server.url) as r:
            wait_serving(r, keys, ["h1", "h2"])
            sub = Submitter(server.url, keys.queue, good, timeout=900).start()
            while sum(bool(j.id) for j in good) < good_count:
                time.sleep(0.05)
            answerable = _flood(r, stream, bad_count, huge_count, rng, [j.id for j in good])
            end = time.monotonic() + 1800
            while (r.xlen(stream) or not sub.join(0.1)) and time.monotonic() < end:
                for name in fleet.procs:
                    rss_max[name] = max(rss_max.get(name, 0), fleet.rss(name))
                time.sleep(0.5)
            assert sub.join(60)
            result = audit(r, keys, good, expected, model=model)
            unanswered = [rid for rid in answerable if not _ended(r, keys, rid)]
            pending = r.xpending(stream, GROUP)["pending"]
            left = r.xlen(stream)
            dead = r.xlen(keys.dead)
            dead_bytes = r.memory_usage(keys.dead) or 0
        crashed = fleet.crashed()
    finally:
        fleet.stop()
        server.stop()
    report(f"hostile[{profile}]", malformed=bad_count, good=good_count,
           addressable=len(answerable), unanswered=len(unanswered), good_exact=result.done,
           flipped=result.flipped,
           crashes=len(crashed), pending=pending, dead_letters=dead,
           dead_letter_mb=round(dead_bytes / 2**20, 1),
           max_rss_mb={k: v >> 20 for k, v in rss_max.items()})
    assert not crashed, crashed
    assert result.clean, (str(result), result.problems[:5])
    assert unanswered == [], unanswered[:10]
    assert pending == 0 and left == 0
    assert dead_bytes <= 1.5 * DEAD_LETTER_MAX_BYTES


def _flood(r, stream, count, huge, rng, good_ids) -> list[str]:
    """XADD the malformed entries (and ``huge`` 20 MB ones); returns the answerable ids."""
    answerable = []
    pipe = r.pipeline(transaction=False)
    for k in range(count):
        fields, rid = hostile(k, rng, good_ids)
        pipe.xadd(stream, fields)
        if rid is not None:
            answerable.append(rid)
        if len(pipe) >= 200:
            pipe.execute()
    pipe.execute()
    for k in range(huge):
        rid = f"huge-{k}"
        r.xadd(stream, {F_ID: rid, F_PAYLOAD: body(rid, prompt="x" * (20 << 20))})
        answerable.append(rid)
    return answerable


def _ended(r, keys, rid) -> bool:
    last = r.xrevrange(keys.out(rid), count=1)
    return bool(last) and decode_event(last[0][1], last[0][0]).terminal
