"""Sampling against plain per-row references, seeded determinism, stop strings, validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedq.client import SamplingParams
from pagedq.errors import InvalidParamsError
from pagedq.worker import Engine
from pagedq.worker.engine.sampler import apply_penalties, filtered_probs
from pagedq.worker.engine.sequence import Request, Sequence

VOCAB = 50


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float,
                    min_p: float) -> list[float]:
    """One row, in plain Python: vLLM's semantics (top-k, then top-p on the renormalised rest)."""
    m = max(x / temperature for x in logits)
    e = [math.exp(x / temperature - m) for x in logits]
    z = sum(e)
    p = [x / z for x in e]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order[:top_k] if top_k else order)
    mass = sum(p[i] for i in keep)
    acc, kept_p = 0.0, set()
    for i in order:
        if i not in keep:
            continue
        if acc <= top_p:  # mass strictly before this token
            kept_p.add(i)
        acc += p[i] / mass
    top = max(p)
    out = [p[i] if i in kept_p and p[i] >= min_p * top else 0.0 for i in range(len(p))]
    z = sum(out)
    return [x / z for x in out]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.2, 2.0),
    top_k=st.sampled_from([0, 1, 3, 10, 49]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_filtered_probs_match_reference(seed, temperature, top_k, top_p, min_p):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    probs = filtered_probs(logits.clone(), torch.tensor([temperature, 1.0]),
                           torch.tensor([top_k, 0]), torch.tensor([top_p, 1.0]),
                           torch.tensor([min_p, 0.0]))
    probs = probs / probs.sum(-1, keepdim=True)
    refs = [reference_probs(logits[0].tolist(), temperature, top_k, top_p, min_p),
            reference_probs(logits[1].tolist(), 1.0, 0, 1.0, 0.0)]  # an unfiltered batch mate
    for r, ref in enumerate(refs):
        assert torch.allclose(probs[r], torch.tensor(ref), atol=1e-5)


def _seq(prompt, output, **params) -> Sequence:
    req = Request("r", None, list(prompt), SamplingParams(**params))
    seq = Sequence(req, 0, list(prompt) + list(output), len(prompt))
    return seq


def test_penalties_match_reference():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    seqs = [
        _seq([1, 2, 3], [3, 4, 4, 4], repetition_penalty=1.3),
        _seq([5], [6, 6, 7], presence_penalty=0.5, frequency_penalty=0.25),
        _seq([8], [9]),  # untouched
    ]
    out = logits.clone()
    apply_penalties(out, seqs)
    ref = logits.clone()
    for t in {1, 2, 3, 4}:  # repetition: prompt and output tokens
        ref[0, t] = ref[0, t] / 1.3 if ref[0, t] > 0 else ref[0, t] * 1.3
    for t, c in {6: 2, 7: 1}.items():
        ref[1, t] -= 0.25 * c + 0.5
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(str(tiny_model_dir("llama")), num_kv_blocks=512, block_size=8)


def test_sampled_distribution_follows_probs(engine):
    """Many seeded draws of one step: frequencies follow the filtered distribution."""
    prompt = [7, 8, 9]
    params = [SamplingParams(temperature=1.5, top_k=5, max_tokens=1, seed=s) for s in range(400)]
    outs = engine.generate([prompt] * 400, params)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]),
                            minlength=384).float()
    from tests.oracle import hf_logits

    logits = hf_logits(engine.model_path, prompt)[-1]
    ref = torch.tensor(reference_probs(logits.tolist(), 1.5, 5, 1.0, 0.0))
    assert set(counts.nonzero().flatten().tolist()) <= set(ref.nonzero().flatten().tolist())
    assert (counts / 400 - ref).abs().max() < 0.08


