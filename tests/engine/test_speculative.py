"""Speculative decoding (n-gram and suffix drafts): the output is the output without it.

Every test runs the same requests with speculation off and on and compares them token for
token (greedy also against transformers' forward); the tiny fp32 models' kernels are exact
enough that no near-tie flips on these prompts. Random tiny models rarely repeat themselves, so
most tests ask for repetition (a repetition penalty below 1 or a negative frequency penalty:
the same penalties in both runs) or a prompt that repeats, and assert that drafts were
accepted, so the verification path really ran.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.client import SamplingParams
from pagedq.params import StructuredOutputsParams
from pagedq.worker import Engine
from pagedq.worker.config import EngineConfig, SpeculativeConfig
from pagedq.worker.engine.drafts import FIRST_DRAFT, Drafter, ngram_draft, ngram_match
from pagedq.worker.engine.suffix_tree import SuffixCorpus
from tests.engine.test_block_accounting import check_invariants, request_st, run_arrivals
from tests.oracle import assert_greedy

# adaptive off: these tests need drafts verified in every step, whatever the real clock says
# (the governor's own tests drive it with a fake clock: test_spec_governor.py)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False}
LOOPY = dict(ignore_eos=True, repetition_penalty=0.6)  # greedy that repeats itself
STUCK = dict(ignore_eos=True, frequency_penalty=-2.0)  # greedy that soon repeats one token


def prompts(lengths, seed=0, vocab=384):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def repetitive(seed=0, vocab=384):
    """Prompts that repeat spans of themselves (what extraction and edit jobs look like)."""
    a, b, c = prompts([9, 14, 5], seed=seed, vocab=vocab)
    return [a * 3, b + a + b, c * 6 + a, a + b + c + b + c]


def make_engine(path, spec=None, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return Engine(str(path), speculative_config=spec, **kw)


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def accepted(engine: Engine) -> int:
    return engine.stats()["spec_decode_num_accepted_tokens"]


def assert_all_free(engine: Engine) -> None:
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


# -- drafts -----------------------------------------------------------------------------------
def test_ngram_draft_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] occurred at 1..2 (then 9) and 5..6 (then 7): the latest wins
    assert ngram_draft(tokens, 2, 4, 3) == [7, 8, 5]
    assert ngram_draft([1, 2, 3, 4], 2, 4, 3) == []
    # a loop drafts its next turn, even past the end of the tokens
    assert ngram_draft([5, 6, 5, 6, 5], 1, 3, 5) == [6, 5, 6, 5, 6]
    assert ngram_draft([4, 4, 4], 2, 3, 4) == [4, 4, 4, 4]
    # token ids above 255 are matched whole, never across byte boundaries
    assert ngram_draft([256, 1, 0, 256, 1], 2, 2, 2) == [0, 256]
    assert ngram_draft([1, 256, 0, 0, 1], 2, 2, 2) == []


def test_suffix_corpus_is_lru_bounded():
    """(The tree itself is checked against a brute-force scan in test_suffix_tree.py.)"""
    corpus = SuffixCorpus(max_requests=2, min_n=2, max_depth=8)
    corpus.add([1, 2, 3, 4, 5])
    corpus.add([7, 8, 9, 10])
    assert corpus.propose([0, 2, 3], 2) == (2, [4, 5])  # a draft from [1..5] uses it
    corpus.add([20, 21, 22])  # evicts [7..10], the least recently used
    assert len(corpus) == 2 and corpus.stats()["spec_suffix_tokens"] == 8
    assert corpus.propose([7, 8, 9], 2) == (0, [])
    assert corpus.propose([9, 1, 2, 3], 4) == (3, [4, 5])


def test_ngram_match_is_the_longest_latest_match_of_a_brute_force_scan():
    """The binary search on the length finds what a scan from the longest length down finds:
    the longest suffix with an earlier occurrence that has a token after it, and the latest
    such occurrence."""
    rng = random.Random(5)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        low, high = rng.randrange(1, 4), rng.randrange(1, 30)
        want = (0, -1)
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            ends = [i for i in range(len(tokens) - 1, n - 1, -1) if tokens[i - n:i] == tokens[-n:]]
            if ends:
                want = (n, ends[0])
                break
        assert ngram_match(tokens, low, high) == want, (tokens, low, high)


def suffix_drafter(**config) -> Drafter:
    return Drafter(SpeculativeConfig(method="suffix", num_speculative_tokens=4, **config),
                   max_model_len=1000)


def test_own_match_beyond_prompt_lookup_max_beats_a_shorter_corpus_match():
    """Unconstrained: the own match is measured up to the tree's depth, so a job repeating its
    own 8 tokens drafts its own continuation, not an earlier job's after a 6-token match; a
    corpus match longer than the own one still wins."""
    drafter = suffix_drafter()
    phrase = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter.corpus.add([90, *phrase[2:], 50, 51, 52, 53])  # earlier job: phrase[2:] -> 50...
    own = [*phrase, 20, 21, 22, 23, 99, *phrase]  # this job: phrase -> 20...
    assert drafter.corpus.propose(own, 4) == (6, [50, 51, 52, 53])
    assert drafter._lookup(own, 4) == [20, 21, 22, 23]
    drafter.corpus.add([*phrase, 60, 61, 62, 63])  # an earlier job matching 9 tokens: 99 + phrase
    drafter.corpus.add([99, *phrase, 70, 71, 72, 73])
    assert drafter._lookup(own, 4) == [70, 71, 72, 73]


def test_constrained_candidates_try_the_own_tokens_before_the_corpus():
    """Constrained: the own occurrences (even of one token) come before the corpus's deeper
    match, which earlier jobs' shared keys make long and their values make wrong."""
    drafter = suffix_drafter()
    drafter.corpus.add([1, 2, 3, 4, 5, 40, 41, 42])
    own = [7, 5, 30, 31, 32, 1, 2, 3, 4, 5]
    candidates = list(drafter._candidates(own, 3, None))
    assert candidates[0] == [30, 31, 32]  # own: "5" was followed by 30, 31, 32
    assert candidates[-1] == [40, 41, 42]  # the corpus's 5-token match comes last


