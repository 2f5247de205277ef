"""Structured outputs through the Engine: valid every time, and correct beside everything else.

Two models: a random-weight Llama that uses the bundled tokenizer (it picks garbage, so only
the constraint can make its output valid) at temperature 1.0 with several seeds, and the bundled
SmolLM2 on real extraction prompts. Every finished output is checked by an independent oracle.
"""

from __future__ import annotations

import json
import threading

import pytest

from pagedq.errors import InvalidParamsError
from pagedq.params import SamplingParams, StructuredOutputsParams
from pagedq.worker import Engine
from pagedq.worker.engine import grammar_cache
from pagedq.worker.engine.beam_search import BeamParams, BeamSearch
from tests.engine.structured_cases import (
    BOUNDED,
    CONSTRAINTS,
    PERSON,
    build_random_model,
    is_valid,
)
from tests.oracle import hf_logits

PROMPTS = ["Fill in the form:", "Answer:", "The result is", "Output"]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("random-smol-vocab"))


def make_engine(path, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 512)
    kw.setdefault("block_size", 4)
    return Engine(str(path), **kw)


@pytest.fixture(scope="module")
def engine(random_model):
    return make_engine(random_model)


def params(kind: str, seed: int | None = 0, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 96)
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=CONSTRAINTS[kind], **kw)


