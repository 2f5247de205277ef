"""Run some tests again in a fresh process with a changed environment, and check they really ran.

Used where a setting can only be read at process start (the CPU level cap PAGEDQ_CPU_ISA,
oneDNN's ONEDNN_MAX_CPU_ISA, PAGEDQ_CPU_BF16_CONVERT). A run whose tests all skipped, or that
collected none, is a failure here: an inner run that tests nothing must not pass the outer test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def run_pytest(args: list[str], env: dict[str, str], timeout: float = 1200) -> dict[str, int]:
    """``pytest -q args`` under ``env`` (added to this process's); returns the summary's counts
    ({"passed": N, "skipped": M, ...}) after asserting it passed and ran at least one test."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", *args],
                          env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"inner pytest failed under {env}:\n{tail}"
    counts = summary_counts(proc.stdout)
    assert counts.get("passed", 0) > 0, f"inner pytest ran no test under {env}:\n{tail}"
    return counts


def summary_counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line ("12 passed, 3 skipped in 4.5s")."""
    lines = [ln for ln in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    if not lines:
        return {}
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", lines[-1])}