def test_draft_length_adapts_to_acceptance(llama):
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=6), max_model_len=100)
    seq = make_engine(llama).add_request("r", [1, 2, 1, 2, 1], SamplingParams(max_tokens=50)).seqs[0]
    assert len(drafter.propose(seq, budget=100)) == FIRST_DRAFT == 4  # a first draft is short
    drafter.verified(seq, 4, 4)
    assert len(drafter.propose(seq, budget=100)) == 5  # a full acceptance grows it by one
    drafter.verified(seq, 5, 5)
    assert len(drafter.propose(seq, budget=100)) == 6
    drafter.verified(seq, 6, 6)
    assert seq.spec_len == 6  # up to num_speculative_tokens
    drafter.verified(seq, 6, 1)
    assert len(drafter.propose(seq, budget=100)) == 2
    assert len(drafter.propose(seq, budget=1)) == 1  # the step's budget bounds it
    drafter.verified(seq, 2, 2)
    assert seq.spec_len == 3
    seq.request.params.speculative = False
    assert drafter.propose(seq, budget=100) == []
    assert drafter.stats()["spec_decode_num_draft_tokens"] == 23


# -- exactness --------------------------------------------------------------------------------
def test_greedy_equals_off_and_transformers(tiny_family_dir):
    """Plain greedy, chunked prefill under a small budget, blocks of 1 and 4 tokens."""
    _, path = tiny_family_dir
    ps = repetitive(seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for block_size, method in ((4, NGRAM), (1, SUFFIX)):
        kw = dict(block_size=block_size, num_kv_blocks=1024 // block_size,
                  max_num_batched_tokens=24)
        off = make_engine(path, **kw).generate(ps, params)
        engine = make_engine(path, method, **kw)
        on = engine.generate(ps, params)
        assert token_ids(on) == token_ids(off)
        for p, o in zip(ps, on, strict=True):
            assert_greedy(path, p, o.outputs[0].token_ids)
        assert engine.stats()["spec_decode_num_drafts"] > 0
        assert_all_free(engine)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX])
