"""Grammar drafts: a constrained sequence drafts the tokens its grammar forces, and its output
is the output without speculation.

Two models, as in the structured-output tests: the random-weight fp32 Llama that speaks the
bundled tokenizer (exact kernels: speculating must change no token, greedy or seeded) and the
bundled SmolLM2 on the spec bench's extraction prompts with its json_schema (packed kernels:
a difference must be a near-tie flip that transformers confirms, as in
test_speculative_bundled). The oracle for exactness is the same engine with speculation off;
the oracle for "grammar drafts run" is the acceptance counter against the same engine with
grammar drafts switched off.
"""

from __future__ import annotations

import random

import pytest

from pagedq.bench.spec_scenario import TEXTS
from pagedq.bench.structured_scenario import SCHEMA
from pagedq.params import SamplingParams, StructuredOutputsParams
from pagedq.worker import Engine
from pagedq.worker.engine.drafts import CANDIDATES, PER_LENGTH, ngram_draft, ngram_occurrences
from tests.engine.structured_cases import CONSTRAINTS, PERSON, build_random_model, is_valid
from tests.engine.test_speculative_bundled import judge, max_flips, tolerance

# every step below the cap speculates: the governor's timed choice would make the accepted-token
# counts below depend on the machine's load (a loaded suite run turned speculation off for most
# steps, and the comparison of grammar drafts with plain lookup failed on its counts)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
PROMPTS = ["Fill in the form:", "Answer:", "The result is", "Output"]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("random-smol-vocab"))


def make_engine(path, spec=None, grammar_drafts=True, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 512)
    kw.setdefault("block_size", 4)
    engine = Engine(str(path) if path else None, speculative_config=spec, **kw)
    if engine.drafter is not None and not grammar_drafts:
        engine.drafter.forced = None
    return engine


def outputs(engine: Engine, prompts, params) -> list[list[int]]:
    return [c.token_ids for o in engine.generate(prompts, params) for c in o.outputs]


def accepted(engine: Engine) -> int:
    return engine.stats()["spec_decode_num_accepted_tokens"]


def constrained(kind: str, seed: int | None, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=64,
                          structured_outputs=CONSTRAINTS[kind])


# -- the forced tokens ------------------------------------------------------------------------
def test_forced_tokens_are_the_forced_text_and_leave_the_matcher(random_model):
    """At the start of PERSON the grammar forces '{"name": "' (no free whitespace): the draft
    spells a prefix of it; once the output is complete the stop token is the only one allowed.
    Asking twice gives the same draft (the matcher was rolled back), and the draft changes
    nothing the sequence then samples."""
    engine = make_engine(random_model, NGRAM)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=96,
                            structured_outputs=CONSTRAINTS["json"])
    want = engine.generate([PROMPTS[0]], params)[0].outputs[0]
    assert is_valid(CONSTRAINTS["json"], want.text)

    seq = compiled_seq(engine, "r", params)
    first = engine.structured.forced_tokens(seq, 8)
    assert first and engine.structured.forced_tokens(seq, 8) == first
    text = engine.tokenizer.decode(first)
    assert '{"name": "'.startswith(text), text
    assert engine.structured.forced_tokens(seq, 1) == first[:1]
    engine.abort_request("r")

    # the complete object resumed from another worker: only its stop token may follow
    seq = compiled_seq(engine, "done", params, resume=[want.token_ids[:-1]])
    assert engine.structured.forced_tokens(seq, 4) == [want.token_ids[-1]]
    engine.abort_request("done")


def compiled_seq(engine: Engine, rid: str, params: SamplingParams, resume=None,
                 prompt: str = PROMPTS[0]):
    """A queued request's sequence once its grammar has compiled (not yet stepped)."""
    req = engine.add_request(rid, prompt, params, resume=resume)
    while req not in engine.structured._compiled:
        engine.structured.take_compiled()
        engine.structured.wait_compiling(0.05)
    return req.seqs[0]


# -- exactness on the fp32 random model -------------------------------------------------------
CASES = {"json seeded": ("json", 0, 1.0), "json_small seeded": ("json_small", 1, 1.0),
         "json greedy": ("json", None, 0.0)}


