"""The HTTP layer under the app: uvicorn's h11 protocol plus a deadline for each request's headers.

uvicorn closes idle keep-alive connections but gives a client that opens a connection and never
finishes its headers all the time it wants (a slowloris holds a connection slot forever). The
body's deadline is the BodyLimit middleware's, which can answer 408.
"""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 60.0


class HeaderDeadlineProtocol(H11Protocol):
    """Closes a connection whose next request's headers have not all arrived `header_timeout` seconds
    after it opened (or after the previous response)."""

    header_timeout = HEADER_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


def uvicorn_config(app, *, header_timeout: float = HEADER_TIMEOUT_S, **options) -> uvicorn.Config:
    """uvicorn's Config for `app`, serving HTTP/1.1 with the header deadline."""
    protocol = type("HeaderDeadline", (HeaderDeadlineProtocol,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, http=protocol, **options)
