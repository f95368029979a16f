"""The HTTP/1.1 connections of ``serve`` (library): uvicorn's h11 protocol with two deadlines,
so a client holds a connection only while it sends a request at a pace, or is being answered.

    config = uvicorn.Config(app, http=timed_protocol(idle=5.0, read=30.0, log=print), ...)

- ``idle`` (``serve.idle_timeout``): a connection with no request under way, just opened or
  after its last answer, is closed after ``idle`` seconds. uvicorn's own keep-alive timer
  starts only after an answer, and any byte cancels it for good, so a connection that never
  sent a request, or sent part of one, stayed open for ever.
- ``read`` (``serve.read_timeout``): a request has ``read`` seconds from its first byte for its
  headers and its whole body; bytes that trickle in do not extend it. Headers not all here by
  then: a 408 in OpenAI's error shape with ``Connection: close``, then the connection is
  closed (one log line). A body the app is reading: the app answers the 408 itself, on its own
  clock, which starts a moment later (utils/serve/intake.py ``read_json``); should the request still
  be arriving at twice ``read``, the connection is cut. A body nobody reads (the app answered
  without it): the connection is closed (one log line).
- A request that is all here has no deadline while the app holds it (a generation, a stream):
  ``serve.max_queue`` and the request's length bound those.

No cap on the number of connections (uvicorn's ``limit_concurrency`` would count idle ones
and answer real requests 503 once they filled it): each connection costs a socket and this
object, the deadlines free it, the process's open-file limit bounds how many there are at
once (docs/serve.md, Security).
"""
from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from utils.serve.protocol import clip, error_body

IDLE, READING, HELD = "idle", "reading", "held"     # what a connection is doing (see _phase_now)
INVALID_HTTP = "llm_pipeline.invalid_http"           # scope key: this request's bytes broke HTTP (app's log)
# h11's status for a request it refuses (its error_status_hint) -> the reason and what to do
REFUSED_HTTP = {
    400: (b"Bad Request", "the request is not valid HTTP/1.1 (a malformed request line, header, "
                          "Content-Length or chunked body): send it with a standard HTTP client."),
    431: (b"Request Header Fields Too Large", "the request's headers are larger than this server "
                                              "reads (h11's limit): send fewer or shorter headers."),
    501: (b"Not Implemented", "the request's Transfer-Encoding is not supported (only chunked, "
                              "once): send the body with Content-Length or chunked."),
}


class _Connection(h11.Connection):
    """h11's connection, keeping the status h11 suggests for the last request it refused
    (uvicorn drops the exception and always answers 400), and taking a request target in
    absolute form (``GET http://host:8000/health``, which a client sends when it takes this
    server for its proxy; RFC 9112 3.2.2: a server must accept it) as its path and query:
    uvicorn routed the whole URL as a path, a 404."""

    refused_status = 400

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.refused_status = e.error_status_hint if e.error_status_hint in REFUSED_HTTP else 400
            raise
        if isinstance(event, h11.Request) and event.target[:8].lower().startswith((b"http://", b"https://")):
            url = urllib.parse.urlsplit(event.target)
            target = (url.path or b"/") + (b"?" + url.query if url.query else b"")
            event = h11.Request(method=event.method, target=target, headers=event.headers,
                                http_version=event.http_version)
        return event


def timed_protocol(idle: float, read: float, log: Callable[[str], None]) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these deadlines (seconds)."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"idle_timeout": idle, "read_timeout": read, "log": staticmethod(log)})


class TimedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol with the idle and read deadlines above: after each thing that can
    change what the connection is doing (it opens, bytes arrive, an answer completes),
    :meth:`_watch` arms the deadline of what it does now; a deadline set for a phase stays
    while the phase lasts (more bytes of the same request do not move it)."""

    idle_timeout = 5.0
    read_timeout = 30.0
    log: Callable[[str], None] = staticmethod(print)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size   # as uvicorn's own connection has it
        self.conn = _Connection(h11.SERVER, *(() if limit is None else (limit,)))
        self._phase: Optional[str] = None
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._overtime = False              # the app had its own read_timeout on top of ours
        self._handed_over = False           # a WebSocket upgrade: the connection is another protocol's

    # -- uvicorn's hooks, each followed by a look at the phase
    def connection_made(self, transport) -> None:       # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._handed_over = True
        self._arm(None)
        super().handle_websocket_upgrade(event)

    # -- phases and deadlines
    def _phase_now(self) -> Optional[str]:
        """IDLE: no byte of a request is here; READING: part of one is (headers, or a body
        still coming, read or not); HELD: the request is all here and the app has it; None:
        the connection is closing or no longer this protocol's."""
        if self.transport is None or self.transport.is_closing() or self._handed_over:
            return None
        their = self.conn.their_state
        if their is h11.SEND_BODY or (their is h11.IDLE and self.conn.trailing_data[0]):
            return READING
        return IDLE if their is h11.IDLE else HELD

    def _watch(self) -> None:
        phase = self._phase_now()
        if phase != self._phase:
            self._arm(phase)

    def _arm(self, phase: Optional[str]) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase, self._overtime = phase, False
        if phase == IDLE:
            self._deadline = self.loop.call_later(self.idle_timeout, self._idle_passed)
        elif phase == READING:
            self._deadline = self.loop.call_later(self.read_timeout, self._read_passed)

    def _idle_passed(self) -> None:
        self._deadline = None
        if self._phase_now() == IDLE:
            self.timeout_keep_alive_handler()           # uvicorn's: h11 ConnectionClosed, close

    def _read_passed(self) -> None:
        self._deadline = None
        if self._phase_now() != READING:
            return
        if self.conn.their_state is h11.IDLE:           # its headers never all came: nobody answered
            self._answer_408()
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not self._overtime:
            self._overtime = True                       # the app is reading the body: it answers
            self._deadline = self.loop.call_later(self.read_timeout, self._read_passed)
            return
        path = clip(self.scope["path"]) if self.scope else "?"
        if self._overtime:
            self.log(f"a request to {path} was still sending its body after twice serve.read_timeout "
                     f"({self.read_timeout:g} s), unanswered: connection closed")
        else:
            self.log(f"a request to {path} was still sending its body after serve.read_timeout "
                     f"({self.read_timeout:g} s), after its answer: connection closed")
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1 (a malformed request line, header or
        chunk size, conflicting Content-Length values ...), in OpenAI's error shape instead of
        plain text, with the status h11 names (431 for a header block over its limit, 501 for
        a Transfer-Encoding it does not implement, else 400), then the connection closed. A
        request whose body broke it is marked (``INVALID_HTTP`` in its scope): the app, which
        then sees the connection gone, logs why instead of "a client left"."""
        if self.scope is not None and self.cycle is not None and not self.cycle.response_complete:
            self.scope[INVALID_HTTP] = True
        status = getattr(self.conn, "refused_status", 400)
        reason, message = REFUSED_HTTP[status]
        self._answer(status, reason, message, "invalid_http")

    def _answer_408(self) -> None:
        """A 408 in OpenAI's error shape for a request whose headers did not all come, then
        the connection closed."""
        self._answer(408, b"Request Timeout", f"the request's headers did not arrive within "
                     f"{self.read_timeout:g} s (serve.read_timeout): send it without pausing.", "request_timeout")
        self.log(f"a client sent no complete request headers in serve.read_timeout ({self.read_timeout:g} s): "
                 "answered 408, connection closed")

    def _answer(self, status: int, reason: bytes, message: str, code: str) -> None:
        """An error in OpenAI's shape with ``Connection: close`` where no request is being
        answered (none came whole), then the connection closed."""
        body = json.dumps(error_body(message, code=code), separators=(",", ":")).encode("ascii")
        headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        try:
            out = self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
            out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
            self.transport.write(out)
        except h11.LocalProtocolError:                  # h11 cannot answer in this state: just close
            pass
        self.transport.close()
