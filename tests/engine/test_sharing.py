"""KV sharing: prefix caching, n > 1 forks with copy-on-write, beam search on shared blocks."""

from __future__ import annotations

import math

import pytest
import torch

from pagedq.client import SamplingParams
from pagedq.worker import Engine
from pagedq.worker.engine.beam_search import BeamParams, add_beam_request, beam_search
from tests.engine.test_block_accounting import check_invariants
from tests.oracle import assert_greedy, hf_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def toks(n, seed):
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return str(tiny_model_dir("qwen2"))


def test_prefix_cache_hit_prefills_only_tail(path):
    engine = Engine(path, block_size=4, num_kv_blocks=256)
    prefix = toks(40, 1)
    a, b = prefix + toks(5, 2), prefix + toks(7, 3)
    out_a = engine.generate([a], GREEDY)[0]
    computed = engine.num_computed_tokens
    out_b = engine.generate([b], GREEDY)[0]
    s = engine.stats()
    assert out_b.num_cached_tokens == 40 and s["prefix_cache_hits"] == 40
    assert s["prefix_cache_queries"] == len(a) + len(b)
    # b computed its 7-token tail plus 10 decode steps (the last sampled token needs no KV)
    assert engine.num_computed_tokens - computed == 7 + 9
    cold = Engine(path, block_size=4, num_kv_blocks=256, enable_prefix_caching=False)
    for p, o in ((a, out_a), (b, out_b)):
        assert cold.generate([p], GREEDY)[0].outputs[0].token_ids == o.outputs[0].token_ids
        assert_greedy(path, p, o.outputs[0].token_ids)


