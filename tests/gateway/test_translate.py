"""OpenAI bodies -> pagedq jobs, and events -> OpenAI JSON, without a server.

The oracle for parameter validation is SamplingParams itself: the gateway must give the same
verdict (and message) the engine would.
"""

from __future__ import annotations

import dataclasses

import pytest

from pagedq.client import Event
from pagedq.gateway.api_errors import APIError
from pagedq.gateway.lines import parse_line
from pagedq.gateway.openai import ChatCompletionRequest, CompletionRequest
from pagedq.gateway.render import ChunkRenderer, Logprobs
from pagedq.gateway.translate import CHAT, View, chat_spec, completion_spec
from pagedq.params import SamplingParams

HAS_STRUCTURED = "structured_outputs" in {f.name for f in dataclasses.fields(SamplingParams)}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_chat_fields_map_onto_sampling_params():
    spec = chat_spec(chat(n=2, temperature=0.5, top_p=0.9, max_completion_tokens=7, stop="x",
                          seed=3, presence_penalty=0.1, frequency_penalty=-0.2, logprobs=True,
                          top_logprobs=3, top_k=5, min_p=0.1, repetition_penalty=1.1,
                          ignore_eos=True, min_tokens=2, priority=4, stream=True,
                          stream_options={"include_usage": True}))
    assert spec.params == SamplingParams(
        n=2, temperature=0.5, top_p=0.9, max_tokens=7, stop=["x"], seed=3, presence_penalty=0.1,
        frequency_penalty=-0.2, logprobs=3, top_k=5, min_p=0.1, repetition_penalty=1.1,
        ignore_eos=True, min_tokens=2)
    assert spec.priority == -4  # vLLM runs lower priority values first; pagedq higher ones
    assert spec.view.include_usage and spec.view.logprobs == 3 and spec.stream
    assert spec.prompts == [[{"role": "user", "content": "hi"}]]
    assert spec.id.startswith("chatcmpl-") and spec.job_ids == [spec.id]


def test_max_completion_tokens_wins_and_chat_defaults_to_the_model_length():
    assert chat_spec(chat(max_tokens=5, max_completion_tokens=9)).params.max_tokens == 9
    assert chat_spec(chat()).params.max_tokens is None
    assert completion_spec(CompletionRequest(model="m", prompt="a")).params.max_tokens == 16


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("n", 0),
                                         ("presence_penalty", 3.0), ("top_logprobs", 21)])
def test_invalid_values_get_the_engines_message(field, value):
    body = {field: value, **({"logprobs": True} if field == "top_logprobs" else {})}
    with pytest.raises(APIError) as err:
        chat_spec(chat(**body))
    name = "logprobs" if field == "top_logprobs" else field
    with pytest.raises(Exception) as engine:
        SamplingParams(**{name: value})
    assert err.value.status == 400 and err.value.message == str(engine.value)
    assert err.value.param == name and err.value.code == "invalid_params"


def test_unsupported_fields_are_refused_not_ignored():
    for body in ({"top_logprobs": 2},):
        with pytest.raises(APIError):
            chat_spec(chat(**body))
    with pytest.raises(APIError):
        completion_spec(CompletionRequest(model="m", prompt=["a", "b"], stream=True))


def test_content_parts_become_text_and_multi_prompt_completions_are_one_job_each():
    spec = chat_spec(chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]))
    assert spec.prompts == [[{"role": "user", "content": "a\nb"}]]
    spec = completion_spec(CompletionRequest(model="m", prompt=["x", "y"], n=2))
    assert spec.prompts == ["x", "y"] and spec.job_ids == [f"{spec.id}-0", f"{spec.id}-1"]
    assert completion_spec(CompletionRequest(model="m", prompt=[5, 6])).prompts == [[5, 6]]


def test_response_format_maps_onto_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [({"response_format": {"type": "json_object"}}, {"json_object": True}),
             ({"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema}}},
              {"json": schema}),
             ({"guided_regex": "a+"}, {"regex": "a+"}),
             ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]})]
    from pagedq.gateway.translate import structured_outputs

    for body, want in cases:
        assert structured_outputs(chat(**body)) == want
    with pytest.raises(APIError):
        structured_outputs(chat(guided_regex="a", response_format={"type": "json_object"}))
    if not HAS_STRUCTURED:  # until SamplingParams takes the field, the engine's refusal is a 400
        with pytest.raises(APIError) as err:
            chat_spec(chat(response_format={"type": "json_object"}))
        assert "structured_outputs" in err.value.message


def test_the_terminal_event_adds_missing_finish_reasons_then_usage():
    view = View(CHAT, "m", 1, n=2, include_usage=True)
    events = [Event("tokens", "r", seq=1, index=0, token_ids=[1], text="a", position=1),
              Event("tokens", "r", seq=2, index=1, token_ids=[2], text="b", position=1,
                    finish_reason="length"),
              Event("finished", "r", seq=3, finish_reasons=["deadline", "length"],
                    usage={"prompt_tokens": 4, "completion_tokens": 2})]
    r = ChunkRenderer(view, "r", str)
    chunks = [r.on_event(ev) for ev in events]
    assert [len(c) for c in chunks] == [1, 1, 2]
    assert chunks[2][0]["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "length"}]
    assert chunks[2][1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2,
                                     "total_tokens": 6}


def test_logprobs_shapes():
    lp = Logprobs(1, lambda t: f"<{t}>")
    out = lp.chat([7], [{3: -0.1, 7: -2.0}])["content"][0]
    assert out == {"token": "<7>", "logprob": -2.0, "bytes": list(b"<7>"),
                   "top_logprobs": [{"token": "<3>", "logprob": -0.1, "bytes": list(b"<3>")}]}
    comp, end = lp.completion([7, 3], [{3: -0.1, 7: -2.0}, {3: -0.5}], 2)
    assert comp["tokens"] == ["<7>", "<3>"] and comp["text_offset"] == [2, 5] and end == 8
    assert comp["top_logprobs"][0] == {"<3>": -0.1, "<7>": -2.0}


def test_a_malformed_batch_line_fails_alone():
    good = ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
            '"body": {"model": "m", "prompt": "x"}}')
    assert parse_line(good, 0, "/v1/completions", "b-0").spec is not None
    for bad, code in [("{not json", "invalid_json_line"), ("[1]", "invalid_json_line"),
                      (good.replace('"a"', "1"), "missing_custom_id"),
                      (good.replace("/v1/completions", "/v1/embeddings"), "mismatched_url"),
                      (good.replace('"prompt": "x"', '"prompt": "x", "temperature": -1'),
                       "invalid_params")]:
        line = parse_line(bad, 3, "/v1/completions", "b-3")
        assert line.spec is None and line.error is not None and line.error.code == code, bad
