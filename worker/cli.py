"""The ``pagedq`` command line: one subcommand per module, imported only when used.

Each module in COMMANDS exposes ``register(subparsers)``, which adds its parser(s) and sets
``func`` to a callable taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module -> the subcommands it registers (kept here so `pagedq --help` lists them all)
COMMANDS: dict[str, tuple[str, ...]] = {
    "pagedq.worker.generate_cmd": ("generate", "chat"),
    "pagedq.worker.service.commands": ("worker", "submit", "stats", "demo"),
    "pagedq.worker.bench.cli": ("bench",),
    "pagedq.worker.gateway.commands": ("serve", "batch"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedq", description=__doc__.splitlines()[0])
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
