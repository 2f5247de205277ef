"""``run_bench``: run a BenchConfig's scenarios, assemble the report, write its files."""

from __future__ import annotations

from typing import Any

from .config import BenchConfig


def run_bench(config: BenchConfig, json_path: str | None = None,
              plot_dir: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Run, assemble, write; returns the JSON document and the plot paths."""
    from . import report
    from .scenarios import BenchRun

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
