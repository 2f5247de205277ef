"""The speculation governor's decisions, driven by a fake clock (no real time measured).

Each simulated step asks the governor, then advances the clock by what the chosen mode costs
and reports the tokens it made: the governor must settle on the faster mode per batch-size
bucket, re-try the other with a doubling back-off, and follow a change of workload or load.
Through the engine, a governor flipping speculation on and off between steps must change no
token (the oracle: the same requests with speculation off, and transformers' greedy).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pagedq.client import SamplingParams
from pagedq.worker.engine.spec_governor import (
    EXPLORE_AT_MOST,
    EXPLORE_EVERY,
    TRY_STEPS,
    SpecGovernor,
    bucket_name,
)
from tests.engine.test_speculative import (
    LOOPY,
    NGRAM,
    SUFFIX,
    accepted,
    assert_all_free,
    make_engine,
    prompts,
    repetitive,
    token_ids,
)
from tests.oracle import assert_greedy

Cost = Callable[[bool], tuple[int, float]]  # speculate? -> (tokens made, seconds taken)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pays(speculate: bool) -> tuple[int, float]:
    """An edit-like step: speculation makes 4 tokens in 1.2 s, plain decoding 1 in 1 s."""
    return (4, 1.2) if speculate else (1, 1.0)


def loses(speculate: bool) -> tuple[int, float]:
    """An extraction-like step at a large batch: 1.15 tokens for 1.3 s against 1 for 1 s."""
    return (115, 130.0) if speculate else (100, 100.0)


def run(gov: SpecGovernor, clock: FakeClock, batch: int, cost: Cost, steps: int) -> list[bool]:
    """``steps`` decode-only steps of ``batch`` sequences; the decisions taken."""
    out = []
    for _ in range(steps):
        speculate = gov.decide(batch)
        tokens, seconds = cost(speculate)
        clock.now += seconds
        gov.record(tokens)
        out.append(speculate)
    return out


def tries(decisions: list[bool], chosen: bool) -> list[int]:
    """Step indexes where a try of the other choice began."""
    return [i for i, d in enumerate(decisions)
            if d != chosen and (i == 0 or decisions[i - 1] == chosen)]


def test_buckets_are_powers_of_two():
    assert [bucket_name(s) for s in (1, 2, 3, 6)] == ["1", "2-3", "4-7", "32-63"]


def test_settles_on_the_faster_choice_with_a_doubling_back_off():
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    decisions = run(gov, clock, 1, pays, 2000)
    # both measured first (speculation first), then speculation nearly always
    assert decisions[:2 * TRY_STEPS] == [True] * TRY_STEPS + [False] * TRY_STEPS
    starts = tries(decisions[2 * TRY_STEPS:], True)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[:3] == [2 * EXPLORE_EVERY + TRY_STEPS, 4 * EXPLORE_EVERY + TRY_STEPS,
                        8 * EXPLORE_EVERY + TRY_STEPS]
    assert max(gaps) <= EXPLORE_AT_MOST + TRY_STEPS
    assert gov.snapshot()["speculating"] == ["1"]
    bucket = gov.snapshot()["buckets"]["1"]
    assert (bucket["seq_tok_s_spec"], bucket["seq_tok_s_plain"]) == (round(4 / 1.2, 3), 1.0)


def test_turns_speculation_off_where_it_loses_per_bucket():
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    run(gov, clock, 1, pays, 200)
    late = run(gov, clock, 40, loses, 400)[2 * TRY_STEPS:]
    assert late.count(True) <= TRY_STEPS * len(tries(late, False))
    assert sum(late) < len(late) // 10
    snap = gov.snapshot()
    assert snap["speculating"] == ["1"]
    assert snap["buckets"]["32-63"]["speculate"] is False
    assert run(gov, clock, 1, pays, 10).count(True) >= 9  # batch 1 kept its own choice


def test_follows_a_workload_change_in_both_directions():
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    run(gov, clock, 8, pays, 2000)  # long enough for the back-off to reach its maximum
    after = run(gov, clock, 8, loses, EXPLORE_AT_MOST + 2 * TRY_STEPS)
    switched = after.index(False)
    # speculation's running mean falls below plain's last rate within a few steps (the first
    # slow step counted as a pause): a try at once
    assert switched < 12
    assert not any(after[switched + TRY_STEPS:switched + TRY_STEPS + EXPLORE_EVERY - TRY_STEPS])
    # plain steps cannot show that drafts would be accepted again: the periodic try finds it,
    # within the longest back-off
    back = run(gov, clock, 8, pays, EXPLORE_AT_MOST + 2 * TRY_STEPS + EXPLORE_EVERY)
    assert back[-EXPLORE_EVERY:].count(False) <= TRY_STEPS  # at most a try of plain again
    assert gov.snapshot()["buckets"]["8-15"]["speculate"] is True


def test_one_paused_step_decides_nothing():
    """A step slowed 20x by something not its own (a garbage collection, the host taking the
    core) counts as twice a typical step: speculation, paying 3.3x here, stays chosen and no
    try of plain decoding starts early."""
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    run(gov, clock, 2, pays, 300)
    steps = gov.snapshot()["buckets"]["2-3"]["steps"]
    rate = gov.snapshot()["buckets"]["2-3"]["seq_tok_s_spec"]

    def paused(speculate: bool) -> tuple[int, float]:
        tokens, seconds = pays(speculate)
        return tokens, 20 * seconds

    assert run(gov, clock, 2, paused, 1) == [True]
    assert run(gov, clock, 2, pays, 20) == [True] * 20
    snap = gov.snapshot()["buckets"]["2-3"]
    assert snap["steps"] == steps + 21 and snap["seq_tok_s_spec"] == pytest.approx(rate, rel=0.01)


def test_follows_load_that_slows_both_choices_without_switching():
    """A busy machine slows every step 3x: the governor re-measures plain decoding (its last
    rate is stale) and keeps speculating, since it still pays."""
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    run(gov, clock, 2, pays, 300)

    def busy(speculate: bool) -> tuple[int, float]:
        tokens, seconds = pays(speculate)
        return tokens, 3 * seconds

    decisions = run(gov, clock, 2, busy, 300)
    assert decisions.count(False) <= 3 * TRY_STEPS
    plain = gov.snapshot()["buckets"]["2-3"]["seq_tok_s_plain"]
    assert plain == round(1 / 3 / 2, 3)  # per running sequence


def test_batch_sizes_within_a_bucket_compare_per_sequence():
    """Weight-bandwidth-bound steps (1 s at any batch): speculation makes 1.2 tokens per
    sequence in 1.1 s. The batch drains from 7 to 4 and refills; the tries of plain decoding
    land on the large batches, yet speculation stays chosen."""
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    decisions = []
    for i in range(600):
        batch = 4 if i % 64 < 40 else 7
        speculate = gov.decide(batch)
        clock.now += 1.1 if speculate else 1.0
        gov.record(round(1.2 * batch) if speculate else batch)
        decisions.append(speculate)
    assert gov.snapshot()["speculating"] == ["4-7"]
    assert decisions[2 * TRY_STEPS:].count(False) <= 6 * TRY_STEPS  # the back-off's tries


def test_cap_and_adaptive_off():
    clock = FakeClock()
    gov = SpecGovernor(max_batch=16, clock=clock)
    assert not any(run(gov, clock, 16, pays, 50))
    assert gov.by_size == {}  # steps at the cap are not measured
    forced = SpecGovernor(max_batch=16, adaptive=False, clock=clock)
    assert all(run(forced, clock, 15, loses, 50))
    assert not any(run(forced, clock, 40, pays, 5))
    assert forced.snapshot() == {"adaptive": False, "max_batch": 16, "speculating": [],
                                 "buckets": {}}


def test_steps_with_prefill_or_no_record_are_not_measured():
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    for _ in range(10):
        gov.decide(4)
        clock.now += 100.0
        gov.record(1, decode_only=False)  # a prefill chunk rode along
        gov.decide(4)  # a step that scheduled nothing: no record follows
        clock.now += 100.0
    assert gov.by_size[3].steps == 0
    assert gov.snapshot()["buckets"]["4-7"]["seq_tok_s_spec"] is None


def run_mixed(gov: SpecGovernor, clock: FakeClock, drafted_cost: Cost, steps: int,
              every: int = 3) -> list[bool]:
    """``steps`` one-sequence steps where every ``every``-th speculating step finds no draft
    (it runs, and is recorded as, a plain step: 1 token in 1 s); the decisions taken."""
    out = []
    for i in range(steps):
        speculate = gov.decide(1)
        drafted = speculate and i % every != 0
        tokens, seconds = drafted_cost(True) if drafted else drafted_cost(False)
        clock.now += seconds
        gov.record(tokens, drafted=drafted)
        out.append(speculate)
    return out


def test_draftless_steps_measure_plain_decoding_without_tries():
    """Where speculating steps regularly find no draft (one stream on extraction), those steps
    are plain steps: they give plain decoding its figure, so the governor never spends a step
    on a try of plain decoding while speculation pays, and the figures are the modes' own."""
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    decisions = run_mixed(gov, clock, pays, 600)
    assert all(decisions)
    bucket = gov.snapshot()["buckets"]["1"]
    assert bucket["speculate"] is True
    assert (bucket["seq_tok_s_spec"], bucket["seq_tok_s_plain"]) == (round(4 / 1.2, 3), 1.0)


