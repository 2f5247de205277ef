"""The GEMV/GEMM crossover measured on this machine (kernels/crossover.py): what it measures,
what it keeps in pagedq's cache and what a plan takes from it. Which kernel wins where is the
machine's to say, so no figure is asserted; both kernels' results are tested against the
reference in test_quant_kernels.py at every ISA level (test_isa_levels.py runs this file there
too)."""

from __future__ import annotations

import json
import multiprocessing
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pagedq.kernels import crossover
from pagedq.kernels.backend import ALL_ROWS, Selector, process_cpu


@pytest.fixture
def fp32_plan(cpu_ops):
    """This CPU's plan with the packed GEMM on fp32 tiles (what every CPU without AMX runs)."""
    return Selector(cpu=process_cpu()).select("cpu", packed_precision="fp32").plan()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh pagedq cache, and no figure remembered by this process."""
    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path))
    crossover._kept_or_measured.cache_clear()
    yield tmp_path / crossover.CACHE_FILE
    crossover._kept_or_measured.cache_clear()


def test_the_crossover_lies_between_two_rungs_where_the_lead_changes_sign():
    assert crossover._between((256, -0.010), (512, 0.010)) == 384
    assert crossover._between((256, -0.001), (512, 0.030)) == 256  # to a multiple of 16, >= 256
    assert crossover._between((16, -0.030), (32, 0.001)) == 16


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k"])
def test_a_measurement_hands_over_on_the_ladder_or_never(fp32_plan, fmt):
    choice = fp32_plan.packed[fmt]
    assert crossover.measures(choice)
    rows = crossover.measure_gemv_rows(choice)
    rungs = crossover.LADDER
    assert rows in (choice.gemv_rows, ALL_ROWS) or (rungs[0] <= rows < rungs[-1] and rows % 16 == 0)


def test_bf16_tiles_and_float_segments_keep_the_table(cpu_ops):
    plan = Selector(cpu=process_cpu()).select("cpu", packed_precision="bf16x2").plan()
    if plan.packed["q8_0"].precision == "fp32":  # no AMX here: bf16 tiles fall back to fp32
        assert crossover.measures(plan.packed["q8_0"])
    else:
        assert not crossover.measures(plan.packed["q8_0"])
    assert not crossover.measures(plan.packed["float32"])


def test_a_plan_measures_once_and_later_engines_read_the_cache(fp32_plan, cache, monkeypatch):
    plan = crossover.measured_plan(fp32_plan, {"q8_0"})
    kept = json.loads(cache.read_text())
    key = crossover.cache_key(fp32_plan.packed["q8_0"], fp32_plan.backend.cpu.level)
    assert kept == {key: plan.packed["q8_0"].gemv_rows}
    assert list(crossover.kept_for_this_cpu().values()) == [plan.packed["q8_0"].gemv_rows]
    assert key.endswith(next(iter(crossover.kept_for_this_cpu())))  # the CPU's prefix dropped
    assert plan.backend.packed_for("q8_0") == plan.packed["q8_0"]  # the backend says the same
    assert plan.packed["q4_1"] == fp32_plan.packed["q4_1"]  # a format the model lacks: as was

    crossover._kept_or_measured.cache_clear()  # a new process: only the file remembers

    def no_timing(choice):
        raise AssertionError("measured again although the cache holds the figure")

    monkeypatch.setattr(crossover, "measure_gemv_rows", no_timing)
    cache.write_text(json.dumps({key: 96}))
    again = crossover.measured_plan(fp32_plan, {"q8_0"})
    assert again.packed["q8_0"].gemv_rows == 96
    assert again.packed["q8_0"].precision_code == fp32_plan.packed["q8_0"].precision_code


def test_a_figure_is_kept_per_level_threads_and_activation_width(fp32_plan):
    choice = fp32_plan.packed["q8_0"]
    key = crossover.cache_key(choice, "avx2")
    assert key != crossover.cache_key(choice, "avx512")
    assert key != crossover.cache_key(replace(choice, int8_acts=True), "avx2")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert key != crossover.cache_key(choice, "avx2")
    finally:
        torch.set_num_threads(threads)


def test_a_torn_cache_file_is_measured_over(fp32_plan, cache):
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("{not json")
    plan = crossover.measured_plan(fp32_plan, {"q4_0"})
    assert json.loads(cache.read_text()) == {
        crossover.cache_key(fp32_plan.packed["q4_0"], fp32_plan.backend.cpu.level):
            plan.packed["q4_0"].gemv_rows}


def _add_figures(path: str, tag: str, go) -> None:
    go.wait()
    for i in range(200):
        crossover._write(Path(path), {f"{tag}-{i}": 16})


def test_engines_starting_together_keep_each_others_figures(tmp_path):
    """Read, merge and replace run under a lock: four processes adding 200 figures each at the
    same time all find every one in the file (without the lock most were lost)."""
    path = tmp_path / crossover.CACHE_FILE
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_add_figures, args=(str(path), f"p{n}", go)) for n in range(4)]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert json.loads(path.read_text()) == {f"p{n}-{i}": 16 for n in range(4) for i in range(200)}


def test_a_kernel_change_keys_new_figures(tmp_path):
    """Figures timed on other kernel sources are not reused: the key carries their content."""
    from pagedq.kernels.cpu_ops import CSRC

    def copied(name: str) -> Path:
        copy = tmp_path / name
        copy.mkdir()
        for path in CSRC.iterdir():
            if path.is_file():
                (copy / path.name).write_bytes(path.read_bytes())
        return copy

    assert crossover.kernels_id(copied("same")) == crossover.kernels_id(CSRC)
    changed = copied("changed")
    panel = changed / "panel_kernel.inc"
    panel.write_text(panel.read_text() + "\n// a changed kernel\n")
    assert crossover.kernels_id(changed) != crossover.kernels_id(CSRC)
