"""pagedq.worker: the engine, model loading, the queue service and the CLI.

``Engine`` is imported lazily so ``pagedq --help`` and the service's start-up stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedq.worker.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        # the engine imports torch (~5 s): every `pagedq` command imports this package (its CLI lives here)
        from pagedq.worker.engine import Engine

        return Engine
    raise AttributeError(f"module 'pagedq.worker' has no attribute {name!r}")
