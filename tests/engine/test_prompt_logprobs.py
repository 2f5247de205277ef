"""Prompt logprobs (vLLM's semantics) against transformers' own forward pass.

Oracle: the fp32 log_softmax of transformers' logits over the whole prompt; position i's
entry is row i - 1 (the first position has none), its rank is vLLM's count of logprobs >= the
token's, and the top-k are that row's best k. Chunked prefill (prompts longer than the step's
token budget) and prefix caching (the prompt cached by an earlier request) must not change it.
"""

from __future__ import annotations

import msgpack
import pytest
import torch

from pagedq.client.protocol import F_EVENT, F_SEQ, TOKENS, Event, decode_event, encode_event
from pagedq.errors import InvalidParamsError
from pagedq.logprobs import PromptLogprobs
from pagedq.params import SamplingParams
from pagedq.worker import Engine
from tests.oracle import hf_logits

TOL = 2e-4


def _prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def assert_matches_hf(path, prompt: list[int], got: PromptLogprobs, k: int) -> None:
    ref = torch.log_softmax(hf_logits(path, prompt), dim=-1)
    assert got.token_ids == prompt
    assert got.logprobs[0] is None and got.ranks[0] is None and got.top[0] is None
    for i in range(1, len(prompt)):
        row = ref[i - 1]
        want = float(row[prompt[i]])
        assert got.logprobs[i] == pytest.approx(want, abs=TOL), f"position {i}"
        assert got.ranks[i] == int((row >= row[prompt[i]]).sum()), f"position {i}"
        vals, ids = row.topk(k)
        assert list(got.top[i]) == ids.tolist(), f"position {i}"
        assert list(got.top[i].values()) == pytest.approx(vals.tolist(), abs=TOL)


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(path):
    # a 24-token budget: the 70- and 100-token prompts prefill in several chunks
    return Engine(str(path), num_kv_blocks=512, block_size=4, max_num_batched_tokens=24,
                  enable_prefix_caching=True)