@pytest.fixture(scope="module")
def off_outputs(random_model):
    off = make_engine(random_model)
    return {name: outputs(off, PROMPTS[:2], constrained(*case)) for name, case in CASES.items()}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_and_seeded_equal_off_and_grammar_drafts_are_accepted(random_model, off_outputs,
                                                                     spec):
    """PERSON and SMALL, greedy and seeded at 1.0, two prompts in one batch: the same tokens
    with speculation on as off; grammar drafts add accepted tokens over plain lookup (the
    random model's free tokens are noise, its forced keys and punctuation are not)."""
    on = make_engine(random_model, spec)
    plain = make_engine(random_model, spec, grammar_drafts=False) if spec is NGRAM else None
    for name, case in CASES.items():
        assert outputs(on, PROMPTS[:2], constrained(*case)) == off_outputs[name], name
        if plain is not None:
            assert outputs(plain, PROMPTS[:2], constrained(*case)) == off_outputs[name], name
    assert on.stats()["grammar_draft_tokens"] > 0
    if plain is not None:
        # the random model picks any tokenization of the forced text ('{' '"' or '{"'), so
        # only part of a forced draft survives; plain lookup on its noise accepts little (its
        # grammar-checked one-token matches included: measured 115 accepted against 35)
        assert accepted(on) > 2 * accepted(plain) + 30, (accepted(on), accepted(plain))
    assert on.kv.pool.num_free == on.kv.pool.num_blocks


def test_n_samples_and_logprobs_equal_off(random_model):
    """n > 1 forks each keep their own matcher: their forced drafts follow their own output;
    the logprobs of accepted tokens are those of one-by-one decoding."""
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=64, logprobs=2,
                            structured_outputs={"json": PERSON})
    want = make_engine(random_model).generate(PROMPTS[:1], params)
    got = make_engine(random_model, NGRAM).generate(PROMPTS[:1], params)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert [{t: round(lp, 4) for t, lp in d.items()} for d in x.logprobs] == [
                {t: round(lp, 4) for t, lp in d.items()} for d in y.logprobs]


# -- the bundled model --------------------------------------------------------------------------
@pytest.mark.timeout(1800)
def test_bundled_extraction_equals_off_up_to_near_ties(record_property):
    """The spec bench's extraction jobs (its schema, greedy and seeded): speculation with
    grammar drafts gives the output without it; a difference must be a near-tie flip that
    transformers confirms (greedy only: the twin is loaded only if one appears). Grammar drafts
    raise the accepted tokens well above plain n-gram lookup."""
    engine_kw = dict(num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=512)
    rng = random.Random(27)
    off = Engine(**engine_kw)
    prompts = [off.apply_chat_template([{"role": "user", "content": TEXTS["extraction"](rng)}])
               for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=96, logprobs=0,
                            structured_outputs={"json": SCHEMA})
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=96,
                            structured_outputs={"json": SCHEMA})
    want_greedy, want_seeded = outputs(off, prompts, greedy), outputs(off, prompts, seeded)
    plain = Engine(speculative_config=NGRAM, **engine_kw)
    plain.drafter.forced = None
    outputs(plain, prompts, greedy)
    verdicts = []
    for spec in (NGRAM, SUFFIX):
        on = Engine(speculative_config=spec, **engine_kw)
        got = outputs(on, prompts, greedy)
        verdicts += [(p, g, w) for p, g, w in zip(prompts, got, want_greedy, strict=True)]
        assert outputs(on, prompts, seeded) == want_seeded
        if spec is NGRAM:
            assert accepted(on) > 2 * accepted(plain), (accepted(on), accepted(plain))
    differing = [v for v in verdicts if v[1] != v[2]]
    if differing:
        from pagedq.worker.models.loader import resolve_model

        twin = resolve_model(None)
        off_lp = off.generate([p for p, _, _ in verdicts], greedy)
        plain_lp = [(o.outputs[0].token_ids,
                     [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                              strict=True)]) for o in off_lp]
        tol = tolerance(twin, [p for p, _, _ in verdicts], plain_lp)
        judged = [judge(twin, p, g, w, tol) for p, g, w in differing]
        record_property("flip_report", judged)
        assert not [j for j in judged if j.startswith("MISMATCH")], judged
        assert len(judged) <= max_flips(sum(len(w) for _, _, w in verdicts)), judged


