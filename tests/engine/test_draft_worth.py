"""Lookup drafts cut to the depths that pay for their rows (draft_worth.py), against what the
speculation governor measures a draft row to cost (a fake clock: no real time measured).

The oracle for the cut is arithmetic on the recorded acceptance: a depth is drafted exactly
while its acceptance exceeds the row cost. Through the engine, outputs with the cut equal the
outputs without speculation (transformers' greedy), whatever the cut decides.
"""

from __future__ import annotations

import pytest

from pagedq.client import SamplingParams
from pagedq.worker.config import SpeculativeConfig
from pagedq.worker.engine import draft_worth
from pagedq.worker.engine.draft_worth import EXPLORE_EVERY, MIN_WEIGHT, DepthCounts, DraftWorth
from pagedq.worker.engine.drafts import Drafter
from pagedq.worker.engine.spec_governor import SpecGovernor
from tests.engine.test_spec_governor import FakeClock
from tests.engine.test_speculative import make_engine, repetitive, token_ids
from tests.oracle import assert_greedy

NEW = DepthCounts()  # a sequence that has verified no draft yet: the kind's rates decide


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def teach(worth: DraftWorth, rates: list[float], drafts: int = 200, constrained=False) -> None:
    """``drafts`` drafts of len(rates) looked-up tokens whose depth j is accepted at rates[j]
    (accepted lengths spread evenly over the drafts, so every depth's decayed share comes out
    as given)."""
    for i in range(drafts):
        accepted = sum(1 for r in rates if (i * 61) % 100 < r * 100)
        worth.verified(DepthCounts(), constrained, 0, len(rates), accepted)


def test_depths_are_cut_where_acceptance_falls_below_the_row_cost():
    worth = DraftWorth()
    teach(worth, [0.9, 0.6, 0.3, 0.1])
    rates = worth.snapshot()["free"]
    assert rates == pytest.approx([0.9, 0.6, 0.3, 0.1], abs=0.02)
    worth.proposals[False] = 1  # no exploring proposal in these calls
    assert worth.depth(NEW, False, 0.05, 6) == 6  # one stream: every measured depth pays
    worth.proposals[False] = 1
    assert worth.depth(NEW, False, 0.5, 6) == 2  # 8 streams: the first two
    worth.proposals[False] = 1
    assert worth.depth(NEW, False, 0.95, 6) == 0  # rows dearer than any lookup: none
    assert worth.depth(NEW, False, None, 6) == 6  # the cost unmeasured: no cut
    assert worth.depth(NEW, False, 0.05, 3) == 3  # never more than asked


def test_unjudged_depths_are_drafted_and_kinds_are_apart():
    worth = DraftWorth()
    teach(worth, [0.9, 0.1], drafts=int(MIN_WEIGHT) - 1)
    worth.proposals[False] = 1
    assert worth.depth(NEW, False, 0.5, 4) == 4  # too few drafts to judge any depth yet
    teach(worth, [0.2], constrained=True)
    worth.proposals[True] = 1
    assert worth.depth(NEW, True, 0.5, 4) == 0
    worth.proposals[False] = 1
    assert worth.depth(NEW, False, 0.5, 4) == 4  # the grammar's kind decides nothing for the free


def test_a_cut_depth_is_explored_and_returns_when_the_workload_copies():
    worth = DraftWorth()
    teach(worth, [0.1])
    depths = [worth.depth(NEW, False, 0.5, 4) for _ in range(4 * EXPLORE_EVERY)]
    assert depths.count(1) == 4 and depths.count(0) == 4 * EXPLORE_EVERY - 4
    teach(worth, [1.0, 1.0, 1.0, 1.0], drafts=400)  # copying now: the decay lets it show
    worth.proposals[False] = 1
    assert worth.depth(NEW, False, 0.5, 4) == 4


def test_a_sequence_that_copies_nothing_stops_drafting_among_ones_that_copy():
    """Edit and chat jobs are both unconstrained: the kind's rate (edit's, 0.9) is only a prior
    worth a few drafts against a sequence's own; a chat sequence whose 6 first lookups failed
    drafts none at 8 streams' row cost, a fresh one and one whose lookups held still do."""
    worth = DraftWorth()
    teach(worth, [0.9, 0.9, 0.9])
    chat, edit = DepthCounts(), DepthCounts()
    for _ in range(6):
        worth.verified(chat, False, 0, 1, 0)
        worth.verified(edit, False, 0, 3, 3)
    kind = worth.kinds[False].rate(0)
    assert kind > 0.85 and worth.estimate(chat, False, 0) == pytest.approx(4 * kind / 10)
    worth.proposals[False] = 1
    assert worth.depth(chat, False, 0.5, 3) == 0
    assert worth.depth(edit, False, 0.5, 3) == 3
    assert worth.depth(NEW, False, 0.5, 3) == 3


