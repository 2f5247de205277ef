"""``python -m pagedq.worker.cli``: the ``pagedq`` command line."""

import sys

from pagedq.worker.cli import main

sys.exit(main())
