"""The engine: scheduler, paged KV blocks, model runner, sampler (see engine.py for the loop)."""

from pagedq.errors import (
    EngineError,
    InvalidParamsError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLongError,
)
from pagedq.worker.engine.engine import Engine
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
