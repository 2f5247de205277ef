"""``pagedq chat`` on the bundled model stays under its memory promise: 500 MB peak RSS.

The figure is the process's own peak resident set, as ``/usr/bin/time -v`` reports it
(``ru_maxrss`` of the child, read with ``wait4``), for the question the README asks. The
bundled model's packed conversion (config and tokenizer, once per cache) is made first, in this
process, so the child measures the chat itself: a warm cache, the case every later chat is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from pagedq.worker.models.default_model import ensure_default_model

PEAK_RSS_LIMIT_KB = 500_000  # the README's promise, in /usr/bin/time's units (KB)


def test_chat_peaks_under_500_mb_on_the_bundled_model(cpu_ops):
    # outside the measure: the once-per-cache conversion, and the kernels' once-per-checkout
    # build (cpu_ops), whose compiler children would count in the child's ru_maxrss
    ensure_default_model(packed=True)
    cmd = [sys.executable, "-m", "pagedq.worker.cli", "chat", "What is the capital of France?",
           "--max-tokens", "24", "--log-level", "warning"]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, not every child's
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    assert proc.returncode == 0, text[-3000:]
    assert "Paris" in text, text[-3000:]
    peak_kb = usage.ru_maxrss  # kilobytes on Linux
    assert peak_kb <= PEAK_RSS_LIMIT_KB, (
        f"pagedq chat peaked at {peak_kb / 1000:.0f} MB RSS (limit {PEAK_RSS_LIMIT_KB / 1000:.0f}"
        " MB); see docs/quantization.md for where the memory goes")
