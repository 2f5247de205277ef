"""CLI: ``pagedq worker | submit | stats | demo`` (registered by worker/cli.py).

Only ``worker`` and ``demo`` import the engine (torch); ``submit`` and ``stats`` use the SDK.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from pagedq.client.protocol import DEFAULT_PREFIX, DEFAULT_QUEUE, DEFAULT_TTL_S
from pagedq.worker.generate_cmd import add_engine_arguments, engine_kwargs

DEMO_PROMPTS = [
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "What is a paged KV cache?",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run a queue worker (Redis Streams in, tokens out)")
    add_worker_args(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("submit", help="enqueue a prompt and stream its tokens to the terminal")
    p.add_argument("prompt", help="text, or token ids like '1,5,9' with --token-ids")
    _add_conn_args(p)
    p.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated ids")
    p.add_argument("--chat", action="store_true", help="send it as one user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--deadline", type=float, default=None, help="seconds from now")
    p.add_argument("--timeout", type=float, default=None, help="give up waiting after this")
    p.add_argument("--json", action="store_true", help="print each event as a JSON line")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("stats", help="live table of queue depth and workers (KV occupancy)")
    _add_conn_args(p)
    p.add_argument("--watch", type=float, default=1.0, help="refresh period; 0 prints once")
    p.add_argument("--json", action="store_true", help="print the raw stats once as JSON")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("demo", help="embedded Redis + a worker + a few streamed requests")
    p.add_argument("--model", default=None, help="default: the engine's default model")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("prompts", nargs="*", help=f"default: {DEMO_PROMPTS}")
    p.set_defaults(func=cmd_demo)


def _add_conn_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help="default: $REDIS_URL or localhost:6379")
    p.add_argument("--queue", default=os.environ.get("PAGEDQ_QUEUE", DEFAULT_QUEUE))
    p.add_argument("--prefix", default=DEFAULT_PREFIX)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    g = p.add_argument_group("queue")
    g.add_argument("--redis-url", default=None,
                   help="default: $REDIS_URL; without either, an embedded redis-server starts")
    g.add_argument("--queue", default=env("PAGEDQ_QUEUE", DEFAULT_QUEUE))
    g.add_argument("--prefix", default=DEFAULT_PREFIX)
    g.add_argument("--consumer-name", default=None,
                   help="stable consumer name (default: $PAGEDQ_CONSUMER_NAME or the host name)")
    g.add_argument("--reclaim-after", type=float, default=30.0,
                   help="seconds without a lease renewal before another worker takes a job")
    g.add_argument("--max-deliveries", type=int, default=3,
                   help="deliveries after which a job is dead-lettered")
    g.add_argument("--ttl", type=int, default=DEFAULT_TTL_S,
                   help="seconds each request's output stream and state live after a write")
    g.add_argument("--checkpoint-interval", type=float, default=1.0)
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running jobs get to finish before hand-back")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics and /healthz on this port (0: any free one)")
    g.add_argument("--metrics-host", default="0.0.0.0")
    g.add_argument("--log-format", choices=["json", "console"], default="json")
    g.add_argument("--log-level", default="INFO")
    add_engine_arguments(p, model_default=env("PAGEDQ_MODEL"))


def worker_config(args: argparse.Namespace) -> Any:
    from pagedq.worker.config import WorkerConfig

    engine = engine_kwargs(args)
    engine.pop("model")
    return WorkerConfig(
        model=args.model, redis_url=args.redis_url, queue=args.queue, prefix=args.prefix,
        consumer_name=args.consumer_name, reclaim_after=args.reclaim_after,
        max_deliveries=args.max_deliveries, ttl=args.ttl,
        checkpoint_interval=args.checkpoint_interval, drain_timeout=args.drain_timeout,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, engine=engine)


def cmd_worker(args: argparse.Namespace) -> int:
    from pagedq.worker.logging import configure_logging
    from pagedq.worker.service.worker import run_worker

    configure_logging(json=args.log_format == "json", level=args.log_level)
    return run_worker(worker_config(args))


def _params(args: argparse.Namespace) -> Any:
    from pagedq.client import SamplingParams

    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens)


def cmd_submit(args: argparse.Namespace) -> int:
    from pagedq.client import Client, ProtocolError, RequestError, ResultTimeoutError

    prompt: Any = args.prompt
    if args.token_ids:
        prompt = [int(x) for x in args.prompt.replace(" ", "").split(",") if x]
    elif args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    deadline = time.time() + args.deadline if args.deadline else None
    with Client(args.redis_url, args.queue, prefix=args.prefix) as client:
        try:
            handle = client.submit(prompt, _params(args), deadline=deadline,
                                   priority=args.priority)
        except ProtocolError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            for ev in handle.stream(timeout=args.timeout):
                _print_event(ev, args.json, args.n)
            handle.result(timeout=0.001)
        except ResultTimeoutError as exc:
            print(f"\n{exc}", file=sys.stderr)
            return 3
        except RequestError as exc:
            print(f"\n{exc}", file=sys.stderr)
            return 1
    return 0


def _print_event(ev: Any, as_json: bool, n: int) -> None:
    if as_json:
        body = {k: v for k, v in vars(ev).items() if v not in (None, [], "")}
        print(json.dumps(body), flush=True)
        return
    if ev.type == "tokens":
        piece = ev.text if ev.text else "".join(f"[{t}]" for t in ev.token_ids)
        print(f"[{ev.index}] {piece}" if n > 1 else piece, end="\n" if n > 1 else "", flush=True)
    elif ev.type == "finished":
        print(f"\n-- finished {ev.finish_reasons} {ev.usage}", file=sys.stderr)
    else:
        print(f"\n-- {ev.type}: {ev.error or ''}", file=sys.stderr)


def render_stats(stats: dict[str, Any]) -> str:
    """The ``pagedq stats`` table (pure, so it is testable)."""
    lines = [f"queue {stats['queue']}: depth {stats['depth']}  in flight {stats['pending']}  "
             f"dead letters {stats['dead_letters']}"]
    for level, v in stats["levels"].items():
        lines.append(f"  {level:<7} waiting {v['lag']:>6}  in flight {v['pending']:>6}")
    header = (f"{'worker':<24}{'state':<10}{'jobs':>6}{'run':>6}{'wait':>6}{'kv used':>14}"
              f"{'kv %':>7}{'tok/s':>9}{'preempt':>9}{'age s':>7}")
    lines += ["", header, "-" * len(header)]
    now = time.time()
    for w in stats["workers"]:
        kv = f"{w.get('kv_blocks_used', 0)}/{w.get('kv_blocks_total', 0)}"
        lines.append(
            f"{str(w['name'])[:23]:<24}{str(w.get('state', '?')):<10}{w.get('jobs', 0):>6}"
            f"{w.get('running', 0):>6}{w.get('waiting', 0):>6}{kv:>14}"
            f"{100 * float(w.get('kv_usage', 0)):>6.1f}%{float(w.get('tokens_per_s', 0)):>9.1f}"
            f"{w.get('preemptions', 0):>9}{now - float(w.get('heartbeat', now)):>7.1f}")
    if not stats["workers"]:
        lines.append("(no live workers)")
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    from pagedq.client import Client

    with Client(args.redis_url, args.queue, prefix=args.prefix) as client:
        if args.json:
            print(json.dumps(client.stats(), indent=2, default=str))
            return 0
        try:
            while True:
                table = render_stats(client.stats())
                if args.watch <= 0:
                    print(table)
                    return 0
                print("\x1b[2J\x1b[H" + table, flush=True)
                time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Embedded Redis, one in-process worker, a few requests streamed side by side."""
    import threading

    from pagedq.client import Client, SamplingParams
    from pagedq.worker.config import WorkerConfig
    from pagedq.worker.logging import configure_logging
    from pagedq.worker.service.embedded_redis import EmbeddedRedis
    from pagedq.worker.service.worker import Worker

    configure_logging(json=False, level="WARNING")
    with EmbeddedRedis.start() as server:
        print(f"embedded redis-server listening on {server.url}")
        worker = Worker(WorkerConfig(model=args.model, redis_url=server.url,
                                     consumer_name="demo"))
        thread = threading.Thread(target=_run, args=(worker,), daemon=True)
        thread.start()
        print("loading the model (first use may take a while)...")
        while not worker.ready.wait(0.5):
            if not thread.is_alive():
                print("the worker failed to start; see the log above", file=sys.stderr)
                return 1
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        with Client(server.url) as client:
            for prompt in args.prompts or DEMO_PROMPTS:
                print(f"\n>>> {prompt}")
                handle = client.submit([{"role": "user", "content": prompt}]
                                       if worker.engine.tokenizer is not None
                                       and getattr(worker.engine.tokenizer, "chat_template",
                                                   None) else prompt, params)
                start = time.perf_counter()
                for ev in handle.stream(timeout=600):
                    _print_event(ev, False, 1)
                print(f"   ({time.perf_counter() - start:.2f}s)")
            print("\n" + render_stats(client.stats()))
        worker.stop()
        thread.join(60)
    return 0


def _run(worker: Any) -> None:
    import asyncio

    asyncio.run(worker.run())
