"""``pagedq demo``: an embedded Redis, one worker in this process, and a few prompts streamed
through the queue at once, so continuous batching is visible: the answers grow side by side
while the KV cache fills and empties.

The Redis is the one ``pagedq worker`` and ``serve`` start (pagedq/embedded_redis.py): a unix
socket in a directory only this user can enter, a password, ``maxmemory`` with noeviction; no
TCP port. It is advertised while the demo runs (unless a worker's already is), so
`pagedq stats` or ``Client()`` in another terminal find it."""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from pagedq.client import Client
from pagedq.embedded_redis import EmbeddedRedis, advertised
from pagedq.errors import PagedQError
from pagedq.redact import redact_url
from pagedq.worker.cli.console import PROMPT_HELP, event_sentence, read_prompts, setup_console_logging
from pagedq.worker.cli.flags import COMMAND_SAMPLING, add_sampling_flags, sampling_params
from pagedq.worker.cli.queue_commands import redis_error_line, render_stats
from pagedq.worker.config import EngineConfig, WorkerConfig
from pagedq.worker.config_flags import add_engine_flags, add_log_level_flag, engine_knobs

DEMO_PROMPTS = [
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "What is a paged KV cache?",
]
# Small on purpose: the live view's KV occupancy moves visibly (a few thousand tokens).
DEMO_KV_CACHE = "128MiB"
LINE_EVERY_S = 2.0  # progress lines without a terminal
DEMO_KV_HELP = f"Size of the KV cache (default here: {DEMO_KV_CACHE}, so its occupancy shows)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="see it work: embedded Redis, a worker, streamed prompts",
                       description="Start a private redis-server and a worker in this process, "
                       "put a few prompts on the queue at once and show their answers streaming "
                       "side by side with the worker's KV cache occupancy.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help=f"{PROMPT_HELP} (default: three short questions)")
    add_log_level_flag(p)
    add_engine_flags(p, helps={"kv_cache_memory": DEMO_KV_HELP})
    add_sampling_flags(p, defaults=COMMAND_SAMPLING["demo"], skip=("n", "logprobs", "seed"))
    p.set_defaults(func=run)


@dataclass
class Stream:
    """One prompt's answer as it arrives."""

    prompt: str
    text: str = ""
    tokens: int = 0
    first_token_s: float | None = None
    end: str | None = None


def run(args: argparse.Namespace) -> int:
    setup_console_logging(args.log_level)
    try:
        prompts = read_prompts(args.prompts) if args.prompts else DEMO_PROMPTS
        params = sampling_params(args, COMMAND_SAMPLING["demo"])
        engine = engine_knobs(args)
        if "num_kv_blocks" not in engine:
            engine.setdefault("kv_cache_memory", DEMO_KV_CACHE)
        EngineConfig(**engine)  # a bad flag fails here, before the model loads
    except PagedQError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with EmbeddedRedis.start(unix_socket=True) as server, advertised(server) as found_at:
        print(f"embedded redis-server on {redact_url(server.url)}" + (
            " (`pagedq stats` in another terminal finds it)" if found_at else ""), flush=True)
        worker, thread = start_worker(server.url, engine)
        if worker is None:
            return 1
        # the long waits are over; routine worker lines would interleave with the answers
        setup_console_logging("WARNING" if args.log_level == "INFO" else args.log_level)
        try:
            return stream_all(server.url, worker, prompts, params)
        except RedisError as exc:  # e.g. the embedded server was killed
            print(redis_error_line(server.url, exc), file=sys.stderr)
            return 1
        finally:
            worker.stop()
            thread.join(60)


def start_worker(url: str, engine: dict[str, Any]) -> tuple[Any, Any]:
    """A worker in a thread of this process, once its model is loaded (None if it failed)."""
    # measured: the service adds ~0.3 s to `pagedq --help` (0.9 s)
    from pagedq.worker.service.worker import Worker

    model = engine.pop("model", None)
    worker = Worker(WorkerConfig(model=model, redis_url=url, consumer_name="demo",
                                 checkpoint_interval=0.5, engine=engine))
    thread = threading.Thread(target=lambda: asyncio.run(worker.run()), daemon=True)
    thread.start()
    print("starting a worker: loading the model (the first run also prepares it; each long "
          "step is shown below)", flush=True)
    while not worker.ready.wait(0.5):
        if not thread.is_alive():
            print("the worker failed to start; see the log above", file=sys.stderr)
            return None, thread
    return worker, thread


