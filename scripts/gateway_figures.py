"""The figures of docs/operations.md's "The gateway against hostile clients": issue 25's repros
against a real `pagedq serve` process (and a worker on the bundled model), each with its answer;
the gateway's peak RSS while 12 clients download a 63 MB file at once; and a `choice` request's
latency beside two schema bombs.

    python scripts/gateway_figures.py [MODEL_DIR]     # prints a markdown table
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

try:  # the HTTP library the installed openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

from pagedq.embedded_redis import EmbeddedRedis, free_port
from pagedq.worker.models.loader import resolve_model

QUEUE = "figures"


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def bomb() -> dict:
    return {"anyOf": [{"type": "object", "properties": {
        f"p{i}_{j}": {"type": "string", "pattern": f"^[a-z]{{3,40}}[0-9]{{{j}}}$"}
        for j in range(15)}} for i in range(30)]}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start(redis_url: str, env: dict, model: str) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagedq.worker", "--redis-url", redis_url, "--queue", QUEUE,
         "--model", model, "--quantization", "none", "--log-level", "WARNING"], env=env)
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "pagedq.worker.cli", "serve", "--redis-url", redis_url,
         "--queue", QUEUE, "--port", str(port), "--log-level", "WARNING",
         "--max-queue-depth", "5"], env=env)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 600
    while time.monotonic() < end:
        try:
            if httpx.get(base + "/health", timeout=2).json().get("workers"):
                return worker, gateway, base
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit("the worker did not start")


def answer(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error") or {}
    except ValueError:
        return f"{resp.status_code}"
    return f"{resp.status_code} `{err.get('code')}`" if err else f"{resp.status_code}"


def repros(http: httpx.Client, model: str) -> list[tuple[str, str]]:
    hello = [{"role": "user", "content": "Hello"}]
    chat = {"model": model, "messages": hello, "max_tokens": 4}
    rows = []
    for name, body in [
            ('`"n": 17`', {**chat, "n": 17}),
            ("17 stop strings", {**chat, "stop": [f"s{i}" for i in range(17)]}),
            ("a 300-character stop", {**chat, "stop": ["x" * 300]}),
            ('a lone `"\\ud800"`', {**chat, "messages": [{"role": "user", "content": "\ud800"}]}),
            ("a schema nested 300 deep", {**chat, "response_format": {
                "type": "json_schema", "json_schema": {"name": "d", "schema": nested(300)}}}),
            ("100k stop strings", {**chat, "stop": [f"s{i}" for i in range(100_000)]}),
            ("priority -1e6", {**chat, "priority": -1_000_000})]:
        resp = http.post("/v1/chat/completions", content=json.dumps(body),
                         headers={"content-type": "application/json"})
        rows.append((name, f"{answer(resp)}, {len(resp.content)} B"))
    resp = http.post("/v1/completions", json={"model": model, "prompt": [[1]] * 300,
                                              "max_tokens": 1})
    rows.append(("300 prompts, `--max-queue-depth 5`", answer(resp)))
    resp = http.post("/v1/completions", json={"model": model, "prompt": [[1]] * 2049,
                                              "max_tokens": 1})
    rows.append(("2049 prompts", answer(resp)))
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as resp:
        rid = next(json.loads(ln[6:])["id"] for ln in resp.iter_lines()
                   if ln.startswith("data: {"))
    for header in (b"\xb2", b"9" * 5000):
        resp = http.get(f"/v1/requests/{rid}/stream", headers={"Last-Event-ID": header})
        rows.append((f"`Last-Event-ID: {header[:6]!r}...`", answer(resp)))
    for fid in ("file-%00", "file-" + "a" * 5000):
        resp = http.get(f"/v1/files/{fid}/content")
        rows.append((f"file id `{fid[:12]}...`", f"{answer(resp)}, {len(resp.content)} B"))
    resp = http.get("/v1/models", headers={"Host": "evil.example"})
    rows.append(("`Host: evil.example`", answer(resp)))
    resp = http.post("/v1/files", headers={"Origin": "http://evil.example"},
                     files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"})
    rows.append(("cross-site upload (`Origin: http://evil.example`)", answer(resp)))
    up = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")},
                   data={"purpose": "batch"}).json()["id"]
    resp = http.post("/v1/batches", json={"input_file_id": up, "endpoint": "/v1/chat/completions",
                                          "metadata": {"k": "v" * (3 << 20)}})
    rows.append(("3 MiB of batch metadata", answer(resp)))
    return rows


def downloads(base: str, pid: int) -> tuple[float, float, list[int]]:
    data = b"".join(b'{"n": %d}\n' % i for i in range(6_000_000))[:63_000_000]
    with httpx.Client(base_url=base, timeout=600) as http:
        fid = http.post("/v1/files", files={"file": ("big.jsonl", data)},
                        data={"purpose": "batch"}).json()["id"]
    before, peak, stop = rss_mb(pid), [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(pid))
            time.sleep(0.05)

    async def one(http: httpx.AsyncClient) -> int:
        size = 0
        async with http.stream("GET", f"/v1/files/{fid}/content") as resp:
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
        return size

    async def all12() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            return await asyncio.gather(*(one(http) for _ in range(12)))

    thread = threading.Thread(target=sample)
    thread.start()
    sizes = asyncio.run(all12())
    stop.set()
    thread.join()
    return before, peak[0], sizes


def choice_beside_bombs(base: str, model: str) -> tuple[list[str], float]:
    async def run() -> tuple[list[str], float]:
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            await http.post("/v1/chat/completions", json={  # the grammar compiler's cold start
                "model": model, "messages": [{"role": "user", "content": "Hi"}],
                "guided_choice": ["warm"], "max_tokens": 2})
            bombs = [http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "b", "schema": bomb()}}})
                for _ in range(2)]
            began = time.perf_counter()
            choice = http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Yes or no?"}],
                "guided_choice": ["yes", "no"], "max_tokens": 4})
            *answers, last = await asyncio.gather(*bombs, choice)
            return [answer(a) for a in answers] + [answer(last)], time.perf_counter() - began
    return asyncio.run(run())


def main() -> None:
    env = dict(os.environ, PAGEDQ_CACHE=tempfile.mkdtemp())  # never join another's Redis
    model = sys.argv[1] if len(sys.argv) > 1 else str(resolve_model(None))
    with EmbeddedRedis.start() as redis:
        worker, gateway, base = start(redis.url, env, model)
        try:
            with httpx.Client(base_url=base, timeout=600) as http:
                model = http.get("/v1/models").json()["data"][0]["id"]
                rows = repros(http, model)
            answers, latency = choice_beside_bombs(base, model)
            before, peak, sizes = downloads(base, gateway.pid)
        finally:
            for proc in (gateway, worker):
                proc.terminate()
                proc.wait(30)
    print("| repro | answer |\n| --- | --- |")
    for name, result in rows:
        print(f"| {name} | {result} |")
    print(f"\nTwo 28 KB schema bombs and a `choice` request at once: {answers}; the choice "
          f"answered in {latency:.2f} s.")
    print(f"12 concurrent downloads of a 63 MB file: gateway RSS {before:.0f} MB before, "
          f"{peak:.0f} MB at peak; bytes received {sorted(set(sizes))}.")


if __name__ == "__main__":
    main()