# -- grammar-checked lookup candidates ----------------------------------------------------------
def test_ngram_occurrences_match_a_brute_force_scan():
    """Every (length, next index) of ngram_occurrences is a real earlier occurrence of the
    suffix of that length; lengths come longest first, each length's latest first, and no
    occurrence within the limits is skipped."""
    rng = random.Random(3)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        got = ngram_occurrences(tokens, 1, 4, CANDIDATES)
        want = []
        for n in range(min(4, len(tokens) - 1), 0, -1):
            ends = [i for i in range(len(tokens) - 1, n - 1, -1)
                    if tokens[i - n:i] == tokens[-n:]][:PER_LENGTH]
            want += [(n, i) for i in ends]
        assert got == want[:CANDIDATES], tokens


def test_constrained_draft_is_an_allowed_candidate_no_shorter_than_the_longest_match(
        random_model):
    """A digits-and-dashes constraint over a prompt whose latest matches go on with letters:
    the draft is a continuation of an earlier occurrence of the sequence's last tokens, the
    grammar allows all of it, and it is never shorter than the longest match's draft cut by
    the grammar (the rule before candidates: here nothing); the output equals off's."""
    prompt = "12-34-56 ab 12-34-56 cd 12-34-5 ef 12-34"
    so = StructuredOutputsParams(regex="[0-9]{2}(-[0-9]{2}){9}")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, frequency_penalty=-2.0,
                            structured_outputs=so)
    engine = make_engine(random_model, {**NGRAM, "prompt_lookup_min": 2}, num_kv_blocks=512)
    # the output so far is "12-34": its latest match (the prompt's end) goes on with "12",
    # which the constraint forbids there; earlier ones go on with "-56" and "-5"
    resumed = engine.tokenizer.encode("12-34", add_special_tokens=False)
    seq = compiled_seq(engine, "c2", params, resume=[resumed], prompt=prompt)
    tokens = seq.token_ids
    draft = engine.drafter.propose(seq, 8)
    assert draft and engine.structured.allowed_draft(seq, draft) == draft
    assert any(tokens[i - n:i] == tokens[-n:] and
               [tokens[(i + j) if i + j < len(tokens) else 0] for j in range(len(draft))] == draft
               for n in range(1, 6) for i in range(n, len(tokens)))
    longest = engine.structured.allowed_draft(seq, ngram_draft(tokens, 2, 5, 4))
    assert len(draft) >= len(longest)
    engine.abort_request("c2")
    off = make_engine(random_model, num_kv_blocks=512).generate([prompt], params)[0].outputs[0]
    on = make_engine(random_model, NGRAM, num_kv_blocks=512).generate([prompt], params)[0]
    assert on.outputs[0].token_ids == off.token_ids


def test_a_value_spelt_in_other_tokens_than_the_prompt_is_drafted_from_its_text(random_model):
    """The prompt has `` Beirut`` after a space (`` Be`` ``ir`` ``ut``); the JSON value starts
    after a quote with ``Be``, a token the prompt does not hold, so no token lookup matches.
    The spelling lookup matches the text instead: the draft is the rest of the word as the
    tokenizer spells ``Beirut...`` after ``Be``, and the grammar allows it; the output still
    equals off's, greedy and seeded."""
    prompt = "The record says she lives in Beirut. Return the city as JSON."
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"]}
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"json": city})
    engine = make_engine(random_model, NGRAM)
    tok = engine.tokenizer
    resumed = tok.encode('{"city": "Be', add_special_tokens=False)
    assert tok.decode(resumed[-1:]) == "Be"
    assert resumed[-1] not in tok.encode(prompt, add_special_tokens=False)
    seq = compiled_seq(engine, "city", params, resume=[resumed], prompt=prompt)
    rest = tok.encode("Beirut. Return", add_special_tokens=False)[1:]
    draft = engine.drafter.propose(seq, 8)
    assert draft == rest[:4], [tok.decode([t]) for t in draft]
    assert engine.structured.allowed_draft(seq, draft) == draft
    engine.abort_request("city")
    seeded = SamplingParams(temperature=1.0, seed=4, max_tokens=24,
                            structured_outputs={"json": city})
    off = make_engine(random_model)
    assert outputs(engine, [prompt], params) == outputs(off, [prompt], params)
    assert outputs(engine, [prompt], seeded) == outputs(off, [prompt], seeded)
