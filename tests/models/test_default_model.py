"""The bundled default model (SmolLM2-135M-Instruct) through the engine, against transformers.

The default engine runs the GGUF as shipped (Q4_1 projections, a Q8_0 embedding tied to the LM
head, kept packed). Its dequantized twin (``quantization="none"``: the same weights widened to
fp32) is checked token by token against transformers' own dequantization of the file;
tests/models/test_quant_fidelity.py checks the packed engine against the twin.
"""

from __future__ import annotations

import pytest

from pagedq.bench.fidelity import mean_matching_prefix
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


def test_a_batch_over_64_rows_follows_the_twin(engine, dequantized):
    """Steps of more than 64 rows (a long prompt's chunk, then 70 prompts decoding together)
    take the packed GEMM at this process's ISA level (tests/kernels/test_isa_levels.py runs this
    again at every lower level): every request finishes, and greedy output follows the
    dequantized twin to the 4-bit bar of test_quant_fidelity.py."""
    prompts = ["Summarize: " + " ".join(f"item {i} is {i * 7 % 13}" for i in range(40))]
    prompts += [f"Question {i}: what is {i} plus {i * 3}? Answer:" for i in range(69)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert len(engine.tokenizer(prompts[0]).input_ids) > 200
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in dequantized.generate(prompts, params)]
    assert all(len(ids) == 6 for ids in got)
    assert mean_matching_prefix(got, want) >= 0.8


def test_the_engine_hands_over_where_this_machine_measured(engine):
    """Without AMX the packed GEMM multiplies fp32 tiles, and an engine times where its GEMV
    stops winning, per format of the model, once per machine (kernels/crossover.py): the figures
    are kept in pagedq's cache and are the routes the engine runs."""
    from pagedq.kernels import crossover

    routes = {fmt: engine.backend.packed_for(fmt) for fmt in ("q4_1", "q8_0")}
    if not all(crossover.measures(r) for r in routes.values()):
        pytest.skip("bf16 tiles here (AMX): the table's crossovers are kept")
    kept = crossover.kept_for_this_cpu()  # these kernels' figures on this CPU, no stale ones
    level = engine.backend.cpu.level
    for fmt, route in routes.items():
        # keyed by the threads at the engine's start, which its thread governor changes since
        figures = {v for k, v in kept.items() if k.startswith(f"{level}|") and k.endswith(f"|int16|{fmt}")}
        assert route.gemv_rows in figures, (fmt, figures)
