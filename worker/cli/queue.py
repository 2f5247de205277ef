"""``pagedq submit`` and ``pagedq stats``: the queue from a terminal, through the client SDK.

Neither imports torch or the engine: they talk to Redis only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pagedq.worker.cli.flags import add_config_flags, add_sampling_flags, sampling_params
from pagedq.worker.config import WorkerConfig

# A terminal user wants a greedy, readable answer, not the wire's 16 random tokens.
SAMPLING_DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 0.0}
CONNECTION = ("redis_url", "queue", "prefix")
REDIS_URL_HELP = "Redis holding the queue (default: $REDIS_URL, else redis://localhost:6379/0)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="enqueue a prompt and stream its tokens to the terminal",
                       description="Enqueue one prompt and print its tokens as a worker "
                       "streams them.")
    p.add_argument("prompt", help="text, or token ids like '1,5,9' with --token-ids")
    add_connection_flags(p)
    p.add_argument("--token-ids", action="store_true", help="the prompt is comma-separated ids")
    p.add_argument("--chat", action="store_true", help="send it as one user chat message")
    p.add_argument("--priority", type=int, default=0,
                   help="higher is served first (default: 0)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds from now after which the job is cut off")
    p.add_argument("--timeout", type=float, default=None,
                   help="give up waiting for the result after this many seconds")
    p.add_argument("--json", action="store_true", help="print each event as a JSON line")
    add_sampling_flags(p, defaults=SAMPLING_DEFAULTS)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("stats", help="live table of queue depth and workers (KV occupancy)",
                       description="Show the queue's depth and every live worker's load.")
    add_connection_flags(p)
    p.add_argument("--watch", type=float, default=1.0,
                   help="refresh every this many seconds; 0 prints once (default: 1)")
    p.add_argument("--json", action="store_true", help="print the raw stats once as JSON")
    p.set_defaults(func=cmd_stats)


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    add_config_flags(p.add_argument_group("queue"), WorkerConfig, only=CONNECTION,
                     helps={"redis_url": REDIS_URL_HELP})


def connect(args: argparse.Namespace) -> Any:
    """A Client on the queue the flags name (WorkerConfig's defaults for those not given)."""
    from pagedq.client import Client

    defaults = WorkerConfig()
    conn = {k: getattr(args, k, getattr(defaults, k)) for k in CONNECTION}
    return Client(conn["redis_url"], conn["queue"], prefix=conn["prefix"])


def cmd_submit(args: argparse.Namespace) -> int:
    from pagedq.client import ProtocolError, RequestError, ResultTimeoutError
    from pagedq.errors import InvalidParamsError

    prompt: Any = args.prompt
    if args.token_ids:
        prompt = [int(x) for x in args.prompt.replace(" ", "").split(",") if x]
    elif args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    deadline = time.time() + args.deadline if args.deadline else None
    with connect(args) as client:
        try:
            params = sampling_params(args, SAMPLING_DEFAULTS)
            handle = client.submit(prompt, params, deadline=deadline, priority=args.priority)
        except (ProtocolError, InvalidParamsError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            for ev in handle.stream(timeout=args.timeout):
                print_event(ev, args.json, params.n)
            handle.result(timeout=0.001)
        except ResultTimeoutError as exc:
            print(f"\n{exc}", file=sys.stderr)
            return 3
        except RequestError as exc:
            print(f"\n{exc}", file=sys.stderr)
            return 1
    return 0


def print_event(ev: Any, as_json: bool, n: int) -> None:
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
    with connect(args) as client:
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
