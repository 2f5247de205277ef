"""``pagedq chat`` on the bundled model stays under its memory promise: 500 MB peak RSS.

The figure is the chat process's own peak resident set (``VmHWM``, what ``/usr/bin/time -v``
reports as its maximum resident set size), for the question the README asks, read by the child
itself as it exits: the ``ru_maxrss`` that ``wait4`` returns also counts the forking pytest
process's pages from before the exec. The kernels' build (once per checkout) is made first, in
this process. The chat is measured twice: on a warm cache (the bundled model's packed conversion,
config and tokenizer, made first in this process: the case every later chat is), and on an empty
one, where the first chat converts the GGUF itself (gguf_config.py and gguf_tokenizer.py keep
that one-time step under the promise too).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from pagedq.worker.models.default_model import default_gguf, ensure_default_model

PEAK_RSS_LIMIT_KB = 500_000  # the README's promise, in /usr/bin/time's units (KB)

# runs the CLI as `python -m pagedq.worker.cli` does, writing VmHWM to argv[1] at exit
CHILD = """
import atexit, runpy, sys
out = sys.argv.pop(1)
def report():
    with open("/proc/self/status") as f, open(out, "w") as o:
        o.write(f.read())
atexit.register(report)
sys.argv[0] = "pagedq"
runpy.run_module("pagedq.worker.cli", run_name="__main__")
"""


def test_chat_peaks_under_500_mb_on_the_bundled_model(cpu_ops, tmp_path):
    ensure_default_model(packed=True)  # the once-per-cache conversion, outside the measure
    assert_chat_under_limit(tmp_path, os.environ)


def test_first_chat_on_an_empty_cache_peaks_under_500_mb(cpu_ops, tmp_path):
    """The conversion runs in the chat process: it must fit under the same promise."""
    env = {**os.environ, "PAGEDQ_CACHE": str(tmp_path / "empty-cache"),
           "PAGEDQ_DEFAULT_GGUF": str(default_gguf())}  # the GGUF itself, never a fetch
    assert_chat_under_limit(tmp_path, env)
    assert any((tmp_path / "empty-cache" / "models" / "packed").iterdir())  # it did convert


def assert_chat_under_limit(tmp_path: Path, env) -> None:
    """Run the README's chat in a child with ``env`` and check its own peak resident set."""
    status = tmp_path / "status"
    cmd = [sys.executable, "-c", CHILD, str(status), "chat", "What is the capital of France?",
           "--max-tokens", "24", "--log-level", "warning"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Paris" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    peak_kb = int(re.search(r"VmHWM:\s+(\d+) kB", status.read_text()).group(1))
    assert peak_kb <= PEAK_RSS_LIMIT_KB, (
        f"pagedq chat peaked at {peak_kb / 1000:.0f} MB RSS (limit {PEAK_RSS_LIMIT_KB / 1000:.0f}"
        " MB); see docs/quantization.md for where the memory goes")
