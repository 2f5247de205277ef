"""The figures of docs/operations.md's "The gateway against hostile clients": issue 25's repros
against a real `pagedq serve` process (and a worker on the bundled model, packed, unless a
MODEL_DIR is given), each with its answer; the gateway's peak RSS while 12 clients download a
63 MB file at once and while 12 upload one; a `choice` request's latency beside two schema
bombs; and an honest client's chat latency alone and while hostile clients run (slowloris
sockets, schema bombs, uploads, 300-prompt requests), alternated.

    python scripts/gateway_figures.py [MODEL_DIR]     # prints a markdown table
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
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


def start(redis_url: str, env: dict, model: str | None
          ) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    """A worker (the bundled model, packed, when ``model`` is None) and a gateway."""
    chosen = ["--model", model, "--quantization", "none"] if model else []
    worker = subprocess.Popen(
        [sys.executable, "-m", "pagedq.worker", "--redis-url", redis_url, "--queue", QUEUE,
         *chosen, "--log-level", "WARNING"], env=env)
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


def big_file() -> bytes:
    return b"".join(b'{"n": %d}\n' % i for i in range(6_000_000))[:63_000_000]


class PeakRSS:
    """A process's RSS sampled every 50 ms in a thread, while the ``with`` block runs."""

    def __init__(self, pid: int):
        self.pid, self.before, self.peak = pid, rss_mb(pid), 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.05)

    def __enter__(self) -> PeakRSS:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def uploads(base: str, pid: int, data: bytes) -> tuple[float, float, list[int]]:
    """12 concurrent uploads of ``data``: the gateway's RSS before and at peak, the statuses."""
    async def one(http: httpx.AsyncClient) -> int:
        resp = await http.post("/v1/files", files={"file": ("big.jsonl", data)},
                               data={"purpose": "batch"})
        if resp.status_code == 200:
            await http.delete(f"/v1/files/{resp.json()['id']}")
        return resp.status_code

    async def all12() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            return await asyncio.gather(*(one(http) for _ in range(12)))

    with PeakRSS(pid) as rss:
        codes = asyncio.run(all12())
    return rss.before, rss.peak, codes


def downloads(base: str, pid: int, data: bytes) -> tuple[float, float, list[int]]:
    with httpx.Client(base_url=base, timeout=600) as http:
        fid = http.post("/v1/files", files={"file": ("big.jsonl", data)},
                        data={"purpose": "batch"}).json()["id"]

    async def one(http: httpx.AsyncClient) -> int:
        size = 0
        async with http.stream("GET", f"/v1/files/{fid}/content") as resp:
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
        return size

    async def all12() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            return await asyncio.gather(*(one(http) for _ in range(12)))

    with PeakRSS(pid) as rss:
        sizes = asyncio.run(all12())
    return rss.before, rss.peak, sizes


async def _slowloris(port: int, stop: asyncio.Event) -> None:
    """A connection whose headers arrive a byte every 0.5 s; reconnects when cut off."""
    while not stop.is_set():
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            while not stop.is_set():
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.5)
        except OSError:
            await asyncio.sleep(0.1)


async def _repeat(stop: asyncio.Event, make: object) -> None:
    while not stop.is_set():
        try:
            await make()  # type: ignore[operator]
        except httpx.HTTPError:
            await asyncio.sleep(0.1)


HOSTILE_KINDS = ("slowloris", "bombs", "uploads", "prompts", "all")


def honest_latency(base: str, model: str, rounds: int = 3) -> dict[str, tuple[list, list]]:
    """An honest chat request (16 tokens, greedy) timed alone and while one kind of hostile
    client runs, alternated ``rounds`` times per kind: 100 slowloris sockets; two schema bombs;
    two 20 MB uploads; a 300-prompt request; all of them at once. Each hostile request is sent
    again as soon as it is answered."""
    port = int(base.rsplit(":", 1)[1])
    honest = {"model": model, "messages": [{"role": "user", "content": "Name three colors."}],
              "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    upload = b'{"a": 1}\n' * ((20 << 20) // 9)
    bomb_body = {**honest, "response_format": {"type": "json_schema", "json_schema": {
        "name": "b", "schema": bomb()}}}

    async def timed(http: httpx.AsyncClient) -> float:
        began = time.perf_counter()
        resp = await http.post("/v1/chat/completions", json=honest)
        assert resp.status_code == 200, resp.text
        return time.perf_counter() - began

    def hostile(kind: str, http: httpx.AsyncClient, stop: asyncio.Event) -> list:
        every = kind == "all"
        made: list = []
        if every or kind == "slowloris":
            made += [_slowloris(port, stop) for _ in range(100)]
        if every or kind == "bombs":
            made += [_repeat(stop, lambda: http.post("/v1/chat/completions", json=bomb_body))
                     for _ in range(2)]
        if every or kind == "uploads":
            made += [_repeat(stop, lambda: http.post(
                "/v1/files", files={"file": ("u.jsonl", upload)}, data={"purpose": "batch"}))
                for _ in range(2)]
        if every or kind == "prompts":
            made.append(_repeat(stop, lambda: http.post("/v1/completions", json={
                "model": model, "prompt": [[1]] * 300, "max_tokens": 1})))
        return made

    async def loaded(kind: str, http: httpx.AsyncClient) -> float:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(h) for h in hostile(kind, http, stop)]
        await asyncio.sleep(2.0)  # the hostile clients are all under way
        try:
            return await timed(http)
        finally:
            stop.set()
            await asyncio.wait(tasks, timeout=30)
            for t in tasks:
                t.cancel()

    async def run() -> dict[str, tuple[list, list]]:
        out: dict[str, tuple[list, list]] = {}
        async with httpx.AsyncClient(base_url=base, timeout=600,
                                     limits=httpx.Limits(max_connections=64)) as http:
            await timed(http)  # warm-up
            for kind in HOSTILE_KINDS:
                alone, beside = [], []
                for _ in range(rounds):
                    alone.append(await timed(http))
                    beside.append(await loaded(kind, http))
                out[kind] = (alone, beside)
            for f in (await http.get("/v1/files")).json()["data"]:
                await http.delete(f"/v1/files/{f['id']}")
        return out
    return asyncio.run(run())


