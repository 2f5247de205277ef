"""``python -m pagedq.worker``: run a queue worker (the same flags as ``pagedq worker``)."""

from __future__ import annotations

import sys

from pagedq.worker.cli.worker_command import main

if __name__ == "__main__":
    sys.exit(main())
