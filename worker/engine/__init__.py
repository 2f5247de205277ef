"""The engine: scheduler, paged KV blocks, model runner, sampler (see engine.py for the loop)."""

from typing import Any

from pagedq.worker.engine.errors import (
    EngineError,
    InvalidParamsError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLongError,
)
from pagedq.worker.engine.outputs import CompletionOutput, RequestOutput, StepOutput

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineError",
    "InvalidParamsError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "RequestOutput",
    "RequestTooLongError",
    "StepOutput",
]


def __getattr__(name: str) -> Any:
    """``Engine`` loads lazily: the model code imports engine submodules (errors) without a cycle."""
    if name == "Engine":
        from pagedq.worker.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'pagedq.worker.engine' has no attribute {name!r}")
