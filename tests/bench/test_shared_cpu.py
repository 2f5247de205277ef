"""The ``shared`` bench scenario's load and figures (bench/shared_cpu.py); the scenario's
run itself is a benchmark (timings), so the tests check its plumbing, not its speed."""

from __future__ import annotations

import time

from pagedq.bench import shared_cpu


def test_the_load_stops_by_itself():
    start = time.monotonic()
    shared_cpu.load_main(0.2)
    assert time.monotonic() - start < 5


def test_the_load_processes_are_stopped():
    procs = shared_cpu.start_load(60, processes=2)
    shared_cpu.stop_load(procs)
    assert all(p.poll() is not None for p in procs)


def test_figures_judge_both_targets():
    results = {"threads": 2, "quiet": {"default": 90.0, "one_thread": 60.0, "all_threads": 95.0},
               "loaded": {"default": 40.0, "one_thread": 50.0, "all_threads": 5.0},
               "load": {"processes": 3, "threads_each": 2}, "new_tokens": 32, "repeats": 2}
    figs = shared_cpu.figures(results)
    assert figs["ratios"] == {"loaded_vs_one_thread": 0.8, "quiet_vs_all_threads": 90 / 95}
    assert figs["met"] == {"loaded_vs_one_thread": False, "quiet_vs_all_threads": True}
    text = shared_cpu.markdown(figs)
    assert "| loaded | 40.0 | 50.0 | 5.0 |" in text and "0.80x one thread" in text
    assert shared_cpu.figures(None) is None and shared_cpu.markdown(None) == ""


def test_the_scenario_runs_when_named(tiny_model_dir, tmp_path):
    """`--scenarios shared` on the tiny model: three engines, quiet and loaded, figures in the
    JSON (their values are timings, not checked)."""
    from pagedq.bench.options import quick
    from pagedq.bench.run import run_bench

    config = quick(model=str(tiny_model_dir("llama")), num_threads=2, scenarios=("shared",),
                   shared_new_tokens=4, shared_repeats=1, shared_load_seconds=60.0)
    doc, _ = run_bench(config, str(tmp_path / "bench.json"))
    assert doc["errors"] == {} and set(doc["shared"]["quiet"]) == set(shared_cpu.VARIANTS)
    assert set(doc["shared"]["ratios"]) == set(shared_cpu.TARGETS)
