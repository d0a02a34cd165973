"""The HTTP/1.1 layer under the app: uvicorn's h11 protocol with the limits a server facing hostile clients needs.

What plain uvicorn (h11) lets through, measured with raw sockets (issue 22):
- a request with both ``Content-Length`` and ``Transfer-Encoding`` is accepted and the connection kept, so a second
  request hidden in the body is answered (request smuggling behind a proxy; RFC 9112 §6.3 says reject or close);
- a 100 KB header block in one write is accepted (h11 bounds only an *incomplete* head, 16 KB by default);
- a client that stalls before its head is complete is never timed out (uvicorn's keep-alive timer starts only after
  a response, and any byte resets it: one byte every few seconds holds a connection forever).

``GuardedH11Protocol`` answers these with a JSON 4xx and ``Connection: close``: 400 for CL + TE, 431 for a head
over ``max_header_bytes`` (sent in one write or many), 408 when a request head has not arrived in full within
``request_timeout`` seconds of the connection opening or of the previous response (a connection that sent nothing
in that time is closed without a word, as uvicorn closes idle keep-alive connections: a 408 there could cross a
request the client is sending just then). A stalled *body* is the app's to time out (it knows the endpoint).
Each refusal is reported to ``on_reject(status)`` (the app counts them in its metrics).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_HEADER_BYTES = 32 << 10  # the request line and every header; nginx's default is 4 x 8 KB
DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds for a request head, and for a body once the head is in


class _GuardedConnection(h11.Connection):
    """h11's server connection that also refuses a complete head over ``max_header_bytes`` and CL + TE framing.

    ``on_request`` is called with every request head h11 parses (pipelined ones included)."""

    def __init__(self, max_header_bytes: int, on_request):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes, self.on_request = max_header_bytes, on_request
        self.last_error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                self.on_request()
                _check_head(event, self.max_header_bytes)
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise
        return event


def _check_head(event: h11.Request, max_header_bytes: int) -> None:
    names = [name for name, _ in event.headers]
    if b"transfer-encoding" in names and b"content-length" in names:
        raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding: the body's length is ambiguous")
    size = len(event.method) + len(event.target) + 12 + sum(len(n) + len(v) + 4 for n, v in event.headers.raw_items())
    if size > max_header_bytes:
        raise h11.RemoteProtocolError(f"request headers over {max_header_bytes} bytes", error_status_hint=431)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline, a head size cap and CL + TE rejection (see the module doc).

    Configure a subclass with ``guarded_protocol(...)`` and pass it as ``uvicorn.Config(http=...)``."""

    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    request_timeout = DEFAULT_REQUEST_TIMEOUT
    on_reject: Callable[[int], None] | None = None  # a staticmethod in configured subclasses

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _GuardedConnection(self.max_header_bytes, self._on_request)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_seen = False  # a request head arrived since the timer was last armed
        self._num_bytes = 0  # received since the timer was last armed

    def data_received(self, data: bytes) -> None:
        self._num_bytes += len(data)
        super().data_received(data)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._head_seen = False
        super().on_response_complete()  # may parse a pipelined head at once
        if not self._head_seen and not self.transport.is_closing():
            self._arm()  # the next head (and any unread rest of this body) must come in time

    def _on_request(self) -> None:
        self._head_seen = True
        self._disarm()

    def _arm(self) -> None:
        self._disarm()
        self._num_bytes = 0
        self._head_timer = self.loop.call_later(self.request_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # the app is answering a request: its own timeouts apply
        if self._num_bytes:
            self._reject(408, f"no complete request head within {self.request_timeout:g} s")
        self.transport.close()

    def _reject(self, status: int, message: str) -> None:
        self.transport.write(_raw_response(status, message))
        if self.on_reject is not None:
            self.on_reject(status)

    def send_400_response(self, msg: str) -> None:
        """Every malformed request (h11's errors and ours) gets a JSON body with the right status, then close."""
        self._disarm()
        error = self.conn.last_error
        self._reject(error.error_status_hint if error is not None else 400, str(error) if error is not None else msg)
        self.transport.close()


def guarded_protocol(
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    on_reject: Callable[[int], None] | None = None,
) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` class with these limits, for ``uvicorn.Config(http=...)``; ``on_reject(status)`` is
    called for every request refused at the HTTP layer."""
    attrs = {
        "max_header_bytes": max_header_bytes,
        "request_timeout": request_timeout,
        "on_reject": staticmethod(on_reject) if on_reject else None,
    }
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attrs)


_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


def _raw_response(status: int, message: str) -> bytes:
    """A complete response written straight to the socket: the connection closes after it, so h11's state is moot."""
    code = {408: "request_timeout", 431: "request_header_fields_too_large"}.get(status)
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Bad Request')}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body.encode()
