"""The spec scenario's judge (bench/spec_judge.py) on tiny seeded fp32 models.

- Its recomputation is checked against transformers (the independent oracle): the next-token
  logits after any prefix, and the plain run's greedy token at every position.
- On fp32 weights the kernels are exact enough that speculation changes no greedy token: on
  and off are identical, and the bench finds nothing to judge.
- A constructed near-tie (two lm_head rows made equal, or equal up to 1e-6) is judged a flip;
  a swap to a clearly losing token, and an output cut short, are judged unexplained.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedq.bench.spec_judge import (
    NEAR_TIE_MARGIN,
    NEAR_TIE_MARGINS,
    Difference,
    engine_logits,
    first_difference,
    judge,
    judge_all,
    margin_for,
    next_token_logits,
)
from pagedq.client import SamplingParams
from pagedq.worker import Engine
from tests.engine.test_speculative import LOOPY, NGRAM, assert_all_free, prompts
from tests.oracle import hf_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, **LOOPY)
PLAIN = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # argmax of raw logits


def make_engine(path, spec=None) -> Engine:
    return Engine(str(path), speculative_config=spec, num_kv_blocks=128, block_size=4)


def outputs(engine: Engine, ids: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(ids, params)]


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: where the shorter one ended
    assert first_difference([5], [1]) == 0


def test_recomputed_logits_are_transformers_and_the_plain_runs_tokens(llama):
    engine = make_engine(llama)
    (prompt,) = prompts([11], seed=3)
    (out,) = outputs(engine, [prompt], PLAIN)
    for cut in (0, 1, 7, len(out) - 1):
        ids = prompt + out[:cut]
        got = next_token_logits(engine, ids)
        torch.testing.assert_close(got, hf_logits(llama, ids)[-1], atol=2e-4, rtol=1e-4)
        assert int(got.argmax()) == out[cut]  # the plain run's greedy token at that position
    assert_all_free(engine)  # the judge's blocks went back to the pool
    assert outputs(engine, [prompt], PLAIN) == [out]  # the engine unharmed


def test_fp32_speculation_is_identical_so_nothing_is_judged(llama):
    ids = prompts([7, 12, 9], seed=5)
    plain = outputs(make_engine(llama), ids)
    spec_engine = make_engine(llama, NGRAM)
    spec = outputs(spec_engine, ids)
    assert spec_engine.stats()["spec_decode_num_accepted_tokens"] > 0  # verification ran
    assert spec == plain
    diffs = [Difference("w", "3", "ngram", str(i), p, g, w)
             for i, (p, g, w) in enumerate(zip(ids, spec, plain, strict=True)) if g != w]
    built = []
    assert judge_all(diffs, None, lambda: built.append(1)) == [] and not built  # no twin built
    with pytest.raises(ValueError, match="nothing to judge"):
        judge(Difference("w", "3", "ngram", "0", ids[0], plain[0], plain[0]), None, None)


def tied_model(source, dest, winner: int, rival: int, noise: float):
    """``source`` copied to ``dest`` with lm_head row ``rival`` set to row ``winner`` (plus
    ``noise`` times a seeded random row): the two tokens' logits tie, or nearly."""
    shutil.copytree(source, dest)
    weights = load_file(dest / "model.safetensors")
    head = weights["lm_head.weight"]
    g = torch.Generator().manual_seed(0)
    head[rival] = head[winner] + noise * torch.randn(head.shape[1], generator=g)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("noise", [0.0, 1e-6])
