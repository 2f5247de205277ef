"""Child processes (embedded redis-server, workers, llama.cpp servers) end one way: SIGTERM,
a grace period for their own shutdown (a worker drains, Redis saves), then SIGKILL."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> int:
    """Terminate ``proc`` and reap it, killing it if it outlives ``grace_s``; its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
