"""CLI: ``pagedq serve`` (the OpenAI HTTP gateway) and ``pagedq batch`` (a batch file offline).

Flags take their defaults from ``GatewayConfig``; FastAPI and uvicorn are imported only when
a command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pagedq.client.protocol import DEFAULT_PREFIX
from pagedq.worker.config import GatewayConfig, settings


def register(sub: argparse._SubParsersAction) -> None:
    d = GatewayConfig(api_keys=())
    p = sub.add_parser("serve", help="the OpenAI API over the queue (chat, completions, batches)")
    _add_queue_args(p, d)
    p.add_argument("--host", default=d.host, help=f"bind address (default {d.host})")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accepted Bearer key (repeatable; also $PAGEDQ_API_KEY, comma-separated)"
                        "; with none the gateway is open")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--max-queue-depth", type=int, default=d.max_queue_depth,
                   help="answer 429 while more interactive jobs wait (default: no limit)")
    p.add_argument("--disconnect-grace", type=float, default=d.disconnect_grace,
                   help="seconds a dropped stream may take to resume before its job is cancelled")
    p.add_argument("--ttl", type=int, default=d.ttl,
                   help="seconds a stream stays resumable (match the workers' --ttl)")
    p.add_argument("--files-dir", default=None,
                   help="keep files on disk here (share it between gateways) instead of Redis")
    p.add_argument("--max-file-bytes", type=int, default=d.max_file_bytes)
    p.add_argument("--files-ttl", type=int, default=d.files_ttl,
                   help="seconds files and finished batches are kept")
    p.add_argument("--max-batch-lines", type=int, default=d.max_batch_lines)
    p.add_argument("--batch-window", type=int, default=d.batch_window,
                   help="lines of one batch in the queue at once")
    p.add_argument("--batch-lease", type=float, default=d.batch_lease,
                   help="seconds before another gateway takes over a silent gateway's batches")
    p.add_argument("--redis-max-connections", type=int, default=d.redis_max_connections)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) through the queue")
    p.add_argument("input", type=Path, help="JSONL lines {custom_id, method, url, body}")
    p.add_argument("-o", "--output", type=Path, required=True, help="results, one line each")
    _add_queue_args(p, d)
    p.add_argument("--window", type=int, default=d.batch_window,
                   help="lines in the queue at once")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for a live worker (the embedded one loads its model)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_batch)


def _add_queue_args(p: argparse.ArgumentParser, d: GatewayConfig) -> None:
    p.add_argument("--redis-url", default=None,
                   help="default: $REDIS_URL; without either, an embedded redis-server and one "
                        "worker on --model start")
    p.add_argument("--queue", default=d.queue)
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--model", default=None,
                   help="the embedded worker's model (only without a Redis URL; default: the "
                        "bundled SmolLM2-135M)")


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        redis_url=args.redis_url, queue=args.queue, prefix=args.prefix, host=args.host,
        port=args.port, api_keys=tuple(args.api_key) or settings().api_keys,
        max_body_bytes=args.max_body_bytes, max_queue_depth=args.max_queue_depth,
        disconnect_grace=args.disconnect_grace, ttl=args.ttl, files_dir=args.files_dir,
        max_file_bytes=args.max_file_bytes, files_ttl=args.files_ttl,
        max_batch_lines=args.max_batch_lines, batch_window=args.batch_window,
        batch_lease=args.batch_lease, redis_max_connections=args.redis_max_connections)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedq.worker.gateway.app import create_app
    from pagedq.worker.gateway.local import queue_stack
    from pagedq.worker.logging import configure_logging, get_logger

    configure_logging(json=False, level=args.log_level)
    log = get_logger("pagedq.gateway")
    config = gateway_config(args)
    if not config.api_keys:
        log.warning("no API key configured: anyone who can reach the gateway may use it; set "
                    "--api-key or $PAGEDQ_API_KEY")
    with queue_stack(config.redis_url, config.queue, config.prefix, args.model) as url:
        log.info("gateway listening", url=f"http://{config.host}:{config.port}/v1",
                 queue=config.queue)
        uvicorn.run(create_app(config, url), host=config.host, port=config.port,
                    loop=_loop(), http="httptools", log_level=args.log_level.lower(),
                    access_log=False, timeout_graceful_shutdown=5)
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    import asyncio

    from pagedq.worker.gateway.local import queue_stack
    from pagedq.worker.gateway.offline import run_batch, summary

    if not args.input.is_file():
        print(f"error: {args.input} is not a file", file=sys.stderr)
        return 2
    with queue_stack(args.redis_url, args.queue, args.prefix, args.model) as url:
        ok, failed = asyncio.run(run_batch(args.input, args.output, url, args.queue,
                                           args.prefix, args.window, args.ready_timeout,
                                           progress=not args.no_progress))
    print(summary(ok, failed, args.output))
    return 0 if failed == 0 else 1


def _loop() -> Any:
    try:
        import uvloop  # noqa: F401

        return "uvloop"
    except ImportError:
        return "asyncio"