def test_draftless_steps_turn_speculation_off_where_drafted_steps_lose():
    """Drafted steps that lose (1.15 tokens for 1.3 s against plain's 1 for 1 s), measured
    against the free plain figure: speculation is dropped, and re-tried only with the
    doubling back-off."""
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)

    def loses_one(speculate: bool) -> tuple[int, float]:
        tokens, seconds = loses(speculate)
        return tokens // 100, seconds / 100  # one sequence: 1 token (1.15 rounds down) in 1.3 s

    late = run_mixed(gov, clock, loses_one, 1000)[4 * TRY_STEPS:]
    assert gov.snapshot()["buckets"]["1"]["speculate"] is False
    assert sum(late) < len(late) // 10


# -- through the engine: the governor flipping mid-request changes no token -------------------
@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def flipping_governor(engine, seed: int) -> list[bool]:
    """Replace the engine's governor by one on a fake clock of random step times, trying the
    other choice every other step: it turns speculation on and off while requests run. Returns
    the list its decisions (below the cap) are appended to."""
    rng = random.Random(seed)
    now = [0.0]

    def clock() -> float:
        now[0] += rng.uniform(0.001, 0.02)
        return now[0]

    gov = SpecGovernor(max_batch=128, explore_every=2, try_steps=1, clock=clock)
    decisions: list[bool] = []
    decide = gov.decide

    def recording(batch: int) -> bool:
        decisions.append(decide(batch))
        return decisions[-1]

    gov.decide = recording
    engine.drafter.governor = gov
    return decisions


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX])
def test_output_unchanged_while_the_governor_flips(llama, spec):
    """Greedy (plain, checked against transformers too, and with a repetition penalty) and
    seeded sampling, all running together while speculation turns on and off between steps."""
    ps = repetitive(seed=1) + prompts([7, 19], seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.0, max_tokens=40, **LOOPY),
        SamplingParams(temperature=0.9, seed=7, max_tokens=40, frequency_penalty=-1.5,
                       ignore_eos=True)]
    off = make_engine(llama).generate(ps, params)
    engine = make_engine(llama, {**spec, "adaptive": True})
    decisions = flipping_governor(engine, seed=11)
    on = engine.generate(ps, params)
    assert token_ids(on) == token_ids(off)
    for p, o in zip(ps[:4], on[:4], strict=True):
        assert_greedy(llama, p, o.outputs[0].token_ids)
    flips = sum(a != b for a, b in zip(decisions, decisions[1:], strict=False))
    assert flips >= 4, decisions  # speculation went on and off while the requests ran
    assert accepted(engine) > 0
    assert engine.stats()["spec_governor"]["adaptive"] is True
    assert_all_free(engine)


