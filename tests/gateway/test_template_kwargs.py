"""``chat_template_kwargs`` and templates that open ``<think>``, through the gateway with the
official openai client (``extra_body``, as it sends vLLM's fields), chat and batch lines.

The worker serves a random-weight Qwen3 (tests/tiny_models.py) with the bundled tokenizer and a
template that opens ``<think>`` in its generation prompt unless ``enable_thinking`` is false,
when it closes an empty block. Oracles: the prompt's token count from the same template
rendered here by jinja (so the kwargs reached the worker's render), the non-streamed answer
against the concatenated stream, jsonschema for every call that ends.
"""

from __future__ import annotations

import io
import json
import shutil

import jsonschema
import openai
import pytest

from pagedq.gateway.fleet import model_id
from pagedq.tools import ToolSpec
from pagedq.tools.prompt import render_chat
from tests.engine.structured_cases import load_bundled_tokenizer
from tests.gateway.harness import serve_worker
from tests.gateway.test_batches import jsonl, read_lines, wait_batch
from tests.gateway.test_tools import ASK, SCHEMAS, TOOLS
from tests.tools.test_thinking_prompt import OPENING_TEMPLATE, opening_qwen3

QUEUE = "gw-template-kwargs"
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_bundled_tokenizer()
    tok.chat_template = OPENING_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = opening_qwen3(tmp_path_factory.mktemp("random-qwen3-gw"), tokenizer)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def gw(redis_url, model_dir):
    with serve_worker(redis_url, str(model_dir), "kwargs-w", QUEUE) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client(gw):
    return gw.openai()


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_id(str(model_dir))


def prompt_tokens(tokenizer, kwargs=None) -> int:
    text = render_chat(tokenizer, ASK, ToolSpec(tools=TOOLS), kwargs)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def create(client, model, **kw):
    return client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                          tool_choice="required", temperature=1.0, **kw)


@pytest.mark.parametrize("seed", range(2))
def test_an_opened_prompt_answers_in_reasoning_content_streamed_and_not(client, model,
                                                                        tokenizer, seed):
    res = create(client, model, seed=seed, max_tokens=16)
    c = res.choices[0]
    assert res.usage.prompt_tokens == prompt_tokens(tokenizer)
    thought = c.message.model_extra["reasoning_content"]
    assert thought and c.message.model_extra["reasoning"] == thought
    assert c.finish_reason == "length" and not c.message.tool_calls
    streamed = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or ""
                       for ch in create(client, model, seed=seed, max_tokens=16, stream=True)
                       if ch.choices)
    assert streamed == thought


@pytest.mark.parametrize("seed", range(4))
def test_enable_thinking_false_reaches_the_template_and_calls_validate(client, model,
                                                                       tokenizer, seed):
    res = create(client, model, seed=seed, max_tokens=120,
                 extra_body={"chat_template_kwargs": OFF})
    assert res.usage.prompt_tokens == prompt_tokens(tokenizer, OFF) != prompt_tokens(tokenizer)
    c = res.choices[0]
    assert "reasoning_content" not in (c.message.model_extra or {})  # none expected
    if c.finish_reason == "length":
        return
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("bad, says", [
    ("off", "must be a map"), ([1, 2], "must be a map"), ({"tools": []}, "may not set"),
    ({"x" * 3: "y" * 9000}, "over the limit"), ({"1a": True}, "identifiers")])
def test_bad_kwargs_are_a_400_naming_the_field(client, model, bad, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                       extra_body={"chat_template_kwargs": bad})
    assert err.value.status_code == 400 and says in err.value.body["message"]
    assert err.value.body["param"] == "chat_template_kwargs"


def test_a_batch_line_takes_them_too(client, model, tokenizer):
    rows = [{"custom_id": f"k{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 8,
                      "tool_choice": "required", "seed": i, "temperature": 1.0,
                      **({"chat_template_kwargs": OFF} if i else {})}} for i in range(2)]
    f = client.files.create(file=("kw.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = wait_batch(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "completed"
    lines = {ln["custom_id"]: ln["response"]["body"] for ln in read_lines(
        client, batch.output_file_id)}
    assert lines["k0"]["usage"]["prompt_tokens"] == prompt_tokens(tokenizer)
    assert lines["k0"]["choices"][0]["message"]["reasoning_content"]
    assert lines["k1"]["usage"]["prompt_tokens"] == prompt_tokens(tokenizer, OFF)
    assert "reasoning_content" not in lines["k1"]["choices"][0]["message"]


def test_tokenize_renders_with_them(gw, model, tokenizer):
    body = {"model": model, "messages": ASK, "tools": TOOLS}
    with gw.http() as http:
        assert http.post("/tokenize", json=body).json()["count"] == prompt_tokens(tokenizer)
        off = http.post("/tokenize", json={**body, "chat_template_kwargs": OFF}).json()
        assert off["count"] == prompt_tokens(tokenizer, OFF)
        bad = http.post("/tokenize", json={**body, "chat_template_kwargs": {"tools": 1}})
        assert bad.status_code == 400 and "may not set" in bad.text
