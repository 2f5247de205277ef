"""The structured-output module on the bundled model's real tokenizer (SmolLM2, 49k tokens).

Logits here are random (a seeded Gaussian per row and step; the argmax of fresh noise is a
uniformly random pick among the allowed tokens): a model that picks garbage. Only the mask
can make the text valid, and every finished text is checked by an independent oracle
(jsonschema, re.fullmatch, membership, a recognizer).
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedq.errors import InvalidParamsError, InvalidRequestError
from pagedq.params import SamplingParams, StructuredOutputsParams
from pagedq.worker.engine.grammar_cache import GrammarCache
from pagedq.worker.engine.schema_check import check_schema
from pagedq.worker.engine.sequence import Request, Sequence
from pagedq.worker.engine.structured import StructuredOutputs
from pagedq.worker.models.loader import load_tokenizer, resolve_model
from tests.engine.structured_cases import CONSTRAINTS, GRAMMAR, PERSON, SMALL, is_valid

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def eos(tokenizer):
    return frozenset({tokenizer.eos_token_id})


@pytest.fixture(scope="module")
def so(tokenizer, eos):
    manager = StructuredOutputs(tokenizer, len(tokenizer), eos)
    yield manager
    manager.close()


def make_request(so: StructuredOutputs, constraint: dict | None, rid: str = "r", n: int = 1,
                 resume: list[int] | None = None) -> Request:
    params = SamplingParams(n=n, structured_outputs=constraint, max_tokens=200)
    req = Request(rid, None, PROMPT, params)
    for index in range(n):
        req.seqs.append(Sequence(req, index, PROMPT + list(resume or []), len(PROMPT)))
    ready, failed = admit(so, req)
    assert not failed and (ready == [req] or not ready)
    return req


def admit(so: StructuredOutputs, req: Request) -> tuple[list, list]:
    """Add ``req`` and wait for its compile, as the engine does between steps."""
    if not so.add(req):
        return [], []
    while so.num_compiling:
        so.wait_compiling(timeout=1.0)
        ready, failed = so.take_compiled()
        if ready or failed:
            return ready, failed
    return [], []


def random_logits(seqs: list[Sequence], vocab: int, seed: int) -> torch.Tensor:
    """Each row's logits depend only on (seed, sample index, position): batch-independent."""
    rows = []
    for s in seqs:
        g = torch.Generator().manual_seed(seed * 1_000_003 + s.index * 10_007 + s.num_tokens)
        rows.append(torch.randn(vocab, generator=g) * 2.0)
    return torch.stack(rows)


def run(so: StructuredOutputs, seqs: list[Sequence], vocab: int, eos: frozenset[int], seed: int,
        max_tokens: int = 200, stop_after: int | None = None) -> None:
    """Decode ``seqs`` together until each ends with EOS (or max_tokens / stop_after steps)."""
    live = [s for s in seqs if not (s.output_token_ids and s.output_token_ids[-1] in eos)]
    steps = 0
    while live and (stop_after is None or steps < stop_after):
        logits = random_logits(live, vocab, seed)
        so.apply(logits, live)
        for s, token in zip(live, logits.argmax(-1).tolist(), strict=True):
            so.advance(s, token)
            s.token_ids.append(token)
        live = [s for s in live if s.output_token_ids[-1] not in eos and s.num_generated < max_tokens]
        steps += 1


def text_of(tokenizer, seq: Sequence, eos: frozenset[int]) -> str:
    out = seq.output_token_ids
    assert out and out[-1] in eos, f"did not finish: {tokenizer.decode(out)!r}"
    return tokenizer.decode(out[:-1])


