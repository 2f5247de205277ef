"""pagedq client SDK: enqueue generation jobs on Redis Streams and stream their tokens back.

Importing this package pulls in only redis and msgpack (never torch), so any service can
submit jobs without the inference stack installed.
"""

from pagedq.client.aio import AsyncClient, AsyncRequestHandle
from pagedq.client.client import Client, RequestHandle
from pagedq.client.connection import TLSFiles
from pagedq.client.protocol import PROTOCOL_VERSION, Event, Keys, Limits, Request
from pagedq.client.request_errors import (
    DeadLetteredError,
    DuplicateRequestError,
    PagedQError,
    ProtocolError,
    RequestCancelledError,
    RequestError,
    RequestFailedError,
    ResultTimeoutError,
    StreamGapError,
)
from pagedq.client.result import CompletionResult, Result
from pagedq.client.result_builder import ResultBuilder
from pagedq.errors import InvalidParamsError
from pagedq.params import SamplingParams, StructuredOutputsParams

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncClient",
    "AsyncRequestHandle",
    "Client",
    "CompletionResult",
    "DeadLetteredError",
    "DuplicateRequestError",
    "Event",
    "InvalidParamsError",
    "Keys",
    "Limits",
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
    "TLSFiles",
]
