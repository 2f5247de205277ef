"""The bundled default model (SmolLM2-135M-Instruct) through the engine, against transformers."""

from __future__ import annotations

import pytest

from pagedq.client import SamplingParams
from pagedq.worker import Engine
from tests.oracle import assert_greedy


@pytest.fixture(scope="module")
def engine():
    return Engine(num_kv_blocks=256, max_num_batched_tokens=256)  # no model: the bundled one


def test_capital_of_france(engine):
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_greedy_matches_transformers(engine):
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village,"]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == engine.tokenizer(prompt).input_ids
        assert_greedy(engine.model_path, out.prompt_token_ids, out.outputs[0].token_ids)
        assert out.outputs[0].text == engine.tokenizer.decode(out.outputs[0].token_ids,
                                                              skip_special_tokens=True)
