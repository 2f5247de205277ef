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
    Limits,
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
    request_digest,
)
from pagedq.errors import InvalidParamsError


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


@pytest.mark.parametrize("data", [b"\xc1\xff", b"", None, "str", b"\x93\x01"])
def test_an_undecodable_payload_under_a_valid_entry_id_names_that_id(data):
    """Bug: XADD jobs * id req1 p "\xc1\xff" got no error event (the id was dropped)."""
    with pytest.raises(ProtocolError) as info:
        decode_request(data, entry_id_hint="req1")
    assert info.value.request_id == "req1" and str(info.value)


@pytest.mark.parametrize("hint", ["x bad hint!", "a}b", "{x}", "", "z" * 129])
def test_an_invalid_entry_id_is_never_named(hint):
    """Bug: a non-map payload wrote events under the entry's unvalidated id ("x bad hint!")."""
    for data in (msgpack.packb([1, 2]), b"\xc1", msgpack.packb({"v": 1})):
        with pytest.raises(ProtocolError) as info:
            decode_request(data, entry_id_hint=hint)
        assert info.value.request_id is None


def test_the_entry_id_and_the_payload_id_must_agree():
    with pytest.raises(ProtocolError) as info:
        decode_request(_payload(), entry_id_hint="other")
    assert info.value.request_id == "other" and info.value.code == E_INVALID_REQUEST


@pytest.mark.parametrize("params", [{"n": 17}, {"n": 10**12}, {"n": 2**63}, {"logprobs": 21},
                                    {"logprobs": 10**6}, {"stop": ["s"] * 17},
                                    {"stop": ["x" * 257]}, {"stop_token_ids": list(range(17))},
                                    {"top_k": 2**40}, {"max_tokens": 10**12},
                                    {"stop_token_ids": [-1]}, {"min_tokens": 2**63}])
def test_limits_answer_invalid_params_before_anything_is_allocated(params):
    with pytest.raises(ProtocolError) as info:
        decode_request(_payload(params=params))
    assert info.value.code == E_INVALID_PARAMS and info.value.request_id == "r1"
    with pytest.raises(InvalidParamsError):  # the SDK refuses them before enqueueing
        build_request([1], SamplingParams.from_dict(params))


def test_a_worker_limit_can_be_raised_and_the_payload_size_is_bounded():
    many = Limits(max_n=64)
    assert decode_request(_payload(params={"n": 40}), limits=many).params.n == 40
    big = _payload(prompt_token_ids=list(range(1000)))
    with pytest.raises(ProtocolError) as info:
        decode_request(big, "r1", Limits(max_request_bytes=len(big) - 1))
    assert info.value.code == E_INVALID_REQUEST and info.value.request_id == "r1"
    with pytest.raises(ProtocolError):
        build_request("x" * 2_000_000)


def test_digest_ignores_what_a_retry_changes_and_sees_what_makes_another_job():
    params = SamplingParams(temperature=0.5, seed=3)
    a = build_request([1, 2], params, request_id="r", deadline=1e10, metadata={"try": 1})
    b = build_request([1, 2], SamplingParams(temperature=0.5, seed=3), request_id="r",
                      deadline=2e10, priority=4, metadata={"try": 2})
    assert a.created <= b.created and request_digest(a) == request_digest(b)
    assert request_digest(a) == request_digest(decode_request(encode_request(a)))
    for other in (build_request([1, 3], params), build_request("12", params),
                  build_request([1, 2], SamplingParams(temperature=0.5, seed=4))):
        assert request_digest(other) != request_digest(a)


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


def test_keys_schema_puts_a_queue_in_one_slot():
    k = Keys("q1", "pq")
    assert k.all_jobs() == ["pq:{q1}:jobs:high", "pq:{q1}:jobs:normal", "pq:{q1}:jobs:low"]
    assert k.out("abc") == "pq:{q1}:req:abc:out" and k.state("abc") == "pq:{q1}:req:abc:state"
    assert k.worker("w1") == "pq:{q1}:worker:w1" and k.dead == "pq:{q1}:dead"
    assert [priority_level(p) for p in (5, 0, -3)] == ["high", "normal", "low"]
    for bad in ("", "a}b", "x{", "with space", "q" * 65):  # they would break the hash tag
        with pytest.raises(ValueError):
            Keys(bad)
        with pytest.raises(ValueError):
            Keys("q", bad)


def test_lock_key_and_engine_ids():
    k = Keys("q1", "pq")
    assert k.lock("w1") == "pq:{q1}:lock:w1" and k.cancels == "pq:{q1}:cancels"
    assert engine_id("abc-1", 3) == "abc-1#3"
    with pytest.raises(ProtocolError):  # "#" never appears in a request id: the split is safe
        check_request_id("a#1")


def test_chat_template_kwargs_travel_with_messages_only_and_are_checked():
    msgs = [{"role": "user", "content": "hi"}]
    req = build_request(msgs, request_id="r1", chat_template_kwargs={"enable_thinking": False})
    back = decode_request(encode_request(req))
    assert back.chat_template_kwargs == {"enable_thinking": False} and back.messages == msgs
    plain = build_request(msgs, request_id="r1")
    assert "chat_template_kwargs" not in msgpack.unpackb(encode_request(plain))  # older workers
    assert decode_request(encode_request(plain)).chat_template_kwargs is None
    assert request_digest(req) != request_digest(plain)  # another job, not a retry
    for bad, says in (({"tools": []}, "may not set"), ("off", "must be a map"),
                      ({"1": 1}, "identifiers")):
        with pytest.raises(ProtocolError, match=says):
            build_request(msgs, chat_template_kwargs=bad)
    with pytest.raises(ProtocolError, match="chat messages only"):
        build_request("text", chat_template_kwargs={"enable_thinking": False})
