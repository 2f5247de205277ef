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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]


@dataclass
class InnerRun:
    """A started inner pytest: its process, the environment it changed and its time limit."""

    proc: subprocess.Popen
    env: dict[str, str]
    timeout: float


def start_pytest(args: list[str], env: dict[str, str], timeout: float = 1200) -> InnerRun:
    """Start ``pytest -q args`` under ``env`` (added to this process's) without waiting, so
    several inner runs (each ~1 core, mostly single-threaded tests) can share the machine."""
    # The inner session shares this session's pagedq cache through $PAGEDQ_TEST_CACHE
    # (tests/conftest.py), so the bundled model's conversions are made once, not once a run.
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-o", "addopts=", *args],
                            env={**os.environ, **env}, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return InnerRun(proc, env, timeout)


def finish_pytest(run: InnerRun) -> dict[str, int]:
    """Wait for an inner run; returns the summary's counts ({"passed": N, "skipped": M, ...})
    after asserting it passed and ran at least one test."""
    try:
        stdout, stderr = run.proc.communicate(timeout=run.timeout)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        stdout, stderr = run.proc.communicate()
        raise AssertionError(f"inner pytest under {run.env} ran past {run.timeout} s:\n"
                             f"{(stdout + stderr)[-4000:]}") from None
    tail = (stdout + stderr)[-4000:]
    assert run.proc.returncode == 0, f"inner pytest failed under {run.env}:\n{tail}"
    counts = summary_counts(stdout)
    assert counts.get("passed", 0) > 0, f"inner pytest ran no test under {run.env}:\n{tail}"
    return counts


def run_pytest(args: list[str], env: dict[str, str], timeout: float = 1200) -> dict[str, int]:
    """:func:`start_pytest` and wait for it (:func:`finish_pytest`)."""
    return finish_pytest(start_pytest(args, env, timeout))


def summary_counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line ("12 passed, 3 skipped in 4.5s")."""
    lines = [ln for ln in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    if not lines:
        return {}
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", lines[-1])}
