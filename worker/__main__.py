"""``python -m pagedq.worker``: run a queue worker (the same flags as ``pagedq worker``)."""

from __future__ import annotations

import argparse
import sys

from pagedq.worker.service.commands import add_worker_args, cmd_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedq.worker",
                                     description="Run a pagedq queue worker.")
    add_worker_args(parser)
    return cmd_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
