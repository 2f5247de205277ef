"""Prompt logprobs through the gateway, the Batch API and the SDK, on the tiny model.

Oracle: transformers' forward pass over the prompt tokens the worker computes (the model's own
tokenizer and chat template): position i's logprob is the fp32 log_softmax of row i - 1.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from transformers import AutoTokenizer

from pagedq.client import Client
from pagedq.params import SamplingParams
from tests.gateway.harness import serve
from tests.gateway.test_batches import jsonl, read_lines, wait_batch
from tests.oracle import hf_logits

PROMPT = "The capital of France is Paris. The capital of Italy is"
CHAT = [{"role": "user", "content": "Hello there, how are you?"}]
TOL = 2e-3


@pytest.fixture(scope="module")
def gw(redis_url, queue, tiny_worker):
    with serve(redis_url, queue=queue) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def reference(model, ids: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    ref = torch.log_softmax(hf_logits(model, ids), dim=-1)
    return ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def assert_vllm_field(field, ids: list[int], model, k: int) -> None:
    """vLLM's prompt_logprobs: None, then {"<id>": {logprob, rank, decoded_token}} holding the
    prompt token (its logprob the oracle's) and k more at most."""
    assert len(field) == len(ids) and field[0] is None
    for i, (entry, want) in enumerate(zip(field[1:], reference(model, ids), strict=True), 1):
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(want, abs=TOL)
        assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        assert len(entry) <= k + 1
        assert sorted(v["rank"] for v in entry.values() if v["rank"] <= k) == list(
            range(1, k + 1))  # the top-k, the prompt token among them or beside them


def test_completions_echo_with_logprobs_leads_with_the_prompt(gw, tiny_id, tiny_model, tok):
    ids = tok(PROMPT).input_ids
    body = {"model": tiny_id, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "echo": True, "logprobs": 2}
    with gw.http() as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        chunks = []
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(reference(tiny_model, ids), abs=TOL)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for i in range(1, len(ids)):  # top-2 plus the prompt token itself
        assert 1 <= len(lp["top_logprobs"][i]) <= 3
    assert "prompt_logprobs" not in choice  # only when asked by name (vLLM's field)
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == choice["text"]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][:len(ids)] == lp["token_logprobs"][:len(ids)]


def test_chat_prompt_logprobs_field_streamed_and_not(gw, tiny_id, tiny_model, tiny_worker):
    ids = tiny_worker.engine.apply_chat_template(CHAT)
    body = {"model": tiny_id, "messages": CHAT, "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 3}
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert_vllm_field(r.json()["prompt_logprobs"], ids, tiny_model, 3)
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
    carrying = [c for c in chunks if "prompt_logprobs" in c]
    assert len(carrying) == 1
    assert carrying[0]["prompt_logprobs"] == r.json()["prompt_logprobs"]
    with gw.http() as http:
        bad = http.post("/v1/chat/completions", json={**body, "prompt_logprobs": 99})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_completions_prompt_logprobs_field_and_batch_lines(gw, tiny_id, tiny_model, tok):
    ids = tok(PROMPT).input_ids
    body = {"model": tiny_id, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 0}
    with gw.http() as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert_vllm_field(choice["prompt_logprobs"], ids, tiny_model, 0)
    assert choice["logprobs"] is None
    client = gw.openai()
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line]))), purpose="batch")
    batch = wait_batch(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id)
    (out,) = read_lines(client, batch.output_file_id)
    got = out["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert got == choice["prompt_logprobs"]


def test_sdk_result_carries_them(redis_url, queue, tiny_worker, tiny_model, tok):
    ids = tok(PROMPT).input_ids
    with Client(redis_url, queue=queue) as client:
        res = client.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2,
                                                       prompt_logprobs=1))[0]
    plp = res.prompt_logprobs
    assert plp.token_ids == ids and plp.logprobs[0] is None
    assert plp.logprobs[1:] == pytest.approx(reference(tiny_model, ids), abs=TOL)
    assert all(len(t) == 1 for t in plp.top[1:])
