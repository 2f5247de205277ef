"""The bundled default model (SmolLM2-135M-Instruct) through the engine, against transformers.

The default engine runs the GGUF as shipped (Q4_1 projections, a Q8_0 embedding tied to the LM
head, kept packed). Its dequantized twin (``quantization="none"``: the same weights widened to
fp32) is checked token by token against transformers' own dequantization of the file; the
packed engine is checked against the twin (tests/models/test_quant_fidelity.py measures more).
"""

from __future__ import annotations

import pytest

from pagedq.client import SamplingParams
from pagedq.worker import Engine
from tests.oracle import assert_greedy

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine(num_kv_blocks=256, max_num_batched_tokens=256)  # no model: the bundled one


@pytest.fixture(scope="module")
def dequantized():
    return Engine(num_kv_blocks=256, max_num_batched_tokens=256, quantization="none")


def test_capital_of_france(engine):
    out = engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_the_default_keeps_the_file_packed(engine):
    size = engine.model_path.joinpath("pagedq_converted.json").read_text()
    assert '"packed": true' in size
    file_bytes = __import__("json").loads(size)["size"]
    assert engine.stats()["weight_bytes"] <= 1.1 * file_bytes


def test_greedy_matches_transformers(dequantized):
    outs = dequantized.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == dequantized.tokenizer(prompt).input_ids
        assert_greedy(dequantized.model_path, out.prompt_token_ids, out.outputs[0].token_ids)
        assert out.outputs[0].text == dequantized.tokenizer.decode(out.outputs[0].token_ids,
                                                                   skip_special_tokens=True)


def test_packed_follows_the_dequantized_model(engine, dequantized):
    """The packed kernels round activations to int8 per 32 values (as llama.cpp does), so
    greedy paths may part at a near-tie; on average they share most of their tokens."""
    packed = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
    widened = [o.outputs[0].token_ids for o in dequantized.generate(PROMPTS, GREEDY)]
    prefixes = [next((i for i, (a, b) in enumerate(zip(p, w, strict=True)) if a != b), len(p))
                / len(p) for p, w in zip(packed, widened, strict=True)]
    assert sum(prefixes) / len(prefixes) >= 0.8, prefixes