@pytest.mark.parametrize("kind", ["json_small", "regex", "choice", "grammar"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_give_valid_outputs(so, tokenizer, eos, kind, seed):
    req = make_request(so, CONSTRAINTS[kind], rid=f"{kind}-{seed}")
    run(so, req.seqs, len(tokenizer), eos, seed)
    text = text_of(tokenizer, req.seqs[0], eos)
    assert is_valid(CONSTRAINTS[kind], text), text


def test_nested_schema_valid_across_seeds(so, tokenizer, eos):
    """The nested schema: objects in objects, enums, bounded arrays, integer ranges, anyOf
    with null, string patterns. Four samples of one request, one matcher each."""
    req = make_request(so, {"json": PERSON}, rid="person", n=4)
    run(so, req.seqs, len(tokenizer), eos, seed=5, max_tokens=400)
    texts = [text_of(tokenizer, s, eos) for s in req.seqs]
    for text in texts:
        assert is_valid({"json": PERSON}, text), text
    assert len(set(texts)) == len(texts)  # each sample followed its own matcher


def test_unconstrained_rows_are_untouched(so, tokenizer, eos):
    free = make_request(so, None, rid="free")
    bound = make_request(so, {"choice": ["a", "b"]}, rid="bound")
    seqs = [free.seqs[0], bound.seqs[0]]
    logits = random_logits(seqs, len(tokenizer), seed=3)
    before = logits.clone()
    so.apply(logits, seqs)
    assert torch.equal(logits[0], before[0])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert {tokenizer.decode([t]) for t in allowed} <= {"a", "b"}


@pytest.mark.parametrize("kind", ["json_small", "regex", "grammar"])
def test_a_greedy_pick_the_grammar_allows_skips_the_mask(so, tokenizer, eos, kind):
    """Given each row's greedy pick, ``apply`` masks exactly the rows whose pick the grammar
    refuses and leaves the others untouched, and the argmax after it is the full mask's
    argmax (the oracle: a twin sequence masked in full at every step). Every other step the
    best allowed token is made the row's best overall, as a model following its format does."""
    full, quick = (make_request(so, CONSTRAINTS[kind], rid=f"{kind}-{name}") for name in ("full", "quick"))
    a, b = full.seqs[0], quick.seqs[0]
    masked = skipped = 0
    for step in range(60):
        logits = random_logits([b], len(tokenizer), seed=9)
        reference = logits.clone()
        so.apply(reference, [a])
        want = int(reference.argmax(-1))
        if step % 2:
            logits[0, want] = logits.max() + 1.0
        before = logits.clone()
        pick = int(before.argmax(-1))
        did = so.apply(logits, [b], [pick])
        assert did == (pick != want)
        if did:
            masked += 1
        else:
            skipped += 1
            assert torch.equal(logits, before)
        assert int(logits.argmax(-1)) == want
        for s in (a, b):
            so.advance(s, want)
            s.token_ids.append(want)
        if want in eos:
            break
    assert a.output_token_ids == b.output_token_ids
    assert masked and skipped, (masked, skipped)


def test_eos_only_where_the_grammar_accepts(so, tokenizer, eos):
    req = make_request(so, {"regex": "ab?"}, rid="eos")
    seq = req.seqs[0]
    (eos_id,) = eos

    def allowed() -> set[int]:
        logits = torch.zeros(1, len(tokenizer))
        so.apply(logits, [seq])
        return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())

    def take(token: int) -> bool:
        complete = so.advance(seq, token)
        seq.token_ids.append(token)
        return complete

    assert eos_id not in allowed()  # nothing yet: "a" is still missing
    assert not take(tokenizer.convert_tokens_to_ids("a"))
    assert eos_id in allowed() and tokenizer.convert_tokens_to_ids("b") in allowed()
    assert not take(tokenizer.convert_tokens_to_ids("b"))
    assert allowed() == {eos_id}  # complete: only the stop token remains
    assert take(eos_id)  # the grammar is done


def test_resume_replays_streamed_tokens_and_continues_exactly(tokenizer, eos, so):
    """A job crashes after 7 tokens; a fresh manager (another worker) replays them and the
    seeded continuation equals the uninterrupted run."""
    constraint = {"json": SMALL}
    whole = make_request(so, constraint, rid="whole")
    run(so, whole.seqs, len(tokenizer), eos, seed=11)
    full = whole.seqs[0].output_token_ids
    other = StructuredOutputs(tokenizer, len(tokenizer), eos)
    try:
        resumed = make_request(other, constraint, rid="resumed", resume=full[:7])
        run(other, resumed.seqs, len(tokenizer), eos, seed=11)
        assert resumed.seqs[0].output_token_ids == full
    finally:
        other.close()


def test_rollback_restores_the_mask(so, tokenizer, eos):
    req = make_request(so, {"json": SMALL}, rid="rollback")
    seq = req.seqs[0]
    run(so, [seq], len(tokenizer), eos, seed=4, stop_after=10)
    reference = make_request(so, {"json": SMALL}, rid="reference", resume=seq.output_token_ids[:4])
    del seq.token_ids[len(PROMPT) + 4:]  # six tokens taken back
    a, b = torch.zeros(1, len(tokenizer)), torch.zeros(1, len(tokenizer))
    so.apply(a, [seq])
    so.apply(b, reference.seqs)
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))


