"""The ``pagedq`` command line.

Each module named in COMMANDS has ``register(subparsers)``, which adds its subcommands and
sets ``func`` on each to a callable taking the parsed args and returning an exit code. Heavy
imports (torch, the engine) happen inside those callables, so ``pagedq --help``, ``submit``
and ``stats`` start fast. Flags come from the config dataclasses through pagedq.worker.config_flags.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module -> the subcommands it registers. Another part of pagedq adds its commands with one
# line here; a module that is not installed is skipped.
COMMANDS: dict[str, tuple[str, ...]] = {
    "pagedq.worker.cli.generate": ("generate", "chat"),
    "pagedq.worker.cli.worker_command": ("worker",),
    "pagedq.worker.cli.queue_commands": ("submit", "stats"),
    "pagedq.worker.cli.demo": ("demo",),
    "pagedq.worker.cli.kv_plan": ("plan",),
    "pagedq.bench.command": ("bench",),
    "pagedq.gateway.commands": ("serve", "batch"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq", description="pagedq: a queue-native LLM inference worker.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
