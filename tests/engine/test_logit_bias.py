"""logit_bias (OpenAI's semantics): validated, added to the logits before sampling.

Oracles: a plain per-element reference for the sampler's scatter; for the engine, greedy
output with a +100 bias is the biased token every step, a -100 bias never appears among many
seeded draws, and the unbiased run is unchanged beside biased batch mates.
"""

from __future__ import annotations

import pytest
import torch

from pagedq.errors import InvalidParamsError, InvalidRequestError
from pagedq.params import SamplingParams
from pagedq.worker import Engine
from pagedq.worker.engine.sampler import apply_logit_bias
from pagedq.worker.engine.sequence import Request, Sequence

VOCAB = 384


def _seq(**params) -> Sequence:
    req = Request("r", None, [1, 2], SamplingParams(**params))
    return Sequence(req, 0, [1, 2], 2)


def test_the_bias_is_added_per_row_like_a_plain_loop():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    biases = [{5: 100.0, 7: -3.5}, {}, {0: -100, 383: 0.25}]
    out = logits.clone()
    apply_logit_bias(out, [_seq(logit_bias=b or None) for b in biases])
    ref = logits.clone()
    for r, b in enumerate(biases):
        for t, v in b.items():
            ref[r, t] += v
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bias, problem", [
    ({"a": 1}, "token id"), ({-1: 1}, "token id"), ({1: 100.5}, r"\[-100, 100\]"),
    ({1: float("nan")}, r"\[-100, 100\]"), ({i: 1 for i in range(1025)}, "at most 1024"),
])
def test_bad_biases_name_the_problem(bias, problem):
    with pytest.raises(InvalidParamsError, match=problem):
        SamplingParams(logit_bias=bias)


def test_string_keys_from_json_round_trip_the_wire():
    p = SamplingParams(logit_bias={"17": -100, 3: 2.5})
    assert p.logit_bias == {17: -100, 3: 2.5}
    assert SamplingParams.from_dict(p.to_dict()).logit_bias == p.logit_bias


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(str(tiny_model_dir("llama")), num_kv_blocks=512, block_size=8)


def test_plus_100_forces_and_minus_100_bans(engine):
    prompt = [7, 8, 9]
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={42: 100})
    alone = engine.generate([prompt], free)[0].outputs[0].token_ids
    both = engine.generate([prompt, prompt], [free, forced])
    assert both[0].outputs[0].token_ids == alone
    assert both[1].outputs[0].token_ids == [42] * 6
    banned = {t: -100 for t in set(alone)}
    draws = engine.generate([prompt] * 40, [SamplingParams(
        temperature=1.0, seed=s, max_tokens=3, ignore_eos=True, logit_bias=banned)
        for s in range(40)])
    assert not any(set(o.outputs[0].token_ids) & set(banned) for o in draws)


def test_a_token_outside_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("lb", [1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