def assert_valid(kind: str, out) -> None:
    assert out.finish_reason == "stop", (kind, out.text)
    assert is_valid(CONSTRAINTS[kind], out.text), (kind, out.text)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_model_is_valid_in_a_mixed_batch(engine, seed):
    """Every bounded kind, two prompts each, beside unconstrained rows, in one batch. The
    unconstrained rows give exactly the tokens they give alone."""
    kinds = [k for k in BOUNDED for _ in range(2)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))] + PROMPTS[:2]
    free = SamplingParams(temperature=1.0, seed=seed + 100, max_tokens=24)
    plist = [params(k, seed=seed * 10 + i) for i, k in enumerate(kinds)] + [free, free]
    outs = engine.generate(prompts, plist)
    for kind, out in zip(kinds, outs, strict=False):
        assert_valid(kind, out.outputs[0])
    alone = engine.generate(PROMPTS[:2], free)
    for a, b in zip(alone, outs[len(kinds):], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_seeded_constrained_tokens_do_not_depend_on_batch_mates(engine):
    p = params("json_small", seed=7)
    alone = engine.generate(["Fill in the form:"], p)[0].outputs[0]
    crowd = engine.generate(["Fill in the form:"] + PROMPTS[:2],
                            [p, params("regex", seed=1), params("choice", seed=2)])
    assert crowd[0].outputs[0].token_ids == alone.token_ids
    assert_valid("json_small", alone)


def test_n_samples_each_follow_the_constraint(engine):
    out = engine.generate(["Fill in the form:"], params("json_small", seed=3, n=4))[0]
    assert len(out.outputs) == 4
    for o in out.outputs:
        assert_valid("json_small", o)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_unseeded_sampling_is_valid_too(engine):
    kinds = ("json_small", "grammar")
    outs = engine.generate(PROMPTS[:2], [params(k, seed=None) for k in kinds])
    for kind, out in zip(kinds, outs, strict=True):
        assert_valid(kind, out.outputs[0])


def test_chunked_prefill_preemption_and_prefix_cache_change_nothing(random_model, engine):
    """Long prompts in small chunks, a KV cache so small that sequences are preempted and
    recomputed, and a shared prefix: same seeded tokens as a roomy engine, all valid."""
    long_prompt = "Fill in the form for this record, please. " * 6
    prompts = [long_prompt + suffix for suffix in ("A", "B", "C", "D")]
    plist = [params("json_small", seed=20 + i) for i in range(4)]
    roomy = engine.generate(prompts, plist)
    tight = make_engine(random_model, num_kv_blocks=60, max_num_batched_tokens=16)
    outs = tight.generate(prompts, plist)
    assert tight.stats()["preemptions"] > 0
    assert tight.stats()["prefix_cache_hits"] > 0
    for a, b in zip(roomy, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert_valid("json_small", b.outputs[0])


def test_resume_on_another_engine_continues_exactly(random_model, engine):
    """A fresh engine (another worker) replays the 6 tokens already streamed into a fresh
    matcher and continues to the same tokens."""
    p = params("json_small", seed=5)
    whole = engine.generate(["Fill in the form:"], p)[0].outputs[0].token_ids
    other = make_engine(random_model)
    req = other.add_request("resumed", "Fill in the form:", p, resume=[whole[:6]])
    while other.has_unfinished_requests():
        other.step()
    assert req.seqs[0].output_token_ids == whole


def test_max_tokens_mid_structure_is_length_and_partial(engine):
    out = engine.generate(["Fill in the form:"], params("json_small", max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5 and not is_valid(CONSTRAINTS["json_small"], out.text)


def test_stop_string_cuts_the_structure(engine):
    p = params("json_small", seed=1, stop=['"n"'])
    out = engine.generate(["Fill in the form:"], p)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.startswith('{"ok": ')
    assert '"n"' not in out.text


def test_ignore_eos_and_min_tokens_end_when_the_grammar_is_complete(engine):
    for extra in ({"ignore_eos": True}, {"min_tokens": 90}):
        out = engine.generate(["Answer:"], params("choice", **extra))[0].outputs[0]
        assert_valid("choice", out)


def test_logprobs_come_from_the_model_before_the_mask(random_model, engine):
    p = SamplingParams(temperature=0.0, logprobs=1, max_tokens=8,
                       structured_outputs={"choice": ["positive", "negative"]})
    out = engine.generate(["Answer:"], p)[0]
    o = out.outputs[0]
    assert o.text in ("positive", "negative")
    ref = hf_logits(random_model, out.prompt_token_ids + o.token_ids).log_softmax(-1)
    start = len(out.prompt_token_ids) - 1
    for i, (token, top) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
        assert top[token] == pytest.approx(float(ref[start + i, token]), abs=1e-3)
        best = int(ref[start + i].argmax())  # the model's own favourite, masked or not
        assert top[best] == pytest.approx(float(ref[start + i, best]), abs=1e-3)


@pytest.mark.parametrize("constraint, problem", [
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"regex": "a(b"}, "parenthesis"),
    ({"grammar": "root ::= nowhere"}, "nowhere"),
])
def test_bad_constraints_fail_alone_and_the_engine_goes_on(engine, constraint, problem):
    """The step API: the bad request is rejected once its compile fails (take_rejected), its
    batch mate finishes. Then the verdict is cached: generate raises at once."""
    bad = SamplingParams(structured_outputs=constraint)
    rejected = []
    try:
        engine.add_request("bad", "Answer:", bad)
    except InvalidParamsError as exc:  # the compile's verdict came before add_request returned
        rejected.append(("bad", exc))
    good = engine.add_request("good", "Answer:", params("choice"))
    while engine.has_unfinished_requests():
        engine.step()
        rejected += engine.take_rejected()
    assert [(rid, type(exc)) for rid, exc in rejected] == [("bad", InvalidParamsError)]
    assert problem in str(rejected[0][1])
    assert good.seqs[0].finish_reason == "stop"
    assert engine.stats()["running"] == 0 and not engine.requests
    with pytest.raises(InvalidParamsError, match=problem):
        engine.generate(["Answer:"], bad)


def test_compile_past_the_time_limit_is_invalid_params(random_model):
    slow = make_engine(random_model, grammar_compile_timeout=0.05)
    with pytest.raises(InvalidParamsError, match="longer than 0.05 s"):
        slow.generate(["Answer:"], SamplingParams(structured_outputs={"regex": "[a-z ]{1,3000}"}))


def test_a_compiling_request_never_stalls_the_others(engine, monkeypatch):
    """The compile is held at a gate: unconstrained requests run to the end meanwhile; the
    constrained one starts once the gate opens."""
    gate = threading.Event()
    compile_one = grammar_cache._Compiler.compile

    def gated(self, kind, spec, *rest):
        gate.wait(30)
        return compile_one(self, kind, spec, *rest)

    monkeypatch.setattr(grammar_cache._Compiler, "compile", gated)
    waiting = engine.add_request("held", "Answer:",
                                 SamplingParams(structured_outputs={"choice": ["held!"]}))
    free = engine.add_request("free", "Answer:", SamplingParams(max_tokens=12, seed=1))
    while not free.seqs[0].is_finished:
        engine.step()
    assert engine.stats()["grammar_compiling"] == 1 and waiting.seqs[0].num_generated == 0
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert waiting.seqs[0].text == "held!" and waiting.seqs[0].finish_reason == "stop"


def test_beam_search_with_a_constraint_is_rejected(engine):
    with pytest.raises(InvalidParamsError, match="beam search"):
        engine.add_request("beam", "Answer:", params("choice"),
                           hook=BeamSearch(engine, BeamParams(beam_width=2)))
    assert not engine.requests


# -- the bundled model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    return Engine(num_kv_blocks=768, max_num_batched_tokens=256)


EXTRACT = ("Extract the person as JSON. Alice Moreau, 34, is an admin; her email is "
           "alice@acme.com. She lives in Lyon (zip 69001). Tags: chess, jazz.")


QUESTIONS = {
    "json": EXTRACT,
    "json_small": "Give a small record as JSON.",
    "json_object": "Reply with a JSON object describing Paris, with two short fields.",
    "regex": "Is the parcel heavy? Answer yes or no and the weight.",
    "choice": "Classify the sentiment of: 'I love this phone'.",
    "grammar": "Write a short sum of digits.",
}


def test_bundled_model_every_kind_in_one_batch(smol):
    """Each kind on a fitting chat prompt at temperature 1.0 (two seeds for the nested schema,
    one given as JSON text), all in one batch. json_object bounds nothing but the syntax, so a
    135M model sampling at 1.0 can add keys past any token budget: it decodes greedily."""
    kinds = list(QUESTIONS) + ["json"]
    prompts = [smol.apply_chat_template([{"role": "user", "content": QUESTIONS[k]}]) for k in kinds]
    plist = [SamplingParams(temperature=0.0 if k == "json_object" else 1.0, seed=i, max_tokens=160,
                            structured_outputs=CONSTRAINTS[k]) for i, k in enumerate(kinds)]
    plist[-1].structured_outputs = StructuredOutputsParams(json=json.dumps(PERSON))
    for kind, out in zip(kinds, smol.generate(prompts, plist), strict=True):
        assert_valid(kind, out.outputs[0])
