"""``/tokenize`` and ``/detokenize`` (vLLM's shapes) and ``logit_bias`` through the gateway.

Oracle: the model's own transformers tokenizer and chat template; for logit_bias, the tokens
a +100 bias forces and the token ids the answer's logprobs report.
"""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from tests.gateway.harness import serve

CHAT = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def gw(redis_url, queue, tiny_worker):
    with serve(redis_url, queue=queue) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_tokenize_a_prompt_and_back(gw, tiny_id, tok):
    with gw.http() as http:
        r = http.post("/tokenize", json={"model": tiny_id, "prompt": "The capital of France",
                                         "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        ids = tok("The capital of France").input_ids
        assert body["tokens"] == ids and body["count"] == len(ids)
        assert body["token_strs"] == tok.convert_ids_to_tokens(ids)
        assert isinstance(body["max_model_len"], int)
        back = http.post("/detokenize", json={"model": tiny_id, "tokens": ids}).json()
        assert back == {"prompt": tok.decode(ids)}


def test_tokenize_chat_messages_counts_what_the_worker_sends(gw, tiny_id, tok, tiny_worker):
    with gw.http() as http:
        body = http.post("/tokenize", json={"model": tiny_id, "messages": CHAT}).json()
    assert body["tokens"] == tiny_worker.engine.apply_chat_template(CHAT)
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert body["tokens"] == tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("path, body, status", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400),
    ("/tokenize", {}, 400),
    ("/detokenize", {"tokens": [10**9]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
])
def test_bad_tokenize_requests_are_400s(gw, tiny_id, path, body, status):
    with gw.http() as http:
        assert http.post(path, json={"model": tiny_id, **body}).status_code == status
        assert http.post(path, json={"model": "nope", "prompt": "a", "tokens": []}
                         ).status_code == 404


def test_logit_bias_forces_a_token(gw, tiny_id, tok):
    client = gw.openai()
    res = client.completions.create(model=tiny_id, prompt="Hello", max_tokens=4, temperature=0,
                                    logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert res.choices[0].text == tok.decode([42] * 4)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.chat.completions.create(model=tiny_id, messages=CHAT, max_tokens=2,
                                       logit_bias={str(10**6): 1})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=tiny_id, messages=CHAT, max_tokens=2,
                                       logit_bias={"1": 101})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=tiny_id, messages=CHAT, max_tokens=2,
                                       logit_bias={"x": 1})