def test_greedy_with_penalties_equals_off(llama, spec):
    ps = prompts([5, 17, 30, 9], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=60, **LOOPY)
    off = make_engine(llama).generate(ps, params)
    engine = make_engine(llama, spec)
    assert token_ids(engine.generate(ps, params)) == token_ids(off)
    assert accepted(engine) > 0
    assert_all_free(engine)


def test_seeded_sampling_n_and_logprobs_equal_off(llama):
    """Seeded draws at each position are the draws plain decoding makes there; n > 1 forks
    and top-k/top-p/min-p filters included; logprobs as if decoded one by one."""
    ps = prompts([6, 21, 12], seed=4)
    params = [SamplingParams(n=2, temperature=0.8, seed=s, max_tokens=48, ignore_eos=True,
                             frequency_penalty=-1.0, top_k=k, top_p=p, min_p=m, logprobs=2)
              for s, (k, p, m) in enumerate([(0, 1.0, 0.0), (20, 0.9, 0.0), (0, 1.0, 0.05)])]
    off = make_engine(llama).generate(ps, params)
    engine = make_engine(llama, NGRAM)
    on = engine.generate(ps, params)
    assert token_ids(on) == token_ids(off)
    assert accepted(engine) > 0
    for a, b in zip(off, on, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert len(x.logprobs) == len(y.logprobs) == len(y.token_ids)
            for da, db in zip(x.logprobs, y.logprobs, strict=True):
                assert da.keys() == db.keys()
                assert all(abs(da[t] - db[t]) < 1e-4 for t in da)
            assert abs(x.cum_logprob - y.cum_logprob) < 1e-3
    assert_all_free(engine)


# -- KV rollback ------------------------------------------------------------------------------
def test_rollback_under_preemption_and_prefix_hits(llama):
    """A KV cache too small for the batch (preemption) and a second wave whose prompts are the
    first wave's prompts and outputs (prefix hits on blocks written while speculating): the
    outputs equal speculation off and transformers', block accounting holds after every step,
    and every block in the prefix cache holds verified tokens only."""
    first = prompts([30, 28, 26, 24, 22], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    roomy = make_engine(llama, num_kv_blocks=512)
    base = roomy.generate(first, params)
    second = [p + o.outputs[0].token_ids[:20] for p, o in zip(first, base, strict=True)]
    want = token_ids(base) + token_ids(roomy.generate(second, params))
    engine = make_engine(llama, {**NGRAM, "prompt_lookup_min": 1}, num_kv_blocks=48,
                         max_num_batched_tokens=64)
    got = []
    for wave in (first, second):
        for i, p in enumerate(wave):
            engine.add_request(f"{len(got)}-{i}", p, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            check_invariants(engine)
            for seq in engine.scheduler.running:
                assert len(seq.block_table) * 4 < seq.num_computed_tokens + 4  # tail trimmed
        got += [[tokens[f"{len(got)}-{i}"]] for i in range(len(wave))]
    assert got == want
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    known = {tuple(s[i:i + 4]) for p, o in zip(first + second, want, strict=True)
             for s in [p + o[0]] for i in range(0, len(s) - 3, 4)}
    assert all(b.tokens in known for b in engine.kv.pool.blocks if b.block_hash is not None)
    for p, o in zip(second, got[5:], strict=True):
        assert_greedy(llama, p, o[0])
    assert_all_free(engine)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request_st, min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 4]), budget=st.integers(4, 48),
       spare_blocks=st.integers(0, 20), k=st.integers(1, 5))
