"""Structured outputs through the queue: valid results, invalid_params for bad constraints, and a
worker killed mid-structure whose job another worker finishes exactly (it replays the streamed
tokens into a fresh matcher).

The model is a random-weight Llama with the bundled tokenizer: only the constraint makes its
output valid. Oracles: the in-process Engine for every token, jsonschema / re.fullmatch /
membership for validity, the raw output stream for seamlessness.
"""

from __future__ import annotations

import signal

import msgpack
import pytest
import redis

from pagedq.client import Client, RequestFailedError, SamplingParams
from pagedq.client.protocol import E_INVALID_PARAMS, F_ID, F_PAYLOAD, Keys
from tests.engine.structured_cases import BOUNDED, CONSTRAINTS, build_random_model, is_valid
from tests.service.test_worker import running_worker
from tests.service.test_worker_procs import (
    assert_seamless,
    events,
    mid_job,
    spawn,
    stop,
    wait_until,
)

ENGINE = dict(num_kv_blocks=160, max_num_seqs=2, max_model_len=512)  # as spawn() starts A
# Long structures, so that a worker can be caught in the middle of one.
LONG_JSON = {"json": {"type": "object", "properties": {"xs": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 30, "maxItems": 30}}, "required": ["xs"]}}
LONG_REGEX = {"regex": "(yes|no)(, [0-9]{1,2}){30}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("random-smol-vocab")))


@pytest.fixture(scope="module")
def reference(model):
    from pagedq.worker import Engine

    engine = Engine(model, **ENGINE)
    return lambda prompt, params: [o.token_ids for o in engine.generate([prompt], params)[0].outputs]


def params(constraint: dict, seed: int, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 160)
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=constraint, **kw)


def test_queue_results_are_valid_and_bad_constraints_are_invalid_params(redis_db, redis_client,
                                                                        model, reference):
    jobs = [("Answer:", params(CONSTRAINTS[k], seed=i)) for i, k in enumerate(BOUNDED)]
    jobs.append(("Samples:", params(CONSTRAINTS["json_small"], seed=9, n=2)))
    bad = {"json": ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
           "regex": ({"regex": "a(b"}, "parenthesis"),
           "grammar": ({"grammar": "root ::= nowhere"}, "nowhere")}
    with running_worker(redis_db, model, "w1", engine=ENGINE), Client(redis_db) as client:
        handles = [client.submit(p, sp) for p, sp in jobs]
        failing = {k: client.submit("Answer:", SamplingParams(structured_outputs=c))
                   for k, (c, _) in bad.items()}
        raw = {"v": 1, "id": "empty-choice", "prompt_token_ids": [1, 2],
               "params": {"structured_outputs": {"choice": []}}}
        client._ensure_groups()
        redis_client.xadd(Keys().jobs("normal"), {F_ID: "empty-choice", F_PAYLOAD: msgpack.packb(raw)})
        for (prompt, sp), h in zip(jobs, handles, strict=True):
            res = h.result(timeout=120)
            assert [o.token_ids for o in res.outputs] == reference(prompt, sp)
            for o in res.outputs:
                assert o.finish_reason == "stop" and is_valid(sp.structured_outputs.to_dict(), o.text)
        for kind, h in failing.items():
            with pytest.raises(RequestFailedError) as info:
                h.result(timeout=60)
            assert info.value.code == E_INVALID_PARAMS and bad[kind][1] in info.value.reason
        with pytest.raises(RequestFailedError) as info:
            client.handle("empty-choice").result(timeout=30)
        assert info.value.code == E_INVALID_PARAMS and "non-empty list" in info.value.reason
        assert client.submit("Answer:", params(CONSTRAINTS["choice"], 3)).result(60).text in \
            CONSTRAINTS["choice"]["choice"]


def test_worker_killed_mid_structure_another_finishes_it_exactly(redis_url, model, reference,
                                                                 tmp_path):
    r = redis.Redis.from_url(redis_url)
    keys = Keys("structured-kill")
    for key in r.scan_iter("pagedq:*"):
        r.delete(key)
    a = spawn(redis_url, model, "A", "structured-kill", tmp_path)
    jobs = [(f"Record {i}:", params(LONG_JSON if i % 2 == 0 else LONG_REGEX, seed=40 + i,
                                    max_tokens=300)) for i in range(3)]
    try:
        wait_until(lambda: r.exists(keys.worker("A")), proc=a)
        with Client(redis_url, "structured-kill") as client:
            handles = [client.submit(p, sp) for p, sp in jobs]

            with running_worker(redis_url, model, "B", queue="structured-kill", engine=ENGINE):
                wait_until(mid_job(r, handles, "A"), proc=a)  # A is inside a structure
                a.send_signal(signal.SIGKILL)
                a.wait(30)
                results = [h.result(timeout=180) for h in handles]
        for (prompt, sp), h, res in zip(jobs, handles, results, strict=True):
            expected = reference(prompt, sp)
            assert [o.token_ids for o in res.outputs] == expected
            assert_seamless(events(r, h.id), expected)
            assert res.outputs[0].finish_reason == "stop"
            assert is_valid(sp.structured_outputs.to_dict(), res.outputs[0].text)
        writers = [{e.worker for e in events(r, h.id)} for h in handles]
        assert {"A", "B"} in writers  # a structure A had begun, B finished
    finally:
        stop(a)
        r.close()