def test_seeded_output_independent_of_batch_mates(engine):
    prompt = [11, 12, 13, 14]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = engine.generate([prompt], params)[0].outputs[0].token_ids
    others = [[20 + i] * (3 + i) for i in range(6)]
    mates = [SamplingParams(temperature=1.0, max_tokens=16, top_k=20),
             SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.2),
             SamplingParams(temperature=1.0, max_tokens=16, min_p=0.1)]
    mixed = engine.generate(others[:3] + [prompt] + others[3:],
                            mates + [params] + [SamplingParams(temperature=0.7, max_tokens=9,
                                                               top_p=0.5)] * 3)
    assert mixed[3].outputs[0].token_ids == alone
    plain = SamplingParams(temperature=1.0, seed=14, max_tokens=8, ignore_eos=True)  # no filters
    alone = engine.generate([[3, 7, 13, 3]], plain)[0].outputs[0].token_ids
    mixed = engine.generate([[3, 7, 13, 3], [5, 5]], [plain, SamplingParams(top_k=20)])
    assert mixed[0].outputs[0].token_ids == alone
    different = engine.generate([prompt], SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_min_tokens_and_stop_token_ids(engine):
    prompt = [3, 4, 5]
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    stop_at = greedy[4]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                   stop_token_ids=[stop_at]))[0].outputs[0]
    first = greedy.index(stop_at)
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop"
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=10,
                                                   stop_token_ids=[stop_at]))[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_logprobs_are_model_logprobs(engine):
    prompt = [3, 4, 5, 6]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                   ignore_eos=True))[0].outputs[0]
    from tests.oracle import hf_logits

    logits = hf_logits(engine.model_path, prompt + out.token_ids)
    total = 0.0
    for i, (tok, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        lp = torch.log_softmax(logits[len(prompt) - 1 + i], -1)
        assert abs(top[tok] - lp[tok].item()) < 1e-4
        assert set(top) >= set(lp.topk(2).indices.tolist())
        total += lp[tok].item()
    assert abs(out.cum_logprob - total) < 1e-3


@pytest.mark.parametrize("bad", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-3), dict(min_p=2),
    dict(max_tokens=0), dict(n=0), dict(seed=-1), dict(stop=[""]), dict(min_tokens=5, max_tokens=2),
    dict(presence_penalty=3), dict(repetition_penalty=0), dict(logprobs=50),
    dict(temperature=float("nan")), dict(n=True), dict(stop_token_ids=[-1]),
])
def test_invalid_params_rejected(bad):
    field = next(iter(bad))
    with pytest.raises(InvalidParamsError, match=field):
        SamplingParams(**bad)


def test_params_roundtrip_and_unknown_fields():
    p = SamplingParams(temperature=0.5, stop="x", top_k=-1, seed=3)
    assert p.stop == ["x"] and p.top_k == 0
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(InvalidParamsError, match="unknown sampling params"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.7}, {"min_p": 0.2}])
def test_a_narrow_grammar_row_draws_the_dense_draws_token(filters):
    """Structured rows whose mask leaves a few tokens (40, and one forced) are drawn over those
    alone (narrow_rows): every seeded draw picks the token the whole-vocabulary draw picks,
    beside a wide structured row and an unconstrained one in the same batch."""
    from pagedq.worker.engine.sampler import Sampler, draw, seeded_uniform

    vocab = 5000
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=gen) * 3
    allowed = torch.randperm(vocab, generator=gen)[:40]
    for row, keep in ((0, allowed), (3, allowed[:1])):
        masked = torch.full((vocab,), float("-inf"))
        masked[keep] = logits[row, keep]
        logits[row] = masked
    logits[1, torch.randperm(vocab, generator=gen)[:1500]] = float("-inf")  # wide: stays dense
    for step in range(40):
        seqs = [_seq([1, 2], [7] * step, temperature=0.9, seed=100 + r, **filters,
                     structured_outputs=None if r == 2 else {"regex": "[a-z]+"})
                for r in range(4)]
        got = Sampler()._sample_rows(logits.clone(), seqs)
        u = torch.tensor([seeded_uniform(100 + r, 0, step) for r in range(4)], dtype=torch.float64)
        assert got.tolist() == draw(logits.clone(), seqs, u).tolist()
        assert int(got[0]) in set(allowed.tolist()) and int(got[3]) == int(allowed[0])