def test_block_accounting_while_speculating(llama, requests, block_size, budget, spare_blocks, k):
    """The block-accounting property test, speculating, with aborts, n > 1 and prefix hits."""
    need = max(p + m for p, m, *_ in requests) + k
    engine = Engine(str(llama), block_size=block_size,
                    num_kv_blocks=-(-need // block_size) + 3 + spare_blocks,
                    max_num_batched_tokens=budget, max_num_seqs=4,
                    speculative_config={"num_speculative_tokens": k, "prompt_lookup_min": 1})
    run_arrivals(engine, requests, vocab=7, frequency_penalty=-1.5)
    assert_all_free(engine)


# -- how sequences end ------------------------------------------------------------------------
def stream(engine: Engine, rid: str, prompt, params) -> tuple[list[list[int]], object]:
    """Run one request on the step API; returns its deltas' token lists and its last delta."""
    engine.add_request(rid, prompt, params)
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_token_ids)
            last = out
    return deltas, last


def first_multi_token_step(deltas: list[list[int]]) -> tuple[int, int]:
    """(index of the first step that yielded 3+ tokens, tokens generated before it)."""
    i = next(i for i, d in enumerate(deltas) if len(d) > 2)
    return i, sum(map(len, deltas[:i]))


def test_max_tokens_inside_an_accepted_draft(llama):
    p = prompts([12], seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=80, **STUCK)
    deltas, _ = stream(make_engine(llama, NGRAM), "a", p, params)
    full = [t for d in deltas for t in d]
    _, before = first_multi_token_step(deltas)
    q = SamplingParams(**{**params.__dict__, "max_tokens": before + 2})
    off = make_engine(llama).generate([p], q)[0].outputs[0]
    on = make_engine(llama, NGRAM)
    deltas, last = stream(on, "b", p, q)
    assert [t for d in deltas for t in d] == off.token_ids == full[:before + 2]
    assert last.finish_reason == off.finish_reason == "length"
    assert len(deltas[-1]) > 1 and accepted(on) > 0  # the last step verified a draft
    assert_all_free(on)


def test_stop_string_inside_an_accepted_draft(tiny_text_model_dir):
    """The stop string is the text of the second token of a step that accepted a draft; with
    min_tokens holding stops back until then (stop strings do not mask sampling), the stop is
    found in the middle of the accepted tokens and the rest of them is dropped."""
    path, prompt = tiny_text_model_dir, "Hello world, hello world, hello"
    params = SamplingParams(temperature=0.0, max_tokens=60, **STUCK)
    engine = make_engine(path, NGRAM)
    deltas, _ = stream(engine, "a", prompt, params)
    i, before = first_multi_token_step(deltas)
    stop = engine.tokenizer.decode(deltas[i][1:2])
    assert stop
    q = SamplingParams(**{**params.__dict__, "stop": [stop], "min_tokens": before + 2})
    off = make_engine(path).generate([prompt], q)[0].outputs[0]
    on_engine = make_engine(path, NGRAM)
    deltas, last = stream(on_engine, "b", prompt, q)
    assert [t for d in deltas for t in d] == off.token_ids
    assert len(off.token_ids) == before + 2 and last.finish_reason == off.finish_reason == "stop"
    assert len(deltas[-1]) > 1 and accepted(on_engine) > 0
    on = on_engine.generate([prompt], q)[0].outputs[0]
    assert on.text == off.text and on.token_ids == off.token_ids
    assert_all_free(on_engine)


def test_cancel_between_steps_frees_everything(llama):
    engine = make_engine(llama, NGRAM)
    p = prompts([10], seed=6)[0]
    engine.add_request("x", p, SamplingParams(temperature=0.0, max_tokens=200, **LOOPY))
    engine.add_request("y", p, SamplingParams(temperature=0.0, max_tokens=30, **LOOPY))
    seen: Counter[str] = Counter()
    cancelled_at = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "x" or cancelled_at is None, "output after the cancel"
            seen[out.request_id] += len(out.new_token_ids)
        if cancelled_at is None and accepted(engine) > 0:
            assert engine.abort_request("x")
            cancelled_at = seen["x"]
    assert cancelled_at is not None and seen["x"] == cancelled_at and seen["y"] == 30
    assert_all_free(engine)


