"""Tests of spec_engine.server.http_guard, driven directly: bytes in through ``data_received``, bytes out through a
recording transport, and the head deadline fired by hand from a recording event loop (no sockets, no clock)."""

from __future__ import annotations

import json

import h11
import pytest
import uvicorn
from uvicorn.server import ServerState

from spec_engine.server.http_guard import _check_head, guarded_protocol

MAX_HEADER_BYTES = 1024
TIMEOUT = 7.0


class Transport:
    """What the protocol writes, and whether it closed the connection."""

    def __init__(self):
        self.written, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def status(self) -> int:
        return int(self.written.split(b" ", 2)[1]) if self.written else 0

    def error(self) -> dict:
        return json.loads(self.written.split(b"\r\n\r\n", 1)[1])["error"]


class Timer:
    def __init__(self, delay: float, callback):
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """Records timers instead of running them; an app task is recorded and never run."""

    def __init__(self):
        self.timers: list[Timer] = []
        self.tasks: list = []

    def call_later(self, delay: float, callback) -> Timer:
        self.timers.append(Timer(delay, callback))
        return self.timers[-1]

    def create_task(self, coro):
        coro.close()  # the app is not under test
        self.tasks.append(coro)
        return Task()

    def armed(self) -> list[Timer]:
        return [t for t in self.timers if not t.cancelled]


class Task:
    def add_done_callback(self, fn) -> None: ...


async def app(scope, receive, send):  # never runs (Loop.create_task)
    raise AssertionError("the guard must answer this request itself")


def connect(max_header_bytes: int = MAX_HEADER_BYTES):
    rejected: list[int] = []
    cls = guarded_protocol(max_header_bytes, TIMEOUT, rejected.append)
    config = uvicorn.Config(app, http=cls, log_level="critical", h11_max_incomplete_event_size=max_header_bytes)
    loop, transport = Loop(), Transport()
    protocol = cls(config, ServerState(), {}, _loop=loop)
    protocol.connection_made(transport)
    return protocol, transport, loop, rejected


def head(extra: str = "", target: str = "/v1/completions") -> bytes:
    return f"POST {target} HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n{extra}\r\n".encode()


# --- the configured class ---------------------------------------------------------------------------------------


def test_guarded_protocol_carries_its_limits():
    seen = []
    cls = guarded_protocol(123, 4.5, seen.append)
    assert cls.max_header_bytes == 123 and cls.request_timeout == 4.5
    cls.on_reject(431)
    assert seen == [431]
    assert guarded_protocol().on_reject is None


# --- framing and size ---------------------------------------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_refused():
    protocol, transport, _, rejected = connect()
    protocol.data_received(head("transfer-encoding: chunked\r\n") + b"{}")
    assert transport.status() == 400 and transport.closed and rejected == [400]
    assert "ambiguous" in transport.error()["message"]
    assert b"connection: close" in transport.written


@pytest.mark.parametrize("writes", [1, 37])
def test_a_head_over_the_limit_gets_431(writes):
    """One write (a complete head, which h11 alone lets through) or many (an incomplete head h11 bounds)."""
    protocol, transport, _, rejected = connect()
    data = head("x-pad: " + "a" * 2 * MAX_HEADER_BYTES + "\r\n")
    step = -(-len(data) // writes)
    for i in range(0, len(data), step):
        if transport.closed:
            break
        protocol.data_received(data[i : i + step])
    assert transport.status() == 431 and transport.closed and rejected == [431]
    assert transport.error()["code"] == "request_header_fields_too_large"


def test_check_head_counts_the_request_line_and_every_header():
    def request(pad: int) -> h11.Request:
        return h11.Request(method="GET", target="/x", headers=[("host", "h"), ("x-pad", "a" * pad)])

    size = len("GET") + len("/x") + 12 + (4 + 1 + 4) + (5 + 4)  # what _check_head counts for pad 0
    _check_head(request(100), size + 100)  # exactly at the limit: accepted
    with pytest.raises(h11.RemoteProtocolError) as e:
        _check_head(request(101), size + 100)
    assert e.value.error_status_hint == 431


def test_a_small_valid_head_reaches_the_app():
    protocol, transport, loop, rejected = connect()
    protocol.data_received(head() + b"{}")
    assert transport.written == b"" and not transport.closed and rejected == []
    assert len(loop.tasks) == 1  # handed to the app
    assert loop.armed() == []  # the head deadline is off while the app answers


# --- the head deadline --------------------------------------------------------------------------------------------


def test_the_deadline_is_armed_when_the_connection_opens():
    _, _, loop, _ = connect()
    (timer,) = loop.armed()
    assert timer.delay == TIMEOUT


def test_a_stalled_head_gets_408_and_close():
    protocol, transport, loop, rejected = connect()
    protocol.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # no blank line: the head never ends
    (timer,) = loop.armed()
    timer.callback()
    assert transport.status() == 408 and transport.closed and rejected == [408]
    assert transport.error()["code"] == "request_timeout"


def test_a_silent_connection_is_closed_without_a_word():
    """No byte in time: closed like an idle keep-alive connection; a 408 could cross a request being sent."""
    _, transport, loop, rejected = connect()
    (timer,) = loop.armed()
    timer.callback()
    assert transport.closed and transport.written == b"" and rejected == []


def test_bytes_do_not_reset_the_deadline():
    """A byte every few seconds must not hold a connection open: arrival of data leaves the one timer in place."""
    protocol, _, loop, _ = connect()
    for byte in b"POST /v1/":
        protocol.data_received(bytes([byte]))
    assert len(loop.timers) == 1 and not loop.timers[0].cancelled
