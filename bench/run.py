"""One ``pagedq bench`` invocation: its shared inputs, its orchestration and ``run_bench``.

``BenchRun.execute()`` runs the selected scenarios (pagedq.bench.scenarios) in an order
that keeps the comparisons clean: every pagedq measurement first (so the peak RSS recorded after
them is pagedq's own), then the Redis path (a worker subprocess), then the Hugging Face and
llama.cpp baselines. Each scenario writes its raw results into ``run.results``;
``report.assemble`` turns them into the report's figures.

A scenario whose dependency is missing (no Redis worker, no prefix caching) raises
``Unavailable`` (pagedq.bench.context) and its figures are reported as unavailable with the
reason; any other error is logged, recorded under ``errors`` and the run carries on, so one
broken part never hides the rest.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedq.bench import (
    memory_bound,
    quant_scenario,
    report,
    scenarios,
    shared_cpu,
    spec_scenario,
    structured_scenario,
)
from pagedq.bench.context import BenchContext, peak_rss_mb
from pagedq.bench.options import BenchConfig

__all__ = ["BenchRun", "peak_rss_mb", "run_bench"]


@dataclass
class BenchRun(BenchContext):
    """One ``pagedq bench`` invocation: the shared inputs (BenchContext) and the order its
    scenarios run in."""

    def execute(self) -> None:
        """Run the selected scenarios (pagedq first, then Redis, then HF) and keep going on
        failure."""
        wanted = set(self.config.scenarios)
        began = time.perf_counter()
        self._timed("setup", self.setup)
        if self.model_dir is None:
            return
        engine_parts: list[tuple[str, Callable[[], None]]] = []
        if wanted & {"throughput", "decode", "prefix", "sharing", "queue"}:
            engine_parts.append(("serving", lambda: scenarios.serving_scenarios(self, wanted)))
        if "capacity" in wanted:
            engine_parts.append(("capacity", functools.partial(scenarios.capacity, self)))
        if "itl" in wanted:
            engine_parts.append(("itl", functools.partial(scenarios.itl, self)))
        if "structured" in wanted:
            engine_parts.append(("structured", functools.partial(structured_scenario.structured, self)))
        if "shared" in wanted:
            engine_parts.append(("shared", functools.partial(shared_cpu.measure, self)))
        if "spec" in wanted:
            engine_parts.append(("spec", functools.partial(spec_scenario.measure, self)))
        for name, part in engine_parts:
            self._timed(name, part)
            gc.collect()  # the part's engine (and its KV cache) is gone before the next one
        if "gateway" in wanted:
            self._timed("gateway", functools.partial(scenarios.gateway, self))
        self.results["peak_rss_mb_pagedq"] = peak_rss_mb()
        if "throughput" in wanted:
            self._timed("throughput_hf", functools.partial(scenarios.throughput_hf, self))
        if "decode" in wanted:
            self._timed("decode_hf", functools.partial(scenarios.decode_hf, self))
        self._hf = None
        gc.collect()
        if "llama_cpp" in wanted and wanted & {"throughput", "decode"}:
            self._timed("llama_cpp", lambda: scenarios.llama_cpp(self, wanted))
        if "quant" in wanted:
            self._timed("quant", functools.partial(quant_scenario.measure, self))
        if "memory" in wanted:
            self._timed("memory", functools.partial(memory_bound.measure, self))
        self.results["peak_rss_mb_total"] = peak_rss_mb()
        self.elapsed_s["total"] = round(time.perf_counter() - began, 3)


def run_bench(config: BenchConfig, json_path: str | None = None,
              plot_dir: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Run, assemble, write; returns the JSON document and the plot paths."""
    run = BenchRun(config)
    run.execute()
    doc = report.assemble(run)
    plots: list[str] = []
    if plot_dir:
        plots = [str(p) for p in report.plot(run, doc, plot_dir)]
        doc["plots"] = plots
    if json_path:
        report.write_json(doc, json_path)
    return doc, plots
