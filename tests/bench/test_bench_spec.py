"""The bench's ``spec`` scenario: end to end on a random-weight model with the bundled
tokenizer (structure and exactness only, never timings), and its figures against hand-worked
batches."""

from __future__ import annotations

import pytest

from pagedq.bench.options import quick
from pagedq.bench.report import markdown, table
from pagedq.bench.run import run_bench
from pagedq.bench.spec_judge import NEAR_TIE_MARGIN
from pagedq.bench.spec_scenario import Batch, figures, learning, tokens_per_step
from pagedq.bench.spec_scenario import markdown as spec_markdown
from tests.engine.structured_cases import build_random_model


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    model = build_random_model(tmp_path_factory.mktemp("random-smol-vocab"))
    # spec_rounds shorter than spec_streams: its last value repeats (a sweep needs one value)
    config = quick(model=str(model), num_threads=1, max_model_len=1024, scenarios=("spec",),
                   spec_streams=(1, 3), spec_rounds=(1,), spec_learning_streams=3,
                   spec_learning_rounds=2, spec_max_tokens=12, spec_threshold_streams=(2,),
                   spec_threshold_rounds=2)
    doc, _ = run_bench(config)
    return doc


def test_spec_figures(doc):
    assert doc["errors"] == {}
    spec = doc["spec"]
    assert set(spec["cells"]) == {"extraction", "edit", "chat"}
    for workload, cells in spec["cells"].items():
        assert set(cells) == {"1", "3"}
        for streams, cell in cells.items():
            assert set(cell["tok_s"]) == {"off", "ngram", "suffix"}
            assert all(v > 0 for v in cell["tok_s"].values())
            # greedy on fp32 weights: speculation changes no token
            assert cell["outputs_differ"] == {"ngram": 0, "suffix": 0}
            expected = 2 if (workload, streams) == ("extraction", "3") else 1
            jobs = expected * int(streams)
            assert cell["outputs"] == dict.fromkeys(("ngram", "suffix"), {
                "requests": jobs, "identical": jobs, "near_tie_flips": 0, "unexplained": 0})
            assert cell["tokens_per_step"]["off"] == pytest.approx(1.0)
            assert cell["rounds"] == expected and cell["jobs"] == jobs
    assert spec["learning"] == {"jobs": 7, "note": "fewer than 51 extraction jobs"}
    (row,) = spec["threshold"]
    assert row["workload"] == "extraction"
    assert row["streams"] == 2 and row["identical"] and row["ratio"] > 0
    assert row["rounds"] == 2 and len(row["round_ratios"]) == 2
    assert row["outputs"]["identical"] == 4 and row["outputs"]["unexplained"] == 0
    # the governed engine beside forced-on ngram: its outputs are off's too
    assert row["governed_ratio"] > 0 and len(row["governed_round_ratios"]) == 2
    assert row["governed_outputs"]["identical"] == 4
    governed = spec["governors"]["threshold_governed"]
    assert governed["adaptive"] is True and governed["buckets"]
    assert spec["governors"]["grid_ngram"]["adaptive"] is True
    # 3 workloads x (1 + 3 jobs) + 3 more extraction jobs, twice (ngram, suffix); 4 threshold
    # jobs twice (forced-on and governed ngram)
    assert spec["compared_requests"] == 2 * (3 * 4 + 3) + 2 * 4
    assert spec["unexplained_differences"] == 0 and spec["near_tie_flips"] == 0
    assert spec["differences"] == [] and spec["tie_margin"] == NEAR_TIE_MARGIN
    assert spec["disable_by_batch_size"] >= 1
    assert spec["suffix_stats"]["spec_suffix_requests"] > 0
    assert "tok/s off" in markdown(doc) and "tok/s off" in table(doc)
    assert "governed ngram" in markdown(doc) and "Governor after the sweep" in markdown(doc)
    assert "0 unexplained differences" in markdown(doc)


def test_sweep_rounds_and_workload_subset(tmp_path):
    from pagedq.bench.spec_scenario import rounds_for

    assert [rounds_for((32, 40, 48), (2,), s) for s in (32, 40, 48)] == [2, 2, 2]
    assert [rounds_for((1, 8, 64), (2, 2, 1), s) for s in (1, 8, 64)] == [2, 2, 1]
    assert rounds_for((1, 8, 64, 96), (2, 3), 96) == 3
    settings = quick().with_settings(["spec_streams=32,40,48,56,64",
                                      "spec_workloads=extraction", "spec_tie_margin=0.05"])
    assert settings.spec_streams == (32, 40, 48, 56, 64)
    assert settings.spec_workloads == ("extraction",) and settings.spec_tie_margin == 0.05