def test_whole_prompt_cached_still_computes_last_token(path):
    engine = Engine(path, block_size=4, num_kv_blocks=64)
    p = toks(16, 5)  # ends on a block boundary
    first = engine.generate([p], GREEDY)[0]
    again = engine.generate([p], GREEDY)[0]
    assert again.num_cached_tokens == 12  # the last block is recomputed to get logits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_eviction_under_pressure_keeps_outputs(path):
    engine = Engine(path, block_size=4, num_kv_blocks=24, max_num_seqs=2)
    ps = [toks(30, 10 + i) for i in range(6)]
    first = engine.generate(ps, GREEDY)
    again = engine.generate(ps[::-1], GREEDY)[::-1]
    assert engine.stats()["prefix_cache_evictions"] > 0
    for p, x, y in zip(ps, first, again, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert_greedy(path, p, y.outputs[0].token_ids)


def test_n4_shares_prompt_blocks(path):
    """n=4 on a long prompt fits where four independent copies would not."""
    prompt = toks(120, 7)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    # 4 copies need 4 * ceil(128/4) = 128 blocks; shared: 30 prompt blocks + 4 tails of 3
    engine = Engine(path, block_size=4, num_kv_blocks=48, max_num_batched_tokens=256)
    peak = 0
    engine.add_request("n4", prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.index, []).extend(o.new_token_ids)
        peak = max(peak, engine.stats()["kv_blocks_used"])
        check_invariants(engine)
    assert engine.stats()["preemptions"] == 0
    assert sorted(outs) == [0, 1, 2, 3] and all(len(v) == 8 for v in outs.values())
    assert len({tuple(v) for v in outs.values()}) > 1  # the samples differ
    assert peak <= 30 + 4 * 3
    # each sample's first token is a draw from the prompt's distribution: must be possible
    probs = torch.softmax(hf_logits(path, prompt)[-1], -1)
    assert all(probs[v[0]] > 0 for v in outs.values())


def test_reset_prefix_cache_forgets_prefixes_only_when_idle(path):
    engine = Engine(path, block_size=4, num_kv_blocks=256)
    prompt = toks(40, 30)
    first = engine.generate([prompt], GREEDY)[0]
    engine.add_request("busy", toks(9, 31), GREEDY)
    assert engine.reset_prefix_cache() is False  # a request in flight: nothing is reset
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 0 and engine.stats()["prefix_cache_hits"] == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    check_invariants(engine)


def test_n_greedy_samples_equal_transformers(path):
    p = toks(21, 8)
    out = Engine(path, block_size=4, num_kv_blocks=128).generate([p], SamplingParams(
        n=3, temperature=0, max_tokens=9, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert_greedy(path, p, out.outputs[0].token_ids)


def test_n_seeded_samples_reproducible(path):
    p = toks(9, 4)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    a = Engine(path, block_size=4, num_kv_blocks=128).generate([p], params)[0]
    b = Engine(path, block_size=2, num_kv_blocks=256).generate([p], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_preempted_request_rehits_its_cached_blocks(path):
    engine = Engine(path, block_size=4, num_kv_blocks=40, max_num_batched_tokens=64)
    ps = [toks(40, 20 + i) for i in range(3)]
    outs = engine.generate(ps, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    s = engine.stats()
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0
    for p, o in zip(ps, outs, strict=True):
        assert_greedy(path, p, o.outputs[0].token_ids)


def reference_beam_search(path, prompt, width, max_tokens, length_penalty, eos):
    """Plain beam search on transformers' logits (vLLM's rule, written independently)."""
    beams = [([], 0.0)]
    done = []
    for _ in range(max_tokens):
        cands = []
        for b, (gen, cum) in enumerate(beams):
            lp = torch.log_softmax(hf_logits(path, prompt + gen)[-1], -1)
            vals, ids = lp.topk(2 * width)
            cands += [(cum + v, b, t) for v, t in zip(vals.tolist(), ids.tolist(), strict=True)]
        done += [(beams[b][0] + [t], c, True) for c, b, t in cands if t in eos]
        live = sorted([x for x in cands if x[2] not in eos], key=lambda x: (-x[0], x[1], x[2]))
        beams = [(beams[b][0] + [t], c) for c, b, t in live[:width]]
    done += [(g, c, False) for g, c in beams]

    def score(h):
        n = max(1, len(h[0]) - (1 if h[2] else 0))
        return h[1] / n**length_penalty

    return sorted(done, key=score, reverse=True)[:width]


@pytest.mark.parametrize("eos_is_likely", [False, True])
def test_beam_search_equals_reference(path, eos_is_likely):
    engine = Engine(path, block_size=4, num_kv_blocks=128)
    prompt = toks(11, 30)
    if eos_is_likely:  # make one of the likely next tokens the EOS so hypotheses end early
        greedy = engine.generate([prompt], GREEDY)[0].outputs[0].token_ids
        engine.eos_token_ids = frozenset({greedy[1]})
    eos = engine.eos_token_ids
    got = beam_search(engine, [prompt], BeamParams(beam_width=3, max_tokens=6, length_penalty=1.0))[0]
    ref = reference_beam_search(path, prompt, 3, 6, 1.0, eos)
    assert len(got) == 3
    assert math.isclose(got[0].cum_logprob, ref[0][1], abs_tol=1e-3)
    if abs(ref[0][1] - ref[1][1]) > 1e-3:  # ties aside
        assert got[0].token_ids == ref[0][0]
    assert [round(b.cum_logprob, 3) for b in got] == [round(c, 3) for _, c, _ in ref]
    assert engine.stats()["kv_blocks_used"] == 0


def test_beam_blocks_shared(path):
    """Beams share their prompt's blocks: far fewer blocks than width independent copies."""
    engine = Engine(path, block_size=4, num_kv_blocks=256)
    prompt = toks(100, 31)
    add_beam_request(engine, "b", prompt, BeamParams(beam_width=4, max_tokens=8))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats()["kv_blocks_used"])
        check_invariants(engine)
    assert peak <= 25 + 4 * 3  # 25 prompt blocks shared + per-beam tails
    assert engine.stats()["kv_blocks_used"] == 0
