"""The OpenAI API on the bundled model (SmolLM2-135M-Instruct), through the official openai
client: chat, streamed chat, completions, n=2, logprobs, usage, json_schema, a batch."""

from __future__ import annotations

import dataclasses
import io
import json

import openai
import pytest

from pagedq.params import SamplingParams
from pagedq.worker.models.default_model import DEFAULT_MODEL_NAME
from tests.gateway.harness import serve
from tests.gateway.test_batches import jsonl, read_lines, wait_batch
from tests.service.harness import running_worker

QUEUE = "gw-default"
ENGINE = dict(num_kv_blocks=256, max_num_seqs=4, max_model_len=512)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
HAS_STRUCTURED = "structured_outputs" in {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.fixture(scope="module")
def worker(redis_url):
    with running_worker(redis_url, None, "default-w", queue=QUEUE, engine=ENGINE) as w:
        yield w


@pytest.fixture(scope="module")
def client(redis_url, worker):
    with serve(redis_url, queue=QUEUE) as gw:
        yield gw.openai()


def test_models_lists_the_bundled_model(client):
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL_NAME]


def test_chat_answers_and_counts_usage_exactly(client, worker):
    res = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=FRANCE,
                                         max_tokens=24, temperature=0, logprobs=True)
    choice = res.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert res.id.startswith("chatcmpl-") and res.object == "chat.completion"
    prompt_ids = worker.engine.apply_chat_template(FRANCE)
    assert res.usage.prompt_tokens == len(prompt_ids)
    assert res.usage.completion_tokens == len(choice.logprobs.content)
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")


def test_streamed_deltas_concatenate_to_the_plain_answer(client):
    args = dict(model=DEFAULT_MODEL_NAME, messages=FRANCE, max_tokens=32, temperature=0)
    plain = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert {c.id for c in chunks} == {chunks[0].id}
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == plain.choices[0].finish_reason and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage


def test_completions_stream_and_not(client, worker):
    args = dict(model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=8,
                temperature=0)
    plain = client.completions.create(**args)
    assert plain.choices[0].text.strip().startswith("Paris")
    # the worker's tokenizer only (its engine belongs to its engine thread)
    assert plain.usage.prompt_tokens == len(worker.engine.tokenizer(args["prompt"]).input_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
    assert streamed == plain.choices[0].text
    echoed = client.completions.create(echo=True, **args)
    assert echoed.choices[0].text == args["prompt"] + plain.choices[0].text


def test_n2_seeded_samples_and_top_logprobs(client):
    res = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=FRANCE, n=2,
                                         max_tokens=8, temperature=1.0, seed=7, logprobs=True,
                                         top_logprobs=3)
    assert [c.index for c in res.choices] == [0, 1]
    assert res.choices[0].message.content != res.choices[1].message.content
    again = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=FRANCE, n=2,
                                           max_tokens=8, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in res.choices]
    assert res.usage.completion_tokens == sum(len(c.logprobs.content) for c in res.choices)
    for choice in res.choices:
        tokens = choice.logprobs.content
        assert "".join(t.token for t in tokens) == choice.message.content
        for t in tokens:
            tops = [x.logprob for x in t.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") == t.token
    greedy = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=FRANCE,
                                            max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=2)
    for t in greedy.choices[0].logprobs.content:  # greedy picks the most likely token
        assert t.logprob == t.top_logprobs[0].logprob and t.token == t.top_logprobs[0].token


@pytest.mark.skipif(not HAS_STRUCTURED, reason="SamplingParams has no structured_outputs field "
                    "yet (structured outputs are another issue); the mapping is unit-tested")
def test_json_schema_response_format(client):
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    res = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=FRANCE, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place",
                                                                "schema": schema}})
    assert res.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(res.choices[0].message.content), schema)


def test_batch_answers_equal_direct_requests(client):
    questions = ["What is the capital of France?", "Name a prime number."]
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": DEFAULT_MODEL_NAME, "max_tokens": 8, "temperature": 0,
                      "messages": [{"role": "user", "content": q}]}}
            for i, q in enumerate(questions)]
    f = client.files.create(file=("q.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = wait_batch(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id, 300)
    assert batch.status == "completed" and batch.request_counts.completed == 2
    out = read_lines(client, batch.output_file_id)
    for line, q in zip(out, questions, strict=True):
        direct = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": q}], max_tokens=8,
            temperature=0)
        body = line["response"]["body"]
        assert body["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert body["usage"] == direct.usage.model_dump(exclude_none=True)


def test_openai_errors_are_raised_by_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=FRANCE, top_p=0)
    assert err.value.body["param"] == "top_p"
