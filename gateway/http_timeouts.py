"""Read timeouts uvicorn lacks: a client must send a request's headers within
``--timeout-header`` seconds, and may not pause its body for more than ``--timeout-body``.

uvicorn (0.55) closes an idle keep-alive connection, but a connection that never finishes its
headers (slowloris: a byte every few seconds) holds a socket and a slot of
``--limit-concurrency`` for good, and so does a body that stops arriving. This subclass of
uvicorn's httptools protocol arms a timer for each and closes the connection when one fires.
A reverse proxy in front (docs/gateway.md) buffers slow clients as well.

The same subclass ends an idle HTTPS keep-alive connection at once on shutdown. uvicorn's
graceful shutdown closes an idle connection with ``transport.close()``; over TLS that sends the
server's close_notify and then waits (asyncio's and uvloop's ``ssl_shutdown_timeout``, 30 s) for
the client's, which a pooling client that is not reading never sends. The connection then stays
in uvicorn's list and SIGTERM waits out the whole graceful limit. TLS lets the closing side drop
the connection once its close_notify is sent (RFC 8446 section 6.1), so after
``TLS_CLOSE_GRACE_S`` an idle connection is aborted. Requests and streams in flight keep
uvicorn's handling and the graceful limit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedq.logging import get_logger

log = get_logger("pagedq.gateway.http")

# time an idle TLS connection gets at shutdown to flush what it has queued and send close_notify
# before it is dropped without the client's reply (plain TCP needs none: its close is at once)
TLS_CLOSE_GRACE_S = 0.2


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and a body idle timeout; the two
    class attributes are set per server by ``timed_protocol``."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._abort_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header()  # a connection that sends nothing at all is held to it too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._abort_timer is not None:
            self._abort_timer.cancel()
            self._abort_timer = None
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: an idle connection is closed, a busy one closes after
        its response. Over TLS the idle one's close would wait for the client's close_notify
        (module docstring), so it is aborted after ``TLS_CLOSE_GRACE_S``."""
        idle = self.cycle is None or self.cycle.response_complete
        super().shutdown()
        if idle and self.transport.get_extra_info("ssl_object") is not None:
            self._abort_timer = self.loop.call_later(TLS_CLOSE_GRACE_S, self._abort_closing)

    def _abort_closing(self) -> None:
        """Drop a closing TLS connection whose client has not answered close_notify; one that
        still has a response's bytes to send (writing paused: the client reads slowly) keeps
        uvicorn's graceful limit instead, so no answer is cut short."""
        self._abort_timer = None
        if self.flow.write_paused:
            self._abort_timer = self.loop.call_later(TLS_CLOSE_GRACE_S, self._abort_closing)
            return
        log.debug("dropping an idle TLS connection at shutdown without the client's close_notify",
                  client=self.client[0] if self.client else None)
        self.transport.abort()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a request's first byte on a kept-alive connection
            self._arm_header()

    def on_headers_complete(self) -> None:
        self._cancel_timers()
        super().on_headers_complete()
        if self.parser.get_method() not in (b"GET", b"HEAD", b"OPTIONS", b"DELETE"):
            self._arm_body()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._body_timer is not None:
            self._arm_body()

    def on_message_complete(self) -> None:
        self._cancel_body()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._cancel_body()
        super().on_response_complete()

    def _arm_header(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _arm_body(self) -> None:
        self._cancel_body()
        self._body_timer = self.loop.call_later(self.body_timeout, self._body_late)

    def _cancel_timers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._cancel_body()

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        self._close("headers not complete within --timeout-header", self.header_timeout)

    def _body_late(self) -> None:
        self._body_timer = None
        if self.flow is not None and self.flow.read_paused:  # the app reads slowly, not them
            self._arm_body()
            return
        self._close("request body paused past --timeout-body", self.body_timeout)

    def _close(self, why: str, seconds: float) -> None:
        if self.transport is not None and not self.transport.is_closing():
            log.info("closing a slow client's connection", reason=why, seconds=seconds,
                     client=self.client[0] if self.client else None)
            self.transport.close()


def timed_protocol(header_timeout: float, body_timeout: float) -> type[TimedHttpProtocol]:
    """The protocol class to hand uvicorn (``http=``) for these two timeouts."""
    return type("TimedHttpProtocol", (TimedHttpProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})