def test_beam_search_does_not_speculate(llama):
    p = prompts([8], seed=7)[0]
    off = make_engine(llama).beam_search([p], beam_width=2, max_tokens=10)
    engine = make_engine(llama, NGRAM)
    on = engine.beam_search([p], beam_width=2, max_tokens=10)
    assert [b.token_ids for b in on[0].beams] == [b.token_ids for b in off[0].beams]
    assert engine.stats()["spec_decode_num_drafts"] == 0


def test_disabled_per_request_and_by_batch_size(llama):
    ps = prompts([5, 9], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, speculative=False, **LOOPY)
    engine = make_engine(llama, NGRAM)
    off = make_engine(llama).generate(ps, params)
    assert token_ids(engine.generate(ps, params)) == token_ids(off)
    assert engine.stats()["spec_decode_num_drafts"] == 0
    busy = make_engine(llama, {**NGRAM, "disable_by_batch_size": 2})
    params.speculative = True
    assert token_ids(busy.generate(ps, params)) == token_ids(off)
    assert busy.stats()["spec_decode_num_drafts"] == 0


def test_suffix_drafts_from_earlier_requests(llama):
    """The second of two identical jobs drafts its whole output from the first one's."""
    p = prompts([11], seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine = make_engine(llama, SUFFIX, enable_prefix_caching=False)
    first = engine.generate([p], params)
    before = accepted(engine)
    assert token_ids(engine.generate([p], params)) == token_ids(first)
    assert accepted(engine) - before >= 20
    assert engine.stats()["spec_suffix_requests"] == 2


# -- structured outputs -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    from tests.engine.structured_cases import build_random_model

    return build_random_model(tmp_path_factory.mktemp("random-smol-vocab"))


def test_grammar_forbidden_drafts_end_the_draft(random_model):
    """Drafts from a prompt full of letters meet a digits-only constraint: each is cut at its
    first forbidden token; the matcher only ever advances over accepted tokens."""
    prompt = "12-34-56 ab 12-34-56 cd 12-34-56 ef 12-34"
    so = StructuredOutputsParams(regex="[0-9]{2}(-[0-9]{2}){9}")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, frequency_penalty=-2.0,
                            structured_outputs=so)
    off = make_engine(random_model, num_kv_blocks=512).generate([prompt], params)[0].outputs[0]
    engine = make_engine(random_model, {**NGRAM, "prompt_lookup_min": 1}, num_kv_blocks=512)
    trims = []
    allowed = engine.drafter.allowed

    def recording(seq, draft):
        kept = allowed(seq, draft)
        trims.append((draft, kept))
        return kept

    engine.drafter.allowed = recording
    on = engine.generate([prompt], params)[0].outputs[0]
    assert (on.token_ids, on.text) == (off.token_ids, off.text)
    assert all(draft[:len(kept)] == kept for draft, kept in trims)
    assert any(len(kept) < len(draft) for draft, kept in trims)
    assert_all_free(engine)


def test_config_rejects_bad_values():
    with pytest.raises(Exception, match="method"):
        EngineConfig(speculative_config={"method": "eagle"})
    with pytest.raises(Exception, match="unknown keys"):
        EngineConfig(speculative_config='{"method": "ngram", "draft_model": "x"}')
    assert EngineConfig(speculative_config='{"method": "suffix"}').speculative_config.method == "suffix"


def test_per_request_switch_crosses_the_wire_and_the_gateway():
    """SamplingParams(speculative=False) survives the wire format (the default stays off it,
    so older workers keep reading new clients' jobs) and the gateway's extra body."""
    from pagedq.gateway.openai import ChatCompletionRequest
    from pagedq.gateway.translate import chat_spec

    off = SamplingParams(speculative=False)
    assert SamplingParams.from_dict(off.to_dict()) == off
    assert "speculative" not in SamplingParams().to_dict()
    with pytest.raises(Exception, match="speculative"):
        SamplingParams(speculative="no")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "speculative": False}
    assert chat_spec(ChatCompletionRequest.model_validate(body)).params.speculative is False