def test_resumed_tokens_that_break_the_constraint_fail_clearly(so, tokenizer):
    req = make_request(so, {"choice": ["yes", "no"]}, rid="bad-resume",
                       resume=tokenizer("maybe").input_ids)
    with pytest.raises(InvalidRequestError, match="does not fit its structured_outputs"):
        so.apply(torch.zeros(1, len(tokenizer)), req.seqs)


def test_json_object_and_dict_or_string_schema_share_one_compile(so):
    a = so.cache.submit(StructuredOutputsParams(json=SMALL))
    b = so.cache.submit(StructuredOutputsParams(json=json.dumps(SMALL, indent=2)))
    assert a.entry is b.entry
    assert so.cache.wait(so.cache.submit(StructuredOutputsParams(json_object=True))) is not None


def test_length_bounded_strings_exclude_control_characters(so):
    """xgrammar's own class for length-bounded strings admits raw tabs (invalid JSON)."""
    compiled = so.cache.wait(so.cache.submit(
        StructuredOutputsParams(json={"type": "string", "maxLength": 5})))
    xgr = so.cache.bitmask_backend
    assert not xgr.GrammarMatcher(compiled).accept_string('"a\tb"')
    assert xgr.GrammarMatcher(compiled).accept_string('"a b"')


@pytest.mark.parametrize("constraint, problem", [
    ({"json": {"type": "foo"}}, "not a valid JSON Schema"),
    ({"json": {"type": "string", "pattern": "(("}}, "pattern"),
    ({"json": {"type": "array", "uniqueItems": True}}, "'uniqueItems' is not supported"),
    ({"json": {"not": {"type": "string"}}}, "'not' is not supported"),
    ({"json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "'oneOf' is not supported"),
    ({"json": {"type": "string", "pattern": "^a+$", "maxLength": 3}}, "put the length"),
    ({"json": {"type": "number", "multipleOf": 0.5}}, "multipleOf"),
    ({"json": {"type": "string", "format": "idn-email"}}, "format 'idn-email'"),
    ({"json": {"$ref": "#/$defs/missing"}}, "missing"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
    ({"regex": "a(b"}, "parenthesis"),
    ({"regex": "(?=a)a"}, "Lookahead"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ({"grammar": "start: 'lark'"}, "EBNF"),
])
def test_invalid_constraints_name_the_problem(so, constraint, problem):
    def attempt() -> None:
        req = Request("bad", None, PROMPT, SamplingParams(structured_outputs=constraint))
        req.seqs.append(Sequence(req, 0, list(PROMPT), len(PROMPT)))
        ready, failed = admit(so, req)
        assert not ready and [r for r, _ in failed] == [req]
        raise failed[0][1]

    with pytest.raises(InvalidParamsError, match=problem):
        attempt()  # reported once the compile fails
    with pytest.raises(InvalidParamsError, match=problem):
        attempt()  # the cached verdict: add raises at once


def test_compile_past_the_time_limit_fails_and_stays_failed(tokenizer, eos):
    cache = GrammarCache(tokenizer, len(tokenizer), eos, timeout_s=0.05)
    try:
        slow = StructuredOutputsParams(regex="[a-z ]{1,3000}")
        with pytest.raises(InvalidParamsError, match="longer than 0.05 s"):
            cache.wait(cache.submit(slow))
        with pytest.raises(InvalidParamsError, match="longer than"):
            cache.poll(cache.submit(slow))  # the verdict is cached: no second compile
    finally:
        cache.close()


def test_a_compile_past_its_time_is_killed_and_the_next_one_does_not_wait_for_it(tokenizer,
                                                                                 eos):
    """Two slow compiles on the one compile slot: the first is killed at its deadline (not
    left running, as a thread would be), the second, whose time ran out while it waited,
    never starts; a choice after them compiles on a fresh process."""
    cache = GrammarCache(tokenizer, len(tokenizer), eos, num_threads=1, timeout_s=0.3)
    try:
        bombs = [cache.submit(StructuredOutputsParams(regex=f"[a-z ]{{1,{n}}}"))
                 for n in (6000, 6001)]
        for ticket in bombs:
            with pytest.raises(InvalidParamsError, match="longer than 0.3 s"):
                cache.wait(ticket)
        assert cache.wait(cache.submit(StructuredOutputsParams(choice=["yes", "no"])))
        assert cache.children == (2, 1)
        first, second = cache._compiler.result().children
        assert first.poll() is not None and second.poll() is None
    finally:
        cache.close()


def test_lru_evicts_the_oldest(tokenizer, eos):
    cache = GrammarCache(tokenizer, len(tokenizer), eos, max_entries=2)
    try:
        tickets = [cache.submit(StructuredOutputsParams(choice=[c])) for c in ("x", "y", "z")]
        assert cache.submit(StructuredOutputsParams(choice=["z"])).entry is tickets[2].entry
        assert cache.submit(StructuredOutputsParams(choice=["x"])).entry is not tickets[0].entry
    finally:
        cache.close()


def test_grammar_kind_is_ebnf(so, tokenizer, eos):
    req = make_request(so, {"grammar": GRAMMAR}, rid="ebnf")
    run(so, req.seqs, len(tokenizer), eos, seed=9)
    assert is_valid({"grammar": GRAMMAR}, text_of(tokenizer, req.seqs[0], eos))


@pytest.mark.parametrize("schema", [PERSON, SMALL, {"type": "object", "properties": {
    "when": {"type": "string", "format": "date"}, "n": {"type": "integer", "multipleOf": 3},
    "kind": {"type": "string", "enum": ["a", "b"]}, "x": {"$ref": "#/$defs/x"}},
    "$defs": {"x": {"type": ["integer", "null"]}}, "title": "annotated"}])
def test_schema_check_accepts_enforced_keywords(schema):
    check_schema(schema)


def test_schema_check_rejects_mistyped_enum():
    with pytest.raises(InvalidParamsError, match="not of type"):
        check_schema({"type": "string", "enum": ["a", 1]})


@pytest.mark.parametrize("vocab", [49152, 1000, 49153])
def test_cpu_mask_equals_xgrammars_kernel(so, vocab):
    """The engine's own CPU apply against xgrammar's reference kernel, on random masks."""
    from pagedq.worker.engine.structured import apply_bitmask_cpu

    xgr = so.cache.bitmask_backend
    g = torch.Generator().manual_seed(vocab)
    bitmask = xgr.allocate_token_bitmask(7, vocab)
    bitmask.copy_(torch.randint(-2**31, 2**31 - 1, bitmask.shape, generator=g, dtype=torch.int32))
    logits = torch.randn(7, vocab, generator=g)
    for rows in ([0, 3, 6], list(range(7))):
        want, got = logits.clone(), logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
        apply_bitmask_cpu(got, bitmask, rows)
        assert torch.equal(want, got)