def test_constructed_near_tie_is_a_flip_and_a_clear_swap_is_not(llama, tmp_path, noise):
    (prompt,) = prompts([10], seed=8)
    (base,) = outputs(make_engine(llama), [prompt], PLAIN)
    winner = base[0]
    rival = next(t for t in range(3, 384) if t not in base)
    path = tied_model(llama, tmp_path / "tied", winner, rival, noise)
    engine = make_engine(path)
    (want,) = outputs(engine, [prompt], PLAIN)
    cut = next(i for i, t in enumerate(want) if t in (winner, rival))
    other = rival if want[cut] == winner else winner
    ours = engine_logits(engine)
    reference = lambda ids: hf_logits(path, ids)[-1]  # noqa: E731 - transformers, independent

    flip = judge(Difference("edit", "8", "ngram", "j", prompt, want[:cut] + [other] + want[cut:],
                            want), ours, reference)
    assert flip.near_tie and flip.position == cut, flip.why
    assert flip.gap_packed < NEAR_TIE_MARGIN and flip.gap_reference < NEAR_TIE_MARGIN
    assert {flip.plain_token, flip.spec_token} == {winner, rival}

    late = cut + 3  # a swap to the least likely token, past the tie
    row = reference(prompt + want[:late])
    loser = int(row.argmin())
    swap = judge(Difference("edit", "8", "suffix", "j", prompt, want[:late] + [loser], want),
                 ours, reference)
    assert not swap.near_tie and swap.position == late and swap.spec_token == loser
    assert swap.gap_packed > 1.0 and swap.gap_reference > 1.0, swap.why

    short = judge(Difference("edit", "8", "ngram", "j", prompt, want[:-2], want), ours, reference)
    assert not short.near_tie and short.gap_packed is None and "prefix" in short.why

    # judge_all builds the twin once and judges every difference
    verdicts = judge_all([Difference("edit", "8", "ngram", "j", prompt,
                                     want[:cut] + [other], want)], engine, lambda: engine)
    assert [v.near_tie for v in verdicts] == [True]
    assert_all_free(engine)


def test_bench_wiring_judges_a_forged_difference(llama):
    """spec_scenario.differences finds a differing output in a round and judge_differences
    builds the fp32 twin through the bench and calls a swap to a losing token unexplained."""
    from pagedq.bench.context import BenchContext
    from pagedq.bench.options import quick
    from pagedq.bench.spec_scenario import Batch, differences, judge_differences

    bench = BenchContext(quick(model=str(llama), num_threads=1, max_model_len=256))
    bench.setup()
    off = bench.engine(num_kv_blocks=64)
    ids = prompts([9, 6], seed=11)
    plain = outputs(off, ids, PLAIN)
    row = hf_logits(llama, ids[1] + plain[1][:4])[-1]
    forged = [plain[0], plain[1][:4] + [int(row.argmin())] + plain[1][5:]]

    def batch(method, outs):
        jobs = {f"j{i}": o for i, o in enumerate(outs)}
        return Batch(method, 0, 0, 1.0, 0, 0, dict.fromkeys(jobs, 2), dict.fromkeys(jobs, 2),
                     outputs=jobs, prompts={f"j{i}": p for i, p in enumerate(ids)})

    grid = {"edit": {"2": [[batch("off", plain), batch("ngram", forged)]]}}
    diffs = differences(grid, {"extraction": {"2": [[batch("off", plain), batch("ngram", plain)]]}})
    assert [(d.workload, d.streams, d.method, d.job) for d in diffs] == [("edit", "2", "ngram",
                                                                           "j1")]
    (verdict,) = judge_differences(bench, off, diffs, margin_for(off))
    assert not verdict.near_tie and verdict.position == 4 and verdict.gap_reference > 1.0
    assert_all_free(off)


@pytest.mark.parametrize("precision", ["bf16x2", "bf16x3", "bf16", "fp32"])
def test_the_margin_follows_the_packed_gemm_that_runs(precision):
    """AMX runs the precision asked for, so its margin is that precision's; a CPU without AMX
    runs fp32 tiles whatever is asked, so its margin is the fp32 one; a model with no packed
    weights has the fp32 one too."""
    from types import SimpleNamespace

    from pagedq.kernels import Selector
    from tests.kernels.test_backend_packed import AMX, AVX2

    def engine(cpu, packed=True):
        backend = Selector(cpu=cpu).select("cpu", torch.float32, None, 64,
                                           packed_precision=precision)
        return SimpleNamespace(backend=backend, packed_weights=packed)

    assert margin_for(engine(AMX)) == NEAR_TIE_MARGINS[precision]
    assert margin_for(engine(AVX2)) == NEAR_TIE_MARGIN
    assert margin_for(engine(AMX, packed=False)) == NEAR_TIE_MARGIN
    assert NEAR_TIE_MARGINS["bf16x2"] > NEAR_TIE_MARGINS["bf16x3"] == NEAR_TIE_MARGIN
