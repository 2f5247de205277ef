"""CLI: ``pagedq serve`` (the OpenAI HTTP gateway) and ``pagedq batch`` (a batch file offline).

Flags come from ``GatewayConfig`` and ``EngineConfig`` through the config layer's
pagedq.worker.config_flags (never the worker's CLI); FastAPI and uvicorn are imported only
when a command runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ssl
import sys
from pathlib import Path
from typing import Any

from pagedq.worker.config import EngineConfig, GatewayConfig, QueueConfig
from pagedq.worker.config_flags import (
    add_config_flags,
    add_engine_flags,
    add_log_level_flag,
    engine_knobs,
    given,
    to_flags,
)

NOT_FLAGS = ("api_keys", "admin_keys")  # --api-key, --admin-key, repeatable, below
QUEUE_FIELDS = tuple(f.name for f in dataclasses.fields(QueueConfig))
MODEL_HELP = ("the embedded worker's model, when no Redis URL is given (default: the bundled "
              "SmolLM2-135M); the other engine flags also go to that worker")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="the OpenAI API over the queue (chat, completions, batches)",
                       description="Serve OpenAI's HTTP API over a pagedq queue. See "
                                   "docs/gateway.md.")
    add_config_flags(p, GatewayConfig, skip=NOT_FLAGS)
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accepted Bearer key (repeatable; default: $PAGEDQ_API_KEY, "
                        "comma-separated); with none the gateway is open. Each key is a "
                        "tenant: another key cannot see its files, batches or streams")
    p.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                   help="a Bearer key that sees every tenant's files, batches and streams "
                        "(repeatable; default: $PAGEDQ_ADMIN_KEY)")
    add_log_level_flag(p)
    add_engine_flags(p, helps={"model": MODEL_HELP})
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) through the queue",
                       description="Run an OpenAI batch file through the queue, offline.")
    p.add_argument("input", type=Path, help="JSONL lines {custom_id, method, url, body}")
    p.add_argument("-o", "--output", type=Path, required=True, help="results, one line each")
    add_config_flags(p, GatewayConfig, only=QUEUE_FIELDS + ("batch_window",))
    add_engine_flags(p, helps={"model": MODEL_HELP})
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for a live worker (the embedded one loads its model)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_batch)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    keys: dict[str, Any] = {}
    if getattr(args, "api_key", None):
        keys["api_keys"] = tuple(args.api_key)
    if getattr(args, "admin_key", None):
        keys["admin_keys"] = tuple(args.admin_key)
    return GatewayConfig(**given(args, GatewayConfig, skip=NOT_FLAGS), **keys)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The embedded worker's engine, from the engine flags given (checked here, before any
    process starts: a bad value is a usage error, not a worker that dies loading)."""
    return EngineConfig(**engine_knobs(args))


def cmd_serve(args: argparse.Namespace) -> int:
    # measured: the app (FastAPI, the routes) and uvicorn take ~2.6 s to import, structlog ~0.2 s;
    # `pagedq --help` registers this module, and only `serve` needs them
    import uvicorn

    from pagedq.gateway.app import create_app
    from pagedq.gateway.http_timeouts import timed_protocol
    from pagedq.gateway.local import queue_stack
    from pagedq.logging import configure_logging, get_logger

    configure_logging(json=False, level=args.log_level)
    log = get_logger("pagedq.gateway")
    config = gateway_config(args)
    if not config.api_keys and not config.admin_keys:
        log.warning("no API key configured: anyone who can reach the gateway may use it; set "
                    "--api-key or $PAGEDQ_API_KEY")
    engine = engine_config(args)
    refusal = https_refusal(config)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    scheme = "https" if config.ssl_certfile else "http"
    with queue_stack(config.redis_url, config.queue, config.prefix, to_flags(engine),
                     model=engine.model) as url:
        log.info("gateway listening", url=f"{scheme}://{config.host}:{config.port}/v1",
                 queue=config.queue)
        uvicorn.run(create_app(config, url), host=config.host, port=config.port,
                    ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile,
                    loop=_loop(), log_level=args.log_level.lower(),
                    http=timed_protocol(config.timeout_header, config.timeout_body),
                    access_log=False, timeout_graceful_shutdown=5,
                    limit_concurrency=config.limit_concurrency,
                    timeout_keep_alive=config.timeout_keep_alive)
    return 0


def https_refusal(config: GatewayConfig) -> str | None:
    """Why the HTTPS flags cannot serve (one without the other, an unreadable or mismatched
    pair), checked before any process starts; None when they can (or HTTPS is off)."""
    cert, key = config.ssl_certfile, config.ssl_keyfile
    if not cert and not key:
        return None
    if not (cert and key):
        return "--ssl-certfile and --ssl-keyfile go together: give both to serve HTTPS"
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        return (f"cannot serve HTTPS with --ssl-certfile {cert} and --ssl-keyfile {key}: {exc} "
                "(both PEM; the key must be the certificate's, unencrypted)")
    return None


def cmd_batch(args: argparse.Namespace) -> int:
    # measured: the batch runner (pydantic's models, prometheus_client, tqdm, structlog) takes
    # ~1 s to import; only `batch` needs it (queue_stack: structlog and rich, ~0.2 s, as in serve)
    from pagedq.gateway.batch_file import run_batch, summary
    from pagedq.gateway.local import queue_stack

    if not args.input.is_file():
        print(f"error: {args.input} is not a file", file=sys.stderr)
        return 2
    config, engine = gateway_config(args), engine_config(args)
    with queue_stack(config.redis_url, config.queue, config.prefix, to_flags(engine),
                     until_loaded="the lines start once it has", worker_log_level="ERROR",
                     model=engine.model) as url:
        ok, failed = asyncio.run(run_batch(args.input, args.output, url, config.queue,
                                           config.prefix, config.batch_window,
                                           args.ready_timeout, progress=not args.no_progress,
                                           tls=config.tls))
    print(summary(ok, failed, args.output))
    return 0 if failed == 0 else 1


def _loop() -> Any:
    try:
        import uvloop  # noqa: F401 - optional: uvloop is not built for Windows

        return "uvloop"
    except ImportError:
        return "asyncio"
