"""The ground floor (pagedq/logging.py, pagedq/redact.py): the kernels log through it without
importing redis, the client or the worker, and every log line still has its Redis passwords
masked."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["pagedq.kernels", "pagedq.logging", "pagedq.redact"])
def test_the_ground_floor_imports_nothing_above_it(module):
    code = (f"import sys, {module}; print(sorted({{m.split('.')[0] for m in sys.modules if m in "
            "('redis', 'pagedq.client', 'pagedq.worker')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().replace("'", '"')) == [], out.stdout


def test_log_lines_mask_redis_passwords_whichever_name_is_imported():
    import pagedq.logging
    from pagedq.client.connection import redact_url

    assert pagedq.logging.get_logger is pagedq.logging.get_logger
    assert redact_url("redis://u:pw@h:6379/0") == "redis://u:***@h:6379/0"
    buffer = io.StringIO()
    pagedq.logging.configure_logging(json=True, file=buffer)
    try:
        pagedq.logging.get_logger("t").error("cannot reach", url="rediss://:hunter2@r:6380/0",
                                             error="redis://admin:s3cret@x failed")
    finally:
        pagedq.logging.configure_logging()
    line = json.loads(buffer.getvalue())
    assert line["url"] == "rediss://:***@r:6380/0"
    assert line["error"] == "redis://admin:***@x failed"
    assert "hunter2" not in buffer.getvalue() and "s3cret" not in buffer.getvalue()
