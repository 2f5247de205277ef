"""The wire protocol: payload round trips, validation, key schema, and torch-free imports."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedq.client import SamplingParams
from pagedq.client.protocol import (
    E_INVALID_PARAMS,
    E_INVALID_REQUEST,
    E_UNSUPPORTED_VERSION,
    F_EVENT,
    F_ID,
    F_PAYLOAD,
    F_SEQ,
    FINISHED,
    PROTOCOL_VERSION,
    TOKENS,
    Event,
    Keys,
    ProtocolError,
    build_request,
    check_request_id,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
    engine_id,
    job_fields,
    priority_level,
)


def test_client_import_never_imports_torch():
    code = (
        "import sys, pagedq.client, pagedq.client.aio, pagedq.client.protocol\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'triton') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("prompt,field", [
    ("Hello there", "prompt"),
    ([1, 5, 9], "prompt_token_ids"),
    ([{"role": "user", "content": "hi"}], "messages"),
])
def test_request_round_trip(prompt, field):
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, max_tokens=9, stop=["x"])
    req = build_request(prompt, params, deadline=1e10, priority=2, metadata={"k": [1, "v"]})
    back = decode_request(encode_request(req))
    assert back == req
    assert getattr(back, field) == prompt
    assert back.level == "high"
    raw = msgpack.unpackb(encode_request(req))
    assert raw["v"] == PROTOCOL_VERSION and raw["id"] == req.id


def test_job_fields_carry_id_outside_payload():
    req = build_request([3, 4], request_id="abc-1")
    fields = job_fields(req)
    assert fields[F_ID] == b"abc-1"
    assert decode_request(fields[F_PAYLOAD]).id == "abc-1"


def _payload(**over):
    body = {"v": PROTOCOL_VERSION, "id": "r1", "prompt_token_ids": [1, 2], "params": {}}
    body.update(over)
    return msgpack.packb({k: v for k, v in body.items() if v is not ...})


@pytest.mark.parametrize("over,code", [
    ({"v": 99}, E_UNSUPPORTED_VERSION),
    ({"v": ...}, E_UNSUPPORTED_VERSION),
    ({"params": {"temperature": -1}}, E_INVALID_PARAMS),
    ({"params": {"tempurature": 1}}, E_INVALID_PARAMS),
    ({"params": {"stop": 5}}, E_INVALID_PARAMS),
    ({"prompt_token_ids": []}, E_INVALID_REQUEST),
    ({"prompt_token_ids": ..., "prompt": ""}, E_INVALID_REQUEST),
    ({"prompt_token_ids": [1, -2]}, E_INVALID_REQUEST),
    ({"prompt": "both"}, E_INVALID_REQUEST),
    ({"deadline": "soon"}, E_INVALID_REQUEST),
    ({"priority": 1.5}, E_INVALID_REQUEST),
    ({"prompt_token_ids": ..., "messages": [{"role": "user"}]}, E_INVALID_REQUEST),
])
def test_bad_payloads_name_the_request(over, code):
    with pytest.raises(ProtocolError) as info:
        decode_request(_payload(**over))
    assert info.value.code == code
    assert info.value.request_id == "r1"
    assert str(info.value)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"not msgpack at all \xff", msgpack.packb([1, 2]),
                                  msgpack.packb({"v": 1, "id": "bad id!"}), "str", None])
def test_undecodable_payloads_raise_protocol_error(data):
    with pytest.raises(ProtocolError) as info:
        decode_request(data)
    assert info.value.request_id is None


_ints = st.integers(-(2**63), 2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200) | st.builds(
    lambda d: msgpack.packb(d),
    st.dictionaries(st.sampled_from(["v", "id", "prompt", "prompt_token_ids", "params", "deadline",
                                     "priority", "messages", "metadata", "created"]),
                    st.none() | _ints | st.floats() | st.text(max_size=8)
                    | st.lists(_ints, max_size=4)
                    | st.dictionaries(st.text(max_size=12), _ints | st.floats()
                                      | st.text(max_size=4), max_size=3)),
))
def test_decode_request_fuzz_raises_only_protocol_error(data):
    try:
        req = decode_request(data, entry_id_hint="hint-1")
    except ProtocolError as exc:
        assert exc.request_id in (None, "hint-1") or isinstance(exc.request_id, str)
    else:
        assert decode_request(encode_request(req)) == req


def test_event_round_trip_and_defaults_omitted():
    ev = Event(type=TOKENS, request_id="r", index=1, token_ids=[4, 5], text="ab", position=7,
               logprobs=[{4: -0.1}, {5: -0.2}])
    blob = encode_event(ev)
    assert "error" not in msgpack.unpackb(blob)
    back = decode_event({F_SEQ: b"3", F_EVENT: blob}, b"1-0")
    assert (back.seq, back.entry_id, back.token_ids, back.position, back.index) == (3, "1-0",
                                                                                   [4, 5], 7, 1)
    assert back.logprobs == [{4: -0.1}, {5: -0.2}]
    term = decode_event({F_SEQ: b"4", F_EVENT: encode_event(
        Event(type=FINISHED, request_id="r", finish_reasons=["stop"], usage={"prompt_tokens": 2})
    )})
    assert term.terminal and term.finish_reasons == ["stop"]


def test_keys_schema_uses_hash_tags_and_levels():
    k = Keys("q1", "pq")
    assert k.all_jobs() == ["pq:q1:jobs:high", "pq:q1:jobs:normal", "pq:q1:jobs:low"]
    assert k.out("abc") == "pq:req:{abc}:out" and k.state("abc") == "pq:req:{abc}:state"
    assert k.worker("w1") == "pq:q1:worker:w1"
    assert [priority_level(p) for p in (5, 0, -3)] == ["high", "normal", "low"]


def test_lock_key_and_engine_ids():
    k = Keys("q1", "pq")
    assert k.lock("w1") == "pq:q1:lock:w1" and k.cancels == "pq:q1:cancels"
    assert engine_id("abc-1", 3) == "abc-1#3"
    with pytest.raises(ProtocolError):  # "#" never appears in a request id: the split is safe
        check_request_id("a#1")