def _run(engine: Engine, prompts, params) -> dict[str, tuple[PromptLogprobs | None, list]]:
    """Step the engine over ``prompts``; per request: its prompt logprobs from the stream
    deltas (sample 0's first delta only) and every delta."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    got: dict[str, tuple[PromptLogprobs | None, list]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            lp, deltas = got.setdefault(out.request_id, (None, []))
            deltas.append(out)
            if out.prompt_logprobs is not None:
                assert lp is None, "prompt logprobs came twice"
                assert out.index == 0
                got[out.request_id] = (out.prompt_logprobs, deltas)
    return got


def test_chunked_prefill_matches_transformers(engine, path):
    prompts = _prompts([1, 2, 5, 23, 24, 25, 70, 100])
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=4)
    got = _run(engine, prompts, params)
    for i, p in enumerate(prompts):
        assert_matches_hf(path, p, got[f"r{i}"][0], 4)


def test_a_cached_prompt_is_computed_again_and_still_cached_for_others(engine, path):
    (prompt,) = _prompts([61], seed=11)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([prompt], plain)  # caches the prompt's full blocks
    asking = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    out = engine.generate([prompt], asking)[0]
    assert out.num_cached_tokens == 0  # it read nothing from the cache
    ref = torch.log_softmax(hf_logits(path, prompt), dim=-1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert next(iter(entry)) == prompt[i]  # the prompt token first, then the top-k
        assert entry[prompt[i]] == pytest.approx(float(ref[i - 1, prompt[i]]), abs=TOL)
        assert set(ref[i - 1].topk(2).indices.tolist()) <= set(entry)
    again = engine.generate([prompt], plain)[0]
    assert again.num_cached_tokens == 60  # 15 full blocks of 4: caching still serves others


def test_k0_gives_only_the_prompt_token_and_batch_mates_are_unchanged(engine, path):
    prompts = _prompts([40, 33], seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    alone = engine.generate([prompts[1]], greedy)[0].outputs[0].token_ids
    asking = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=0)
    outs = engine.generate(prompts, [asking, greedy])
    assert outs[1].outputs[0].token_ids == alone
    assert outs[1].prompt_logprobs is None
    dicts = outs[0].prompt_logprobs
    assert dicts[0] is None and all(list(d) == [prompts[0][i]] for i, d in
                                    enumerate(dicts) if i)
    ref = torch.log_softmax(hf_logits(path, prompts[0]), dim=-1)
    got = torch.tensor([d[prompts[0][i]] for i, d in enumerate(dicts) if i])
    want = ref[torch.arange(len(prompts[0]) - 1), torch.tensor(prompts[0][1:])]
    assert torch.allclose(got, want, atol=TOL)


def test_n2_carries_them_once_on_sample_0(engine, path):
    (prompt,) = _prompts([30], seed=7)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=1)
    got = _run(engine, [prompt], params)
    lp, deltas = got["r0"]
    assert {d.index for d in deltas} == {0, 1}
    assert_matches_hf(path, prompt, lp, 1)


def test_preempted_prefill_collects_each_position_once(path):
    """A pool too small for both prompts: one is preempted mid-prefill and recomputed."""
    engine = Engine(str(path), num_kv_blocks=40, block_size=4, max_num_batched_tokens=16,
                    enable_prefix_caching=True)
    prompts = _prompts([90, 90], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, prompt_logprobs=2)
    got = _run(engine, prompts, [params, params])
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        assert_matches_hf(path, p, got[f"r{i}"][0], 2)


def test_beam_search_carries_them_once_on_its_first_delta(engine, path):
    """Beams stream nothing until the search ends; that first delta (the best beam's) carries
    the prompt's logprobs once, as sample 0's first delta does for sampling."""
    from pagedq.worker.engine.beam_search import BeamParams, add_beam_request

    prompts = _prompts([45, 7], seed=13)  # 45 tokens: several chunks of the 24-token budget
    for i, p in enumerate(prompts):
        add_beam_request(engine, f"b{i}", p, BeamParams(beam_width=3, max_tokens=4,
                                                        prompt_logprobs=3))
    deltas: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    for i, p in enumerate(prompts):
        carrying = [d for d in deltas[f"b{i}"] if d.prompt_logprobs is not None]
        assert len(carrying) == 1 and carrying[0] is deltas[f"b{i}"][0]
        assert carrying[0].index == 0 and len(deltas[f"b{i}"]) == 3
        assert_matches_hf(path, p, carrying[0].prompt_logprobs, 3)
    (out,) = engine.beam_search([prompts[1]], beam_width=2, max_tokens=3, prompt_logprobs=1)
    ref = torch.log_softmax(hf_logits(path, prompts[1]), dim=-1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompts[1])):
        assert out.prompt_logprobs[i][prompts[1][i]] == pytest.approx(
            float(ref[i - 1, prompts[1][i]]), abs=TOL)
    plain = engine.beam_search([prompts[1]], beam_width=2, max_tokens=3)[0]
    assert plain.prompt_logprobs is None
    assert [b.token_ids for b in plain] == [b.token_ids for b in out]  # asking changes no beam


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_values_name_the_field(bad):
    with pytest.raises(InvalidParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_params_and_events_round_trip_the_wire():
    p = SamplingParams(prompt_logprobs=3)
    assert SamplingParams.from_dict(p.to_dict()).prompt_logprobs == 3
    assert "prompt_logprobs" not in SamplingParams().to_dict()  # older workers know no key
    lp = PromptLogprobs([5, 9, 7], [None, -1.5, -0.25], [None, 4, 1],
                        [None, {3: -0.5, 9: -1.5}, {7: -0.25}])
    ev = Event(TOKENS, "req-1", index=0, token_ids=[4], text="x", position=1,
               prompt_logprobs=lp)
    back = decode_event({F_EVENT: encode_event(ev), F_SEQ: b"1"})
    assert back.prompt_logprobs == lp
    assert lp.as_dicts() == [None, {9: -1.5, 3: -0.5}, {7: -0.25}]
    body = msgpack.unpackb(encode_event(ev), raw=False)
    body["prompt_logprobs"]["ranks"] = [None]
    with pytest.raises(Exception, match="prompt_logprobs"):
        decode_event({F_EVENT: msgpack.packb(body), F_SEQ: b"1"})