def test_grammar_forced_tokens_are_not_counted_as_lookups():
    worth = DraftWorth()
    for _ in range(50):
        worth.verified(DepthCounts(), True, 3, 5, 2)  # a forced token refused: no lookup reached
        worth.verified(DepthCounts(), True, 3, 5, 4)  # the forced ones and the first lookup kept
        worth.verified(DepthCounts(), True, 3, 3, 3)  # forced tokens only: nothing looked up
    assert worth.snapshot()["constrained"] == pytest.approx([0.5, 0.0], abs=0.01)


def test_the_governor_measures_what_a_draft_row_costs():
    """Plain steps: 8 rows in 8 s; drafted steps: 8 + 8 draft rows in 14 s, so a draft row
    adds 0.75 s against plain's 1 s a row (a token): cost 0.75. One stream: 1 row in 3 s,
    1 + 4 rows in 4 s: 0.25 s a draft row, cost 1/12."""
    clock = FakeClock()
    gov = SpecGovernor(64, clock=clock)
    for batch, plain_s, rows, drafted_s, want in ((8, 8.0, 16, 14.0, 0.75),
                                                  (1, 3.0, 5, 4.0, 1 / 12)):
        assert gov.decide(batch) is True and gov.draft_row_cost() is None
        for _ in range(40):
            speculate = gov.decide(batch)
            clock.now += drafted_s if speculate else plain_s
            gov.record(2 * batch if speculate else batch, rows=rows if speculate else batch)
        gov.decide(batch)
        assert gov.draft_row_cost() == pytest.approx(want)
        name = "8-15" if batch == 8 else "1"
        assert gov.snapshot()["buckets"][name]["draft_row_cost"] == pytest.approx(want, abs=1e-3)


def test_the_drafter_cuts_lookups_to_what_pays(llama):
    """With rows measured dear and the first lookup depth rarely accepted, a sequence whose
    lookup matches drafts nothing; with rows cheap it drafts as before."""
    engine = make_engine(llama)
    seq = engine.add_request("r", [1, 2, 1, 2, 1], SamplingParams(max_tokens=50)).seqs[0]
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), max_model_len=100)
    teach(drafter.worth, [0.3, 0.2, 0.1, 0.05])
    drafter.worth.proposals[False] = 1
    drafter.governor.draft_row_cost = lambda: 0.6
    assert drafter.propose(seq, budget=100) == []
    drafter.governor.draft_row_cost = lambda: 0.25
    drafter.worth.proposals[False] = 1
    assert drafter.propose(seq, budget=100) == [2]  # depth 0 (0.3) pays, depth 1 (0.2) not
    drafter.verified(seq, 1, 0)
    stats = drafter.stats()
    assert stats["spec_lookup_acceptance_by_depth"]["free"][0] == pytest.approx(0.3, abs=0.02)


def test_outputs_with_the_cut_equal_off_and_transformers(tiny_family_dir, monkeypatch):
    """Greedy through the engine with the row cost flipping between free and dearer than any
    token each proposal (every depth judged at once): the tokens of speculation off, and
    transformers' greedy; drafts were cut and drafts were verified."""
    monkeypatch.setattr(draft_worth, "MIN_WEIGHT", 0.0)
    _, path = tiny_family_dir
    ps = repetitive(seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    off = token_ids(make_engine(path).generate(ps, params))
    engine = make_engine(path, {"method": "ngram", "num_speculative_tokens": 4,
                                "adaptive": False})
    costs = iter([0.0, 2.0] * 10_000)
    engine.drafter.governor.draft_row_cost = lambda: next(costs)
    worth, cut = engine.drafter.worth, []
    depth = worth.depth

    def judged(own, constrained, cost, most):
        kept = depth(own, constrained, cost, most)
        cut.append(kept < most)
        return kept

    worth.depth = judged
    on = engine.generate(ps, params)
    assert token_ids(on) == off
    for p, o in zip(ps, on, strict=True):
        assert_greedy(path, p, o.outputs[0].token_ids)
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert any(cut)  # the cut ran: some proposals kept fewer lookup depths than asked


def test_a_draft_row_costs_its_slope_not_the_fixed_cost_of_drafting():
    """Drafted steps of 8 sequences with 2-20 draft rows take plain's 8 s, plus 3 s whatever
    their size (looking up, verifying), plus 0.5 s a draft row: a row costs 0.5 of a token, not
    the 0.5 + 3 / rows that dividing by the rows would say."""
    clock = FakeClock()
    gov = SpecGovernor(64, clock=clock)
    sizes = iter([2, 20, 5, 11, 8, 14, 3, 17] * 20)
    for _ in range(120):
        speculate = gov.decide(8)
        drafts = next(sizes) if speculate else 0
        clock.now += 8.0 + (3.0 + 0.5 * drafts if speculate else 0.0)
        gov.record(8 + drafts // 2, rows=8 + drafts)
    gov.decide(8)
    assert gov.draft_row_cost() == pytest.approx(0.5, rel=0.02)
