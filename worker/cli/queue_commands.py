"""``pagedq submit`` and ``pagedq stats``: the queue from a terminal, through the client SDK.

Neither imports torch or the engine: they talk to Redis only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from redis.exceptions import AuthenticationError, RedisError, ResponseError

from pagedq.client import Client, ProtocolError, RequestError, ResultTimeoutError
from pagedq.client.connection import redact_url
from pagedq.errors import InvalidParamsError, InvalidRequestError
from pagedq.redis_url import client_redis_url
from pagedq.worker.cli.console import PROMPT_HELP, event_sentence, read_prompt
from pagedq.worker.cli.flags import COMMAND_SAMPLING, add_sampling_flags, sampling_params
from pagedq.worker.config import QueueConfig
from pagedq.worker.config_flags import add_config_flags, given

NO_REDIS_HINT = ("start one (`pagedq worker` with no --redis-url starts an embedded Redis that "
                 "this command finds), or point --redis-url / REDIS_URL at yours")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="put a prompt on the queue and stream the answer",
                       description="Enqueue one prompt for the workers serving the queue and "
                       "print the answer as it streams back. Text goes as a chat message "
                       "(the worker applies its model's chat template); --raw sends it as a "
                       "plain completion prompt.")
    p.add_argument("prompt", metavar="PROMPT",
                   help=PROMPT_HELP + "; with --token-ids, comma-separated ids like 1,5,9")
    add_connection_flags(p)
    form = p.add_mutually_exclusive_group()
    form.add_argument("--raw", action="store_true",
                      help="send the text as a plain completion prompt, not a chat message")
    form.add_argument("--token-ids", action="store_true",
                      help="the prompt is comma-separated token ids of the worker's model")
    form.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # the default
    p.add_argument("--priority", type=int, default=0,
                   help="higher is served first (default: 0)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds from now after which the job is cut off")
    p.add_argument("--timeout", type=float, default=None,
                   help="give up waiting for the answer after this many seconds (the job stays "
                   "queued)")
    p.add_argument("--wait", action="store_true",
                   help="when no worker serves the queue, wait for one instead of leaving the "
                   "job queued and exiting")
    p.add_argument("--json", action="store_true", help="print each event as a JSON line")
    add_sampling_flags(p, defaults=COMMAND_SAMPLING["submit"])
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("stats", help="show the queue's depth and its workers' load",
                       description="Print the queue's depth and every live worker's load "
                       "(running jobs, KV cache occupancy, tokens/s) once; --watch follows.")
    add_connection_flags(p)
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the raw stats once as JSON")
    p.set_defaults(func=cmd_stats)


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """QueueConfig's flags: --redis-url, the TLS files, --queue, --prefix, --ttl."""
    add_config_flags(p.add_argument_group("queue"), QueueConfig)


def queue_config(args: argparse.Namespace) -> QueueConfig:
    """The queue the flags name (QueueConfig's defaults for those not given)."""
    return QueueConfig(**given(args, QueueConfig))


def redis_url_of(args: argparse.Namespace) -> str:
    """--redis-url, else $REDIS_URL, else a local worker's advertised embedded server, else
    Redis on localhost's default port."""
    return client_redis_url(queue_config(args).redis_url)


def connect(args: argparse.Namespace, url: str) -> Client:
    """A Client on the queue the flags name, over TLS when --redis-ca/--redis-cert are given."""
    return Client(url, **queue_config(args).client_options())


def redis_error_line(url: str, exc: Exception) -> str:
    """One line for a Redis failure: which Redis, what went wrong, what to do."""
    where = redact_url(url)
    if isinstance(exc, AuthenticationError) or "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
        return (f"error: Redis at {where} refused the credentials: put the password in the URL "
                "(redis://:PASSWORD@host:6379/0)")
    if isinstance(exc, ResponseError):
        return f"error: Redis at {where} answered with an error: {exc}"
    return f"error: cannot reach Redis at {where} ({exc or type(exc).__name__}): {NO_REDIS_HINT}"