def stream_all(url: str, worker: Any, prompts: list[str], params: Any) -> int:
    """Submit every prompt in one round trip, follow all streams at once, then print the
    queue's stats from a checkpoint written after the last answer."""
    tokenizer = worker.engine.tokenizer
    chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    streams = [Stream(p) for p in prompts]
    with Client(url) as client:
        start = time.perf_counter()
        handles = client.submit_many(
            [[{"role": "user", "content": p}] if chat else p for p in prompts], params)
        readers = [threading.Thread(target=follow, args=(h, s, start), daemon=True)
                   for h, s in zip(handles, streams, strict=True)]
        for r in readers:
            r.start()
        show = live_view if sys.stdout.isatty() else line_view
        show(client, streams, readers, start)
        done_at = time.time()
        print("\n" + render_stats(fresh_stats(client, done_at)))
    return 0 if all(s.end and s.end.startswith("done") for s in streams) else 1


def follow(handle: Any, stream: Stream, start: float) -> None:
    try:
        for ev in handle.stream(timeout=600):
            if ev.type == "tokens":
                if stream.first_token_s is None:
                    stream.first_token_s = time.perf_counter() - start
                stream.text += ev.text
                stream.tokens += len(ev.token_ids)
            elif ev.terminal:
                stream.end = event_sentence(ev)
    except Exception as exc:  # a reader must end, whatever went wrong, to end the demo
        stream.end = f"failed: {exc}"
    if stream.end is None:
        stream.end = "failed: the stream ended without a terminal event"


def kv_line(stats: dict[str, Any], streams: list[Stream], start: float) -> str:
    """The worker's KV occupancy and load (from its checkpoint), and the streams' pace."""
    w = (stats.get("workers") or [{}])[0]
    tokens = sum(s.tokens for s in streams)
    first = min((s.first_token_s for s in streams if s.first_token_s is not None), default=None)
    pace = tokens / (time.perf_counter() - start - first) if first is not None and tokens > 1 \
        else 0.0
    return (f"KV cache {w.get('kv_blocks_used', 0)}/{w.get('kv_blocks_total', 0)} blocks "
            f"({100 * float(w.get('kv_usage', 0)):.1f}%)  running {w.get('running', 0)}  "
            f"waiting {w.get('waiting', 0)}  queue depth {stats.get('depth', 0)}  "
            f"{tokens} tokens, {pace:.1f} tok/s")


def status(s: Stream) -> str:
    first = f"first token after {s.first_token_s:.2f} s; " if s.first_token_s is not None else ""
    return first + (s.end or f"{s.tokens} tokens so far")


def live_view(client: Any, streams: list[Stream], readers: list[Any], start: float) -> None:
    """The answers side by side, redrawn as tokens arrive, with the worker's KV occupancy."""
    # measured: rich's live view adds ~0.06 s (0.3 s alone) to `pagedq --help`
    from rich.console import Group
    from rich.live import Live
    from rich.table import Table
    from rich.text import Text

    def render(kv: str) -> Any:
        table = Table(expand=True, show_lines=True)
        for i, s in enumerate(streams, 1):
            table.add_column(f"{i}. {s.prompt}", ratio=1, overflow="fold")
        table.add_row(*[Text(s.text) for s in streams])
        table.add_row(*[Text(status(s), style="dim") for s in streams])
        return Group(table, Text(f"{time.perf_counter() - start:5.1f} s  {kv}"))

    kv = kv_line(client.stats(), streams, start)
    with Live(render(kv), refresh_per_second=10) as live:
        last_poll = time.perf_counter()
        while any(r.is_alive() for r in readers):
            time.sleep(0.1)
            if time.perf_counter() - last_poll > 0.5:
                kv, last_poll = kv_line(client.stats(), streams, start), time.perf_counter()
            live.update(render(kv))
        live.update(render(kv_line(client.stats(), streams, start)))


def line_view(client: Any, streams: list[Stream], readers: list[Any], start: float) -> None:
    """Without a terminal: one progress line per second, then each answer in full."""
    tick = start
    while any(r.is_alive() for r in readers):
        tick += LINE_EVERY_S
        for r in readers:
            r.join(timeout=max(0.0, tick - time.perf_counter()))
        progress = "  ".join(f"[{i}] {s.tokens} tok" for i, s in enumerate(streams, 1))
        kv = kv_line(client.stats(), streams, start)
        print(f"{time.perf_counter() - start:5.1f} s  {progress}  {kv}", flush=True)
    for i, s in enumerate(streams, 1):
        print(f"\n[{i}] >>> {s.prompt}\n{s.text}\n    ({status(s)})")


def fresh_stats(client: Any, after: float, timeout: float = 10.0) -> dict[str, Any]:
    """The queue's stats from checkpoints written after ``after`` (unix time) that show every
    job of the demo settled (a worker's job count and its engine's load are reported apart, so
    one checkpoint may still hold the other's last value)."""
    end = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if all(settled(w, after) for w in stats["workers"]) or time.monotonic() > end:
            return stats
        time.sleep(0.1)


def settled(worker: dict[str, Any], after: float) -> bool:
    return float(worker.get("heartbeat", 0)) > after and not any(
        int(worker.get(k, 0)) for k in ("jobs", "running", "waiting", "kv_blocks_used"))
