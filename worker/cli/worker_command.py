"""``pagedq worker`` (and ``python -m pagedq.worker``): serve a Redis queue with one engine."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from pagedq.worker.config import WorkerConfig
from pagedq.worker.config_flags import (
    add_config_flags,
    add_engine_flags,
    add_log_level_flag,
    engine_knobs,
    given,
)

DESCRIPTION = ("Run a queue worker: read jobs from a Redis stream, run them on one engine with "
               "continuous batching, and stream their tokens back.")
# fields that are not flags of their own: --model is the engine's, engine is the engine group
NOT_FLAGS = ("model", "engine")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run a queue worker (Redis Streams in, tokens out)",
                       description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flags(p.add_argument_group("queue"), WorkerConfig, skip=NOT_FLAGS)
    g = p.add_argument_group("logging")
    g.add_argument("--log-format", choices=["json", "console"], default="json",
                   help="JSON lines for log collectors, or readable lines (default: json)")
    add_log_level_flag(g)
    add_engine_flags(p)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The WorkerConfig the flags describe; engine knobs not given keep EngineConfig's defaults."""
    engine = engine_knobs(args)
    model = engine.pop("model", None)
    return WorkerConfig(**given(args, WorkerConfig, skip=NOT_FLAGS),
                        **({"model": model} if model is not None else {}), engine=engine)


def run(args: argparse.Namespace) -> int:
    # Until the service installs its own handlers, a SIGTERM (a deploy stopping a worker that
    # is still starting) ends the process cleanly instead of killing it with -15.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from pagedq.logging import configure_logging  # structlog: ~0.2 s on `pagedq --help`
    from pagedq.worker.service.worker import run_worker  # ~0.3 s on `pagedq --help`

    configure_logging(json=args.log_format == "json", level=args.log_level)
    return run_worker(worker_config(args))


def standalone_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m pagedq.worker``: the same flags as ``pagedq worker``."""
    parser = argparse.ArgumentParser(prog="python -m pagedq.worker", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> Any:
    return run(standalone_parser().parse_args(argv))