def submit_prompt(args: argparse.Namespace) -> Any:
    """What ``submit`` sends: chat messages by default, text with --raw, or token ids."""
    text = read_prompt(args.prompt)
    if args.token_ids:
        try:
            return [int(x) for x in text.replace(" ", "").strip().split(",") if x]
        except ValueError:
            raise InvalidRequestError(
                f"--token-ids expects comma-separated integers, got {text.strip()[:40]!r}"
            ) from None
    return text if args.raw else [{"role": "user", "content": text}]


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        prompt = submit_prompt(args)
        params = sampling_params(args, COMMAND_SAMPLING["submit"])
    except (InvalidRequestError, InvalidParamsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    url = redis_url_of(args)
    try:
        with connect(args, url) as client:
            return submit_and_stream(args, client, prompt, params)
    except RedisError as exc:
        print(redis_error_line(url, exc), file=sys.stderr)
        return 1


def submit_and_stream(args: argparse.Namespace, client: Any, prompt: Any, params: Any) -> int:
    """Enqueue, warn at once when no worker serves the queue (or wait for one that announces
    it is loading its model), then print the answer."""
    deadline = time.time() + args.deadline if args.deadline else None
    try:
        handle = client.submit(prompt, params, deadline=deadline, priority=args.priority)
    except (ProtocolError, InvalidParamsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stats = client.stats()
    if not stats["workers"] and stats.get("starting"):
        print(f"a worker is starting on queue {client.keys.queue!r} (loading its model); "
              f"waiting for it (Ctrl-C stops waiting; the job stays queued, id {handle.id}).",
              file=sys.stderr)
    elif not stats["workers"]:
        print(f"no worker has checkpointed on queue {client.keys.queue!r} in the last few "
              f"seconds; the job stays queued (id {handle.id}) for the next worker. "
              + ("Waiting for one (Ctrl-C stops waiting; the job stays queued)." if args.wait
                 else "Pass --wait to wait here (e.g. while a worker is still starting)."),
              file=sys.stderr)
        if not args.wait:
            return 3
    try:
        texts = []
        for ev in handle.stream(timeout=args.timeout):
            print_event(ev, args.json, params.n)
            texts.append(ev.text)
        result = handle.result(timeout=0.001)
        if not args.json and not any(texts) and result.token_ids:
            print(f"(the model has no tokenizer; token ids: {result.token_ids})")
    except ResultTimeoutError:
        print(f"\nno answer within {args.timeout:g} s; the job stays queued (id {handle.id})",
              file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"\nstopped waiting; the job stays queued (id {handle.id})", file=sys.stderr)
        return 130
    except RequestError as exc:
        if "no chat template" in str(exc) and isinstance(prompt, list):
            print("hint: this model has no chat template; pass --raw to send the text as "
                  "a plain completion prompt", file=sys.stderr)
        return 1
    return 0


def print_event(ev: Any, as_json: bool, n: int) -> None:
    if as_json:
        body = {k: v for k, v in vars(ev).items() if v not in (None, [], "")}
        print(json.dumps(body), flush=True)
        return
    if ev.type == "tokens":  # text held back (half a UTF-8 character) arrives with the next
        if n > 1:
            if ev.text:
                print(f"[{ev.index}] {ev.text}", flush=True)
        else:
            print(ev.text, end="", flush=True)
    else:
        print(f"\n-- {event_sentence(ev)}", file=sys.stderr)


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
    if stats.get("starting"):
        lines.append(f"({stats['starting']} worker(s) starting: loading the model)")
    elif not stats["workers"]:
        lines.append("(no live workers)")
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    url = redis_url_of(args)
    try:
        with connect(args, url) as client:
            return show_stats(args, client)
    except RedisError as exc:
        print(redis_error_line(url, exc), file=sys.stderr)
        return 1


def show_stats(args: argparse.Namespace, client: Any) -> int:
    if args.json:
        print(json.dumps(client.stats(), indent=2, default=str))
        return 0
    try:
        while True:
            table = render_stats(client.stats())
            if not args.watch:
                print(table)
                return 0
            print("\x1b[2J\x1b[H" + table, flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