def test_engine_reports_the_governor(llama):
    engine = make_engine(llama, {**NGRAM, "adaptive": True, "disable_by_batch_size": 64})
    engine.generate(repetitive(seed=2)[:2], SamplingParams(temperature=0.0, max_tokens=24,
                                                           ignore_eos=True))
    snap = engine.stats()["spec_governor"]
    assert snap["adaptive"] is True and snap["max_batch"] == 64
    assert set(snap["buckets"]) <= {"1", "2-3"} and snap["buckets"]
    assert all(b["steps"] > 0 for b in snap["buckets"].values())
    assert snap["speculating"] == [k for k, b in snap["buckets"].items() if b["speculate"]]
    assert "spec_governor" not in make_engine(llama).stats()


def test_long_drafted_steps_are_not_taken_for_pauses():
    """Drafted steps whose yield swings with their draft rows (open chat at 8 streams: 8-34
    tokens in 7-46 ms): a long step is long because it verified many rows, not because the
    machine paused. Here plain decoding makes 8 tokens from 8 rows in 7 s; three drafted
    steps in four are short (9 tokens, 16 rows, 9 s) and one is long (30 tokens, 56 rows,
    40 s): 57 tokens in 67 s, 0.85 of plain's rate, though the long steps alone beat it.
    Capped at twice a typical step, the long steps had kept their tokens and lost half their
    time, and speculation read 1.1x plain: the governor must settle on plain decoding."""
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)
    drafted = 0
    decisions = []
    for _ in range(600):
        speculate = gov.decide(8)
        if speculate:
            tokens, rows, seconds = (30, 56, 40.0) if drafted % 4 == 3 else (9, 16, 9.0)
            drafted += 1
        else:
            tokens, rows, seconds = 8, 8, 7.0
        clock.now += seconds
        gov.record(tokens, rows=rows)
        decisions.append(speculate)
    assert gov.snapshot()["buckets"]["8-15"]["speculate"] is False
    assert sum(decisions[100:]) < len(decisions[100:]) // 10


