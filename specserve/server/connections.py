"""The server's HTTP/1.1 connections: uvicorn's h11 protocol with two limits it lacks.

- A header timeout: a connection gets `header_timeout_s` seconds from its opening (or, kept
  alive, from the first byte of its next request) to send complete request headers; then it is
  answered 408 and closed. uvicorn's own timers cover idle kept-alive connections and, in the
  app, the Guard covers bodies (--body-timeout); nothing covered headers, so a client sending
  half a request held its socket and file descriptor for ever, and a few hundred of them
  exhausted the process's descriptors until /health stopped answering.
- A connection cap: past `max_connections` open connections a new one is answered 503 with
  Retry-After and closed at once, so its descriptor returns at once. (uvicorn's
  `limit_concurrency` answers 503 only after reading the request's headers, which a slow client
  never completes.)

Together they bound what slow clients hold: at most `max_connections` descriptors, each for at
most `header_timeout_s` seconds before its headers, and the launcher checks the process may open
that many.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.server.errors import error_body


def _raw_response(status: str, message: str, code: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 error response in the API's error format, for a connection that has not
    sent a request (so h11 has none to answer)."""
    body = json.dumps(error_body(int(status.split()[0]), message, code=code)).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-content-type-options: nosniff\r\n{extra}connection: close\r\n\r\n").encode() + body


def connection_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...) with these limits."""
    too_slow = _raw_response("408 Request Timeout", f"the request headers were not complete after "
                             f"{header_timeout_s:g} seconds (--header-timeout)", "header_timeout")
    too_many = _raw_response("503 Service Unavailable", f"the server holds its limit of {max_connections} open "
                             "connections (--max-connections); retry shortly", "too_many_connections",
                             "retry-after: 1\r\n")

    class LimitedH11Protocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
                transport.write(too_many)
                transport.close()
                self.transport = transport  # connection_lost still comes; it finds no request
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()  # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            self._sync()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request already buffered
            self._sync()

        def _sync(self) -> None:
            """Headers complete: stop the clock. Still waiting with bytes of a request
            buffered: keep it running (or start it, for a pipelined one)."""
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                self._disarm()
            elif self.conn.trailing_data[0]:
                self._arm()

        def _arm(self) -> None:
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_late(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(too_slow)
                self.transport.close()

    return LimitedH11Protocol