def batch(method, tokens, steps, drafted=0, accepted=0):
    return Batch(method=method, tokens=sum(tokens.values()), decode_tokens=10, decode_s=1.0,
                 drafted=drafted, accepted=accepted, steps_per_job=steps, tokens_per_job=tokens,
                 outputs={k: [1] * n for k, n in tokens.items()})


def test_tokens_per_step_and_learning_by_hand():
    # job a: 9 tokens in 4 steps (1 prefill + 3 decode steps: 8 decode tokens / 3)
    b = batch("ngram", {"a": 9, "b": 5}, {"a": 4, "b": 5})
    assert tokens_per_step([b]) == pytest.approx((8 + 4) / (3 + 4))
    assert tokens_per_step([b], 1, ["a", "b"]) == pytest.approx(1.0)
    rounds = []
    for r in range(26):  # 52 jobs, two per round: jobs 50 and 51 are the last round's
        ids = (f"j{2 * r}", f"j{2 * r + 1}")
        fast = 3 if r == 25 else 1
        rounds.append([batch("off", dict.fromkeys(ids, 7), dict.fromkeys(ids, 7)),
                       batch("ngram", dict.fromkeys(ids, 7), dict.fromkeys(ids, 7)),
                       batch("suffix", dict.fromkeys(ids, 7), dict.fromkeys(ids, 1 + 6 // fast),
                             drafted=8, accepted=4)])
    results = {"grid": {"extraction": {"8": rounds}}, "threshold": []}
    learned = learning(results)
    assert learned == {"jobs": 52, "from_job": 50, "streams": None, "ngram_tokens_per_step": 1.0,
                       "suffix_tokens_per_step": 3.0}
    # a later cell where neither engine speculated (64 streams, past disable_by_batch_size)
    # does not count: only the learning cell's jobs from the 50th on do
    capped = [[batch(m, dict.fromkeys(("k0", "k1"), 7), dict.fromkeys(("k0", "k1"), 7))
               for m in ("off", "ngram", "suffix")] for _ in range(20)]
    two_cells = {"grid": {"extraction": {"8": rounds, "64": capped}}, "threshold": [],
                 "learning_streams": 8}
    assert learning(two_cells)["suffix_tokens_per_step"] == 3.0
    capped_only = learning({**two_cells, "learning_streams": 64})  # what counting it measured
    assert capped_only["ngram_tokens_per_step"] == capped_only["suffix_tokens_per_step"] == 1.0
    figs = figures(results)
    cell = figs["cells"]["extraction"]["8"]
    assert cell["acceptance_rate"]["suffix"] == 0.5 and cell["acceptance_rate"]["ngram"] is None
    assert figs["met"]["suffix_ge_ngram_from_job_50"] is True
    assert figs["met"]["extraction_8_ngram"] is False  # 1.0x against 1.5x


def verdict(job, method, near_tie):
    return {"workload": "edit", "streams": "2", "method": method, "job": job, "position": 3,
            "plain_token": 7, "spec_token": 9, "gap_packed": 0.001 if near_tie else 4.0,
            "gap_reference": 0.002 if near_tie else 3.5, "margin": 0.02, "near_tie": near_tie,
            "why": "near-tie: ..." if near_tie else "not a near-tie: logit gap 4 (packed)"}


def test_judged_differences_by_hand():
    ids = ("a", "b", "c")
    plain = batch("off", dict.fromkeys(ids, 5), dict.fromkeys(ids, 5))
    ngram = batch("ngram", dict.fromkeys(ids, 5), dict.fromkeys(ids, 5))
    suffix = batch("suffix", dict.fromkeys(ids, 5), dict.fromkeys(ids, 5))
    ngram.outputs["a"] = [1, 1, 1, 9, 1]  # a judged near-tie flip
    suffix.outputs["b"] = [1, 1, 1, 9, 1]  # judged: unexplained
    suffix.outputs["c"] = [1, 1, 1, 9]  # never judged: counts as unexplained
    results = {"grid": {"edit": {"2": [[plain, ngram, suffix]]}}, "threshold": [],
               "judged": [verdict("a", "ngram", True), verdict("b", "suffix", False)],
               "tie_margin": 0.02}
    figs = figures(results)
    assert figs["cells"]["edit"]["2"]["outputs"] == {
        "ngram": {"requests": 3, "identical": 2, "near_tie_flips": 1, "unexplained": 0},
        "suffix": {"requests": 3, "identical": 1, "near_tie_flips": 0, "unexplained": 2}}
    assert figs["compared_requests"] == 6 and figs["near_tie_flips"] == 1
    assert figs["unexplained_differences"] == 2
    text = spec_markdown(figs)
    assert "UNEXPLAINED DIFFERENCES: 2" in text and "job b at token 3" in text
    assert "2 / 1 / 0; 1 / 0 / 2 (of 3)" in text