def test_a_turned_over_batch_tries_speculation_again():
    """Plain decoding chosen over many steps (its back-off at its longest), then the batch's
    jobs change to ones whose drafts pay: once as many requests have finished as the bucket's
    smallest batch, speculation is tried at once and taken, not after the back-off."""
    clock = FakeClock()
    gov = SpecGovernor(max_batch=128, clock=clock)

    def chat(speculate: bool) -> tuple[int, float]:  # 8 sequences: drafts lose (0.87x)
        return (9, 1.3) if speculate else (8, 1.0)

    def edit(speculate: bool) -> tuple[int, float]:  # drafts pay (2x)
        return (24, 1.5) if speculate else (8, 1.0)

    run(gov, clock, 8, chat, 3000)
    assert gov.by_size[4].interval == EXPLORE_AT_MOST
    assert not any(run(gov, clock, 8, edit, 2 * TRY_STEPS))  # no try within the back-off yet
    for _ in range(7):
        gov.sequence_finished()
    assert not any(run(gov, clock, 8, edit, 2 * TRY_STEPS))  # 7 of a bucket of 8-15: not yet
    gov.sequence_finished()
    after = run(gov, clock, 8, edit, 40)
    assert all(after[:3 * TRY_STEPS])  # the try at once, then speculation chosen
    assert after.count(False) <= 2 * TRY_STEPS  # plain decoding's tries, backing off
    assert gov.snapshot()["buckets"]["8-15"]["speculate"] is True


def test_a_turned_over_batch_leaves_a_losing_speculation_sooner():
    """Speculating over edit jobs (2x), then chat jobs whose drafted steps lose by less than
    REACT (0.93x plain: the running means never react): the drafted steps' sums turn only as
    the edit jobs' steps decay. A governor told of the batch's turnovers (8 sequences end every
    12 steps) weighs the old jobs half at each and settles on plain decoding sooner than one
    that is not told, and both end there."""
    def edit(speculate: bool) -> tuple[int, float]:
        return (24, 1.5) if speculate else (8, 1.0)

    def chat(speculate: bool) -> tuple[int, float]:
        return (12, 1.6) if speculate else (8, 1.0)  # 7.5 against 8 tokens a second

    switched = []
    for told in (True, False):
        clock = FakeClock()
        gov = SpecGovernor(max_batch=128, clock=clock)
        run(gov, clock, 8, edit, 200)
        decisions = []
        for step in range(400):
            if told and step % 12 == 0:
                for _ in range(8):
                    gov.sequence_finished()
            decisions += run(gov, clock, 8, chat, 1)
        assert gov.snapshot()["buckets"]["8-15"]["speculate"] is False
        switched.append(decisions.index(False))
    assert switched[0] < switched[1], switched
