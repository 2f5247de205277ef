"""A JSON ``number`` ends: its digits are bounded in the compiled grammar.

The grammar's language is checked with xgrammar's own matcher on strings built here (the
oracle is the count of digits); the engine's outputs with jsonschema, at temperature 0 and
0.8, on the random-weight model (it picks digits forever if the grammar lets it) and on the
bundled SmolLM2 (which wrote ``1.1111111...`` to ``max_tokens`` before the bound).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar

from pagedq.params import SamplingParams
from pagedq.worker import Engine
from pagedq.worker.engine.grammar_cache import json_ebnf
from pagedq.worker.engine.number_bounds import bound_numbers
from tests.engine.structured_cases import build_random_model

NUMBERS = {"type": "object",
           "properties": {"x": {"type": "number"}, "n": {"type": "integer"},
                          "pos": {"type": "number", "minimum": 0},
                          "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
                          "digits": {"type": "string", "pattern": "^[1-9][0-9]*$"}},
           "required": ["x", "n", "pos", "tags", "digits"]}


def accepts(schema: dict, text: str) -> bool:
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                strict_mode=True)
    bounded = xgrammar.Grammar.from_ebnf(json_ebnf(grammar))
    return xgrammar.testing._is_grammar_accept_string(bounded, text)


def doc(x="1.5", n="3", pos="2", tags="[]", digits='"7"') -> str:
    return f'{{"x": {x}, "n": {n}, "pos": {pos}, "tags": {tags}, "digits": {digits}}}'


@pytest.mark.parametrize("x, ok", [
    ("0", True), ("-0.5", True), ("123456789012345", True), ("1234567890123456", False),
    ("12345678901234.5", True), ("12345678901234.56", False), ("0.123456789012345", True),
    ("0.1234567890123456", False), ("1.5e308", True), ("-2E-12", True), ("1e1234", False),
    ("01", False), ("1.", False),
])
def test_a_free_number_has_at_most_15_significant_and_3_exponent_digits(x, ok):
    assert accepts(NUMBERS, doc(x=x)) is ok


@pytest.mark.parametrize("field, value, ok", [
    ("n", "-123456789012345", True), ("n", "1234567890123456", False),
    ("pos", "123456789012345", True), ("pos", "1234567890123456", False),
    ("tags", "[1, 2.5, 123456789012345]", True), ("tags", "[1234567890123456]", False),
])
def test_integers_half_bounded_ranges_and_arrays_are_bounded_too(field, value, ok):
    assert accepts(NUMBERS, doc(**{field: value})) is ok


def test_a_string_pattern_and_an_explicit_range_are_left_alone():
    assert accepts(NUMBERS, doc(digits='"123456789012345678901234567890"'))
    wide = {"type": "integer", "minimum": -10**17, "maximum": 10**17}
    assert accepts(wide, str(10**16 + 3))


def test_the_rewrite_touches_only_number_rules():
    text = str(xgrammar.Grammar.from_json_schema(json.dumps({"type": "string"})))
    assert bound_numbers(text).count("\n") == text.count("\n")
    assert "{1, -1}" not in bound_numbers(str(xgrammar.Grammar.builtin_json_grammar()))


# -- through the engine ----------------------------------------------------------------------
SCHEMAS = [{"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]},
           {"type": "object", "properties": {"count": {"type": "integer"},
                                             "price": {"type": "number"}},
            "required": ["count", "price"]}]


def run(engine: Engine, prompts: list, temperature: float) -> None:
    cases = [(schema, seed) for schema in SCHEMAS for seed in range(3)]
    plist = [SamplingParams(temperature=temperature, seed=seed, max_tokens=200,
                            structured_outputs={"json": schema}) for schema, seed in cases]
    outs = engine.generate([prompts[i % len(prompts)] for i in range(len(cases))], plist)
    for (schema, _), out in zip(cases, outs, strict=True):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_random_model_numbers_end(tmp_path_factory, temperature):
    path = build_random_model(tmp_path_factory.mktemp("random-numbers"))
    run(Engine(str(path), num_kv_blocks=512, block_size=4), ["Value:", "The number"], temperature)


@pytest.fixture(scope="module")
def smol():
    return Engine(num_kv_blocks=768, max_num_batched_tokens=256)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bundled_model_numbers_end(smol, temperature):
    prompts = [smol.apply_chat_template([{"role": "user", "content": q}]) for q in (
        "Give a number as JSON.", "What is pi? Answer in JSON.", "Price and count of apples, JSON.")]
    run(smol, prompts, temperature)
