"""pagedq client SDK: enqueue generation jobs on Redis Streams and stream their tokens back.

Importing this package pulls in only redis and msgpack (never torch), so any service can
submit jobs without the inference stack installed.
"""

from pagedq.client.aio import AsyncClient, AsyncRequestHandle
from pagedq.client.client import Client, CompletionResult, RequestHandle, Result, ResultBuilder
from pagedq.client.errors import (
    DeadLetteredError,
    PagedQError,
    ProtocolError,
    RequestCancelledError,
    RequestError,
    RequestFailedError,
    ResultTimeoutError,
    StreamGapError,
)
from pagedq.client.protocol import PROTOCOL_VERSION, Event, Keys, Request
from pagedq.errors import InvalidParamsError
from pagedq.params import SamplingParams, StructuredOutputsParams

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncClient",
    "AsyncRequestHandle",
    "Client",
    "CompletionResult",
    "DeadLetteredError",
    "Event",
    "InvalidParamsError",
    "Keys",
    "PagedQError",
    "ProtocolError",
    "Request",
    "RequestCancelledError",
    "RequestError",
    "RequestFailedError",
    "RequestHandle",
    "Result",
    "ResultBuilder",
    "ResultTimeoutError",
    "SamplingParams",
    "StreamGapError",
    "StructuredOutputsParams",
]