def choice_beside_bombs(base: str, model: str, rounds: int = 3
                        ) -> tuple[list[str], list[float], list[float]]:
    """A `choice` request (a fresh choice set each time, so each compiles its grammar) timed
    alone and with two schema bombs sent at the same moment, alternated ``rounds`` times: the
    bombs' answers, the latencies alone and beside them."""
    def choice(i: int) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": "Yes or no?"}],
                "guided_choice": [f"yes {i}", f"no {i}"], "max_tokens": 4}

    bomb_body = {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                 "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
                     "name": "b", "schema": bomb()}}}

    async def run() -> tuple[list[str], list[float], list[float]]:
        alone, beside, answers = [], [], []
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            await http.post("/v1/chat/completions", json=choice(-1))  # the compiler's cold start
            for i in range(rounds):
                began = time.perf_counter()
                resp = await http.post("/v1/chat/completions", json=choice(2 * i))
                assert resp.status_code == 200, resp.text
                alone.append(time.perf_counter() - began)
                bombs = [http.post("/v1/chat/completions", json=bomb_body) for _ in range(2)]
                began = time.perf_counter()
                *got, last = await asyncio.gather(*bombs, http.post(
                    "/v1/chat/completions", json=choice(2 * i + 1)))
                beside.append(time.perf_counter() - began)
                answers = [answer(a) for a in got] + [answer(last)]
        return answers, alone, beside
    return asyncio.run(run())


def main() -> None:
    env = dict(os.environ, PAGEDQ_CACHE=tempfile.mkdtemp())  # never join another's Redis
    model = sys.argv[1] if len(sys.argv) > 1 else None
    with EmbeddedRedis.start(unix_socket=True) as redis:
        worker, gateway, base = start(redis.url, env, model)
        try:
            with httpx.Client(base_url=base, timeout=600) as http:
                model = http.get("/v1/models").json()["data"][0]["id"]
                rows = repros(http, model)
            answers, choice_alone, choice_beside = choice_beside_bombs(base, model)
            honest = honest_latency(base, model)
            data = big_file()
            before, peak, sizes = downloads(base, gateway.pid, data)
            up_before, up_peak, codes = uploads(base, gateway.pid, data)
        finally:
            for proc in (gateway, worker):
                proc.terminate()
                proc.wait(30)
    print("| repro | answer |\n| --- | --- |")
    for name, result in rows:
        print(f"| {name} | {result} |")
    print(f"\nTwo 28 KB schema bombs and a `choice` request at once: {answers}; the choice "
          "alone / beside the bombs (alternated, a fresh choice set each): "
          + ", ".join(f"{a:.2f} / {b:.2f} s" for a, b in zip(choice_alone, choice_beside,
                                                             strict=True)) + ".")
    print(f"12 concurrent downloads of a 63 MB file: gateway RSS {before:.0f} MB before, "
          f"{peak:.0f} MB at peak; bytes received {sorted(set(sizes))}.")
    print(f"12 concurrent uploads of a 63 MB file: gateway RSS {up_before:.0f} MB before, "
          f"{up_peak:.0f} MB at peak; statuses {sorted(codes)}.")
    print("\nAn honest 16-token chat, alone / beside hostile clients (alternated), seconds:\n")
    print("| hostile clients | pairs (alone / beside) | median alone | median beside | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for kind, (alone, beside) in honest.items():
        pairs = ", ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(alone, beside, strict=True))
        ma, mb = statistics.median(alone), statistics.median(beside)
        print(f"| {kind} | {pairs} | {ma:.2f} | {mb:.2f} | {mb / ma:.2f}x |")


if __name__ == "__main__":
    main()
