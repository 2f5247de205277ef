"""`pagedq batch IN.jsonl -o OUT.jsonl` as a user runs it (issue 25, Low 6): no Redis URL, so
it starts its own Redis and worker; bad lines mixed with good ones each get an error line,
and the terminal shows no traceback (the gateway's nor the worker's) and no 503 wording."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.gateway.test_hostile import bad_bodies


def test_a_batch_file_with_bad_lines_prints_no_traceback(tmp_path, tiny_text_model_dir):
    from pagedq.gateway.fleet import model_id

    model = model_id(str(tiny_text_model_dir))
    hello = [{"role": "user", "content": "Hello"}]

    def line(custom_id: str, body: dict) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST",
                           "url": "/v1/chat/completions", "body": body})

    lines = [line("good-1", {"model": model, "messages": hello, "max_tokens": 3})]
    lines += [line(name, body) for name, body in bad_bodies(model).items()]
    lines += [
        "{this is not json",
        line("no-such-model", {"model": "nope", "messages": hello}),
        line("too-long", {"model": model, "messages": hello, "max_tokens": 10_000_000}),
        line("bad-bias", {"model": model, "messages": hello, "logit_bias": {"99999999": 5}}),
        line("good-2", {"model": model, "messages": hello, "max_tokens": 3}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PAGEDQ_CACHE"] = str(tmp_path / "cache")  # no advertised Redis to join: its own
    done = subprocess.run(
        [sys.executable, "-m", "pagedq.worker.cli", "batch", str(tmp_path / "in.jsonl"), "-o",
         str(tmp_path / "out.jsonl"), "--model", str(tiny_text_model_dir), "--no-progress",
         "--num-threads", "1"],
        capture_output=True, text=True, env=env, timeout=900)
    printed = done.stdout + done.stderr
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert done.returncode == 1, printed[-3000:]  # some lines failed
    assert len(out) == len(lines)
    status = {o["custom_id"]: (o["response"] or {}).get("status_code") for o in out}
    # A refused line carries the status its HTTP route answers; a non-JSON line has none.
    assert status == {"good-1": 200, "good-2": 200, None: None, "no-such-model": 404,
                      "too-long": 400, "bad-bias": 400,
                      **dict.fromkeys(bad_bodies(model), 400)}, status
    assert "Traceback" not in printed, printed[-5000:]
    # a 503 status anywhere, but not the digits inside a timestamp or pid (19:39:31.691503Z)
    assert not re.search(r"(?<![\d.])503(?!\d)", printed), printed[-3000:]
    assert "no worker is serving" not in printed, printed[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "succeeded": 2, "failed": len(lines) - 2, "output": str(tmp_path / "out.jsonl")}
