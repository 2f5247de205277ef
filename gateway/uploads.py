"""An upload read as it arrives: a multipart/form-data body parsed chunk by chunk, its file
part written to the store (``FileWriter``) in bounded pieces, the size limit enforced while
reading.

Starlette's ``request.form()`` would spool the file to a temporary file and the route then
read it whole; here the gateway holds at most ``FLUSH`` bytes of an upload at a time, and an
upload past its limit (the file size, or what the tenant's and the gateway's quotas leave) is
cut off at the limit, its partial bytes dropped, without reading the rest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from pagedq.gateway.api_errors import bad_request

FLUSH = 1 << 20  # bytes of the file gathered before one write to the store
MAX_FIELD_BYTES = 1024  # a form field besides the file ("purpose") is a short word
MAX_PARTS = 8


class FileWriter(Protocol):
    """Where an upload's bytes go as they arrive (files.py: Redis or a directory)."""

    async def write(self, chunk: bytes) -> None: ...

    async def abort(self) -> None: ...


class UploadOverLimit(Exception):
    """The file passed the bytes it was allowed; the caller says which limit that was."""


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


@dataclass
class Upload:
    """What the form held: its small fields, and the file's name and size (its bytes went to
    the writer)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file_field: str = ""  # the file part's form name ("file" when sent as OpenAI's SDK does)
    size: int = 0


class _Events:
    """python-multipart's callbacks are synchronous: they queue what they see, and the async
    reader acts on it (writes to the store) after each chunk is fed."""

    def __init__(self) -> None:
        self.queue: list[tuple[str, Any]] = []
        self._field = b""
        self._value = b""

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": lambda: self.queue.append(("begin", None)),
            "on_part_data": lambda d, s, e: self.queue.append(("data", bytes(d[s:e]))),
            "on_part_end": lambda: self.queue.append(("end", None)),
            "on_header_field": self._on_field,
            "on_header_value": self._on_value,
            "on_header_end": self._on_header_end,
            "on_end": lambda: self.queue.append(("done", None)),
        }

    def _on_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _on_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _on_header_end(self) -> None:
        self.queue.append(("header", (self._field.lower(), self._value)))
        self._field = self._value = b""


async def read_upload(content_type: str, body: AsyncIterator[bytes], writer: FileWriter,
                      allowed: int) -> Upload:
    """Parse the form from ``body``, writing its one file part to ``writer``; raise
    ``UploadOverLimit`` as soon as the file passes ``allowed`` bytes, a 400 for a body that is
    no form. The caller aborts the writer on any exception."""
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data" or not options.get(b"boundary"):
        raise bad_request("send the file as multipart/form-data (fields 'file' and 'purpose')",
                          "file")
    events = _Events()
    parser = MultipartParser(options[b"boundary"], events.callbacks())
    reader = _FormReader(writer, allowed)
    try:
        async for chunk in body:
            parser.write(chunk)
            await reader.take(events.queue)
        parser.finalize()
    except MultipartParseError as exc:
        raise bad_request(f"the multipart form could not be parsed: {exc}", "file") from None
    await reader.take(events.queue)
    if not reader.done:  # python-multipart finalizes a form cut short without complaint
        raise bad_request("the multipart form ended before its closing boundary", "file")
    await reader.flush()
    return reader.upload


class _FormReader:
    """Acts on the parser's events: small fields kept, the file's data forwarded in pieces of
    at most ``FLUSH`` bytes, the limits checked as each piece arrives."""

    def __init__(self, writer: FileWriter, allowed: int):
        self.writer, self.allowed = writer, allowed
        self.upload = Upload()
        self.part = _Part()
        self.parts = 0
        self.pending = bytearray()
        self.done = False

    async def take(self, queue: list[tuple[str, Any]]) -> None:
        events = queue[:]
        queue.clear()
        for kind, value in events:
            if kind == "begin":
                self._begin()
            elif kind == "header":
                self.part.headers[value[0]] = value[1]
            elif kind == "data":
                await self._data(value)
            elif kind == "end":
                await self._end()
            elif kind == "done":
                self.done = True

    def _begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise bad_request(f"the form has more than {MAX_PARTS} parts", "file")
        self.part = _Part()

    def _disposition(self) -> None:
        """Name the part from its Content-Disposition, once, at its first data or its end."""
        if self.part.name:
            return
        _, options = parse_options_header(self.part.headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        if not name:
            raise bad_request("a form part has no Content-Disposition name", "file")
        self.part.name = name.decode("utf-8", "replace")
        filename = options.get(b"filename")
        if filename is not None:
            if self.upload.filename is not None:
                raise bad_request("send one file per upload", "file")
            self.part.filename = filename.decode("utf-8", "replace")[:255] or "upload.jsonl"
            self.upload.filename, self.upload.file_field = self.part.filename, self.part.name

    async def _data(self, data: bytes) -> None:
        self._disposition()
        if self.part.filename is None:
            self.part.value += data
            if len(self.part.value) > MAX_FIELD_BYTES:
                raise bad_request(f"form field {self.part.name!r} is over {MAX_FIELD_BYTES} "
                                  "bytes", self.part.name)
            return
        self.upload.size += len(data)
        if self.upload.size > self.allowed:
            raise UploadOverLimit()
        self.pending += data
        if len(self.pending) >= FLUSH:
            await self.flush()

    async def _end(self) -> None:
        self._disposition()
        if self.part.filename is None:
            self.upload.fields[self.part.name] = self.part.value.decode("utf-8", "replace")
        else:
            await self.flush()

    async def flush(self) -> None:
        if self.pending:
            await self.writer.write(bytes(self.pending))
            self.pending.clear()
