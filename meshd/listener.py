"""The outbound listener: HTTP/1.1 server connections on raw asyncio protocols (uvloop
compatible), parsed by httptools (llhttp, the parser of Node.js). It frames requests and
responses and enforces the limits of the connection; what a request means is the
handler's business (meshd/sidecar.py and the layers behind it).

A read that holds exactly one request of the plainest shape (a known method, an ASCII
head, a Content-Length body or none; what inference clients send) is read by one compiled
call (filters/request_head.py) instead of llhttp's callbacks; it reads only what llhttp
would read the same way, and leaves everything else, errors and limits included, to llhttp.

Why not aiohttp's server: per request it builds a Request, a CIMultiDict of headers, a
StreamReader for the body and a StreamResponse that runs three coroutine layers per write;
`python -m loadtest.listener_bench` times both on the same requests. The client side is
meshd/upstream.py, on the same footing.

Contract (RFC 9112):
- Requests are read one after another on a connection; pipelined ones wait, in order,
  until the response before them is complete (section 9.3.2), with reading paused while
  one waits, so a pipelining client cannot make the listener buffer without bound.
- Bodies: Content-Length or chunked (llhttp checks the framing, e.g. two Content-Lengths
  or chunked after another coding is a 400). `Expect: 100-continue` is answered when the
  handler first reads the body, so a request refused on its head never sends it; another
  expectation is a 417 (RFC 9110 10.1.1).
- Upgrade (e.g. curl's `Upgrade: h2c`) is ignored, as RFC 9110 7.8 allows: the request is
  served over HTTP/1.1. CONNECT is refused with 405.
- Limits, each answered with an OpenAI-style error body and `Connection: close`: the head's
  header count and bytes (431), a head that does not arrive within client_header_timeout_s
  (408), a body over max_body_bytes (413, as soon as Content-Length says so, else once the
  body passes it) or slower than client_body_timeout_s (408), malformed framing (400).
  An idle keep-alive connection is closed after keepalive_timeout_s.
- A handler returns a `Reply` (sent whole, with Content-Length) or streams through
  `HttpRequest.stream()`; a client that goes away cancels its handler at once (the relay
  then drops the upstream connection, so the engine stops generating).
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import http
import logging
import time
import types
from asyncio.tasks import _enter_task, _leave_task
from asyncio.tasks import current_task as _current_task
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import httptools

from filters.hotpath import read_request_fields, read_simple_request
from meshd.http_message import (
    BodyError,
    Handler,
    HttpRequest,
    ListenerLimits,
    RejectHook,
    Reply,
    error_reply,
)

log = logging.getLogger("meshd.listener")

__all__ = ["HttpServer"]

# A connection stops reading while a pipelined request waits for the one before it.
_MAX_QUEUED = 1
# Bytes of a head past which the connection is cut without waiting for the count to be
# checked at its end (a single endless header line would otherwise be buffered by the
# parser): the limit, plus room for the request line.
_HEAD_SLACK = 8192
# The longest a head or keep-alive deadline may pass unnoticed.
_SWEEP_MAX_S = 1.0
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
_NO_BODY_STATUS = frozenset({204, 304})


class HttpServer:
    """A protocol factory for asyncio's `create_server` (and the transparent listener), and
    the set of connections it made, for a graceful shutdown."""

    def __init__(
        self, handler: Handler, limits: ListenerLimits, on_reject: RejectHook | None = None
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.on_reject = on_reject
        self.connections: set[_Connection] = set()
        self.closing = False
        self._idle: asyncio.Event | None = None
        # One sweep for every connection's head and keep-alive deadlines, instead of a
        # timer armed and cancelled twice a request; it runs while connections exist.
        self._sweep_s = min(
            _SWEEP_MAX_S, limits.client_header_timeout_s / 4, limits.keepalive_timeout_s / 4
        )
        self._sweeper: asyncio.TimerHandle | None = None

    def __call__(self) -> _Connection:
        return _Connection(self)

    def _watch(self, conn: _Connection) -> None:
        self.connections.add(conn)
        if self._sweeper is None:
            self._sweeper = conn.loop.call_later(self._sweep_s, self._sweep, conn.loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for conn in list(self.connections):
            callback = conn._on_deadline
            if callback is not None and now >= conn._deadline:
                conn._on_deadline = None
                callback()
        self._sweeper = (
            loop.call_later(self._sweep_s, self._sweep, loop) if self.connections else None
        )

    def _forget(self, conn: _Connection) -> None:
        self.connections.discard(conn)
        if not self.connections and self._idle is not None:
            self._idle.set()

    async def shutdown(self, timeout_s: float) -> None:
        """Close idle connections now and the others once their response is complete. What
        still runs after `timeout_s` is cut, properly: a stream gets its `drain_tail` (an
        SSE error event) and the end of its body, a response not begun a 503; the handler
        is cancelled with its request marked `drained`. Then the connections close."""
        self.closing = True
        for conn in list(self.connections):
            conn.close_when_idle()
        if self.connections:
            self._idle = asyncio.Event()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
            except TimeoutError:
                pass
        reply = error_reply(
            503,
            f"meshd is shutting down and its drain period ({timeout_s:g} s) ran out",
            "draining",
            retry_after_s=1,
            close=True,
        )
        for conn in list(self.connections):
            conn.cut_for_drain(reply)
        for _ in range(50):  # the closes flush what was written; a stuck peer is aborted
            if not self.connections:
                break
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.abort()
        # Let cancelled handlers run their cleanup before the caller closes what they use.
        for _ in range(3):
            await asyncio.sleep(0)


class _Connection(asyncio.Protocol):
    """One client connection: parser callbacks, the request queue and flow control."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        self.closed = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._queue: collections.deque[HttpRequest | Reply] = collections.deque()
        self._task: asyncio.Task[None] | None = None  # the handler task (_serve)
        # The handler task's wait for the next request, while it waits.
        self._idle: asyncio.Future[HttpRequest | bool | _Begun] | None = None
        self._current: HttpRequest | None = None  # the request being handled
        self._parsing: HttpRequest | None = None  # the request whose bytes arrive now
        self._url: list[bytes] = []
        self._headers: list[tuple[str, str]] = []
        self._raw_fields: list[tuple[bytes, bytes]] = []  # the head's fields as they came
        self._max_fields = server.limits.max_header_count
        self._head_bytes = 0
        self._head_error: str | None = None
        self._content_length: int | None = None
        self._expect: str | None = None
        self._in_head = False
        self._raw_body = 0  # bytes of an upgrade request's body still to come, unparsed
        self._reading = True
        self._deadline = 0.0  # loop time at which _on_deadline runs
        self._on_deadline: Callable[[], None] | None = None
        self._close_when_idle = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.remote = str(peer[0])
        self.server._watch(self)
        if self.server.closing:
            self.close_when_idle()
        self._arm(self.limits.client_header_timeout_s, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        if self.closed or self._close_when_idle:
            if self.closed or (self._current is None and not self._queue):
                return
        elif self._parsing is None and not self._in_head:
            # Between messages: a read that is exactly one plain request is read in one
            # compiled call (filters/request_head.py), without llhttp's callbacks; any
            # other bytes go to llhttp, which reads the same request where this does.
            limits = self.limits
            simple = read_simple_request(
                data, limits.max_header_count, limits.max_header_bytes, limits.max_body_bytes
            )
            if simple is not None:
                self._read_whole(*simple)
                if len(self._queue) >= _MAX_QUEUED:
                    self.pause_reading()
                return
        if self._raw_body:
            data = self._take_raw_body(data)
            if not data:
                return
        was_in_head = self._in_head
        self._parse(data)
        if was_in_head and self._in_head:
            # A head spread over reads: bounded here, since the parser buffers a field
            # until its end (the read a head begins in is not counted: at most one read).
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes + _HEAD_SLACK:
                self._refuse_head("size")
                return
        if len(self._queue) >= _MAX_QUEUED:
            self.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self.server._forget(self)
        for req in (self._parsing, self._current):
            if req is not None:
                req._fail(BodyError(400, "bad_body", "the client closed the connection"))
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: its handler stops now
        self._queue.clear()
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._url = []
        self._headers = []
        self._raw_fields = []
        self._head_bytes = 0
        self._head_error = None
        self._content_length = None
        self._expect = None
        if self._current is None and not self._queue:
            # No longer idle: the head has client_header_timeout_s to arrive whole.
            self._arm(self.limits.client_header_timeout_s, self._head_timeout)

    def on_url(self, url: bytes) -> None:
        self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Kept raw, and read once the head is whole (_read_fields): one callback per field
        # does only this. Past the count limit nothing more is kept (431 either way).
        raw = self._raw_fields
        if len(raw) <= self._max_fields:
            raw.append((name, value))

    def _read_fields(self) -> None:
        """The head's fields decoded, the framing ones noted and its limits checked, in the
        order they came: the first limit a field passes is the one refused."""
        limits = self.limits
        self._headers, self._content_length, self._expect, self._head_error = read_request_fields(
            self._raw_fields, limits.max_header_count, limits.max_header_bytes
        )

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._read_fields()
        parser = self._parser
        method = parser.get_method().decode("ascii")
        req = HttpRequest(
            self,
            method,
            b"".join(self._url).decode("utf-8", "surrogateescape"),
            parser.get_http_version(),
            self._headers,
            parser.should_keep_alive(),
        )
        self._parsing = req
        if self._head_error is not None:
            req._error = BodyError(431, "", "")  # not read: the head is refused
            self._queue.append(self._head_reply(self._head_error, len(self._headers)))
        else:
            self._queue_request(req, method)
        if self._current is None:
            self._disarm()
            self._next()

    def _read_whole(
        self,
        method: str,
        target: str,
        version: str,
        headers: list[tuple[str, str]],
        keep_alive: bool,
        content_length: int | None,
        body: bytes,
    ) -> None:
        """A whole plain request (the fast path of data_received): what llhttp's callbacks
        would have done with it, from on_message_begin to on_message_complete."""
        req = HttpRequest(self, method, target, version, headers, keep_alive)
        req.content_length = content_length
        if body:
            req._feed(body)
        req.complete = True
        self._queue.append(req)
        if self._current is None:
            self._disarm()
            self._next(eager=True)

    def _queue_request(self, req: HttpRequest, method: str) -> None:
        req.content_length = self._content_length
        expect = self._expect
        if method == "CONNECT":
            req._error = BodyError(405, "", "")
            self._queue.append(
                error_reply(405, "meshd is not a CONNECT proxy", "method_not_allowed", close=True)
            )
        elif expect is not None and req.version == "1.1":
            if expect.lower() != "100-continue":
                self._queue.append(
                    error_reply(417, f"Unknown Expect: {expect}", "expectation_failed", close=True)
                )
                req._error = BodyError(417, "", "")
            else:
                req._continue = True
                self._queue.append(req)
        else:
            self._queue.append(req)

    def on_body(self, body: bytes) -> None:
        req = self._parsing
        if req is not None:
            req._feed(body)

    def on_message_complete(self) -> None:
        req = self._parsing
        if req is not None:
            self._parsing = None
            if req.content_length and req._size < req.content_length:
                self._raw_body = req.content_length - req._size  # an upgrade: see _upgraded
                self._parsing = req
                return
            req._continue = False
            req._done()

    # -- the request queue -------------------------------------------------------------

    def _next(self, eager: bool = False) -> None:
        """Start the next queued request (on the connection's handler task, woken or made
        for it), or wait (for keepalive_timeout_s) for one. `eager`: the request was read
        whole (the fast path), so its handler may run now, in this call, up to its first
        wait (not from a parser callback: its body is still to come)."""
        req = self._take_next()
        if req is None:
            return
        waiter = self._idle
        if waiter is None:
            self._task = self.loop.create_task(self._serve(req))
        elif not waiter.done():  # (done: cancelled, the connection being cut)
            self._idle = None
            task = self._task
            if not eager or task is None or _current_task(self.loop) is not None:
                waiter.set_result(req)  # (inside a task: a test's fake transport)
                return
            # As the handler task, up to the handler's first wait (its upstream send comes
            # before it), instead of on the loop's next turn: the task's wake-up cost
            # ~15-20 us with cold caches before the request was looked at (issue #22).
            coro = self._run(req)
            _enter_task(self.loop, task)
            try:
                waiting = coro.send(None)
            except StopIteration as stop:
                if stop.value:  # answered at once; the task waits on for the next
                    self._idle = waiter
                    self._next()
                else:  # the connection is closing: the task ends
                    waiter.set_result(False)
                return
            finally:
                _leave_task(self.loop, task)
            if waiting is not None:
                # What a task does with the future it is handed: the awaiting is its own
                # now (the handler's `await` set the flag; the task's `await` sets it again).
                waiting._asyncio_future_blocking = False
            waiter.set_result(_Begun(coro, waiting))

    def _take_next(self) -> HttpRequest | None:
        """The next queued request, now the current one; None: none is queued (the
        keep-alive timer armed, or the connection closed)."""
        while self._queue and not self.closed:
            item = self._queue.popleft()
            self.resume_reading()
            if isinstance(item, Reply):
                self._send_reply(None, item)
                if item.close:
                    self._close()
                    return None
                continue
            self._current = item
            return item
        if self.closed:
            return None
        if self._close_when_idle:
            self._close()
        elif self._parsing is None:
            self._arm(self.limits.keepalive_timeout_s, self._close)
        return None

    async def _serve(self, req: HttpRequest) -> None:
        """The connection's handler task: one request after another, each handled to its
        end before the next. One task a connection, woken through a future between
        requests: a task made per request cost ~25 us with cold caches before the request
        was first looked at (Task() registers in asyncio's WeakSet, Python code on 3.11;
        loadtest/sidecar_profile.py). A request that comes while it waits is begun at once
        by _next, as this task, and handed to it to drive on. Cancelled when the client
        leaves or a drain cuts it."""
        keep = await self._run(req)
        while keep:
            next_req = self._take_next()
            if next_req is not None:
                keep = await self._run(next_req)
                continue
            if self.closed:
                return
            self._idle = idle = self.loop.create_future()
            try:
                item = await idle
            except asyncio.CancelledError:
                # Cancelled just as a request was begun for it: the handler is told where
                # it waits (or at its next wait, when that has already ended).
                begun = idle.result() if idle.done() and not idle.cancelled() else None
                if isinstance(begun, _Begun):
                    waiting = begun.waiting
                    if waiting is None or not waiting.cancel():
                        task = _current_task(self.loop)
                        assert task is not None
                        task.cancel()
                    await _drive(begun.coro)
                raise
            finally:
                self._idle = None
            if isinstance(item, bool):
                keep = item  # begun and done within _next, closing the connection
            elif isinstance(item, _Begun):
                await _settled(item.waiting)
                keep = await _drive(item.coro)
            else:
                keep = await self._run(item)

    async def _run(self, req: HttpRequest) -> bool:
        """One request handled to its end; whether the connection goes on to the next."""
        try:
            reply = await self.server.handler(req)
        except asyncio.CancelledError:
            self._current = None
            return False
        except Exception:
            log.exception("handler failed on %s %s", req.method, req.path)
            self._count("internal")  # a bug: counted, and answered in the error shape
            if req._stream is None and not self.closed:
                self._send_reply(req, error_reply(500, "internal error", "internal", close=True))
            self._close()
            return False
        if self.closed:
            return False
        if reply is not None:
            self._send_reply(req, reply)
        else:
            stream = req._stream
            if stream is None:
                self._send_reply(req, error_reply(500, "no response", "internal", close=True))
            elif not stream.ended:
                try:
                    stream.end()
                except ConnectionResetError:
                    return False
        self._current = None
        keep = req.keep_alive and req.complete and (reply is None or not reply.close)
        if not keep:
            self._close()
            return False
        return True

    def head(self, req: HttpRequest | None, status: int, headers: list[tuple[str, str]]) -> bytes:
        """A response head; says `Connection: close` when the connection ends after it."""
        closing = (
            req is None
            or not req.keep_alive
            # Unframeable bytes came after: close, but only after the requests framed
            # before them have been answered.
            or (self._close_when_idle and not self._queue)
            or self.server.closing
            or not req.complete
        )
        if req is not None and closing:
            req.keep_alive = False
        # The fields joined by C loops (str.join over map), not a Python loop per field.
        fields = "\r\n".join(map(": ".join, headers))
        if closing:
            tail = "\r\nConnection: close\r\n\r\n" if headers else "Connection: close\r\n\r\n"
        elif req is not None and req.version == "1.0":
            tail = (
                "\r\nConnection: keep-alive\r\n\r\n"
                if headers
                else "Connection: keep-alive\r\n\r\n"
            )
        else:
            tail = "\r\n\r\n" if headers else "\r\n"
        status_line = f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
        return (status_line + fields + tail).encode("utf-8", "surrogateescape")

    def _send_reply(self, req: HttpRequest | None, reply: Reply) -> None:
        if reply.close and req is not None:
            req.keep_alive = False
        headers = list(reply.headers)
        if not any(n.lower() == "date" for n, _ in headers):
            headers.append(("Date", _http_date()))
        body = reply.body
        if reply.status not in _NO_BODY_STATUS:
            headers.append(("Content-Length", str(len(body))))
        if (req is not None and req.method == "HEAD") or reply.status in _NO_BODY_STATUS:
            body = b""
        self.write(self.head(req, reply.status, headers) + body)

    # -- limits and errors -------------------------------------------------------------

    def _head_reply(self, why: str, count: int) -> Reply:
        limits = self.limits
        if why == "count":
            message = (
                f"too many request headers: {count} > limits.max_header_count "
                f"({limits.max_header_count})"
            )
            code = "header_count_exceeded"
        else:
            message = (
                f"request headers too large: over limits.max_header_bytes "
                f"({limits.max_header_bytes})"
            )
            code = "header_size_exceeded"
        self._count(code)
        return error_reply(431, message, code, close=True)

    def _refuse_head(self, why: str) -> None:
        """The head outgrew every limit before its end: answer now if nothing else is owed."""
        if self._current is None and not self._queue:
            self._send_reply(None, self._head_reply(why, len(self._headers)))
        self._close()

    def _malformed(self, exc: Exception) -> None:
        if self.closed:  # a reply that closed it came earlier in the same read
            return
        req = self._parsing
        message = f"malformed HTTP request: {exc}"
        if req is not None and not self._in_head:
            req._fail(BodyError(400, "bad_body", f"malformed request body: {exc}"))
            self._count("bad_body")
            if req is not self._current and req in self._queue:
                self._queue.remove(req)
        elif self._current is None and not self._queue:
            self._count("bad_request")
            self._send_reply(None, error_reply(400, message, "bad_request", close=True))
            self._close()
            return
        self._close_when_idle = True  # nothing after this point can be framed
        self.pause_reading()

    def _upgraded(self, data: bytes, offset: int) -> None:
        """llhttp stops at a request that asks to upgrade; meshd serves it over HTTP/1.1 and
        reads on with a fresh parser (the body, if any, comes first, raw)."""
        self._parser = httptools.HttpRequestParser(self)
        rest = data[offset:]
        if self._raw_body:
            rest = self._take_raw_body(rest)
        if rest:
            self._parse(rest)

    def _parse(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgraded(data, int(exc.args[0]) if exc.args else len(data))
        except httptools.HttpParserError as exc:
            self._malformed(exc)

    def _take_raw_body(self, data: bytes) -> bytes:
        req = self._parsing
        n = min(self._raw_body, len(data))
        self._raw_body -= n
        if req is not None:
            req._feed(data[:n])
            if not self._raw_body:
                self._parsing = None
                req._continue = False
                req._done()
        return data[n:]

    def _head_timeout(self) -> None:
        """No request head within client_header_timeout_s: 408 if one had begun, else close
        quietly (an idle connection that never spoke)."""
        if self._current is not None or self._queue:
            return
        if self._in_head:
            self._count("header_timeout")
            self._send_reply(
                None,
                error_reply(
                    408,
                    f"the request head did not arrive within limits.client_header_timeout_s "
                    f"({self.limits.client_header_timeout_s:g} s)",
                    "header_timeout",
                    close=True,
                ),
            )
        self._close()

    def _count(self, code: str) -> None:
        if self.server.on_reject is not None:
            self.server.on_reject(code)

    # -- transport -------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if not self.write_paused:
            return
        self._drain = self.loop.create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    def pause_reading(self) -> None:
        if self._reading and self.transport is not None and not self.closed:
            self._reading = False
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if not self._reading and self.transport is not None and not self.closed:
            self._reading = True
            self.transport.resume_reading()

    def close_when_idle(self) -> None:
        self._close_when_idle = True
        if self._current is None and not self._queue:
            self._close()

    def cut_for_drain(self, reply: Reply) -> None:
        req = self._current
        if req is not None and not self.closed:
            req.drained = True
            stream = req._stream
            try:
                if stream is None:
                    self._send_reply(req, reply)
                elif not stream.ended:
                    if stream.drain_tail:
                        stream.write(stream.drain_tail)
                    stream.end()
            except ConnectionResetError:
                pass
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._close()

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.transport is not None:
            self.transport.abort()

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        """`callback` once `delay` seconds pass (HttpServer's sweep; no timer per request)."""
        self._deadline = self.loop.time() + delay
        self._on_deadline = callback

    def _disarm(self) -> None:
        self._on_deadline = None


class _Begun:
    """A handler coroutine begun outside its task (_Connection._next) and stopped at its
    first wait: `waiting`, the future it awaits (None: it yielded to the loop once)."""

    __slots__ = ("coro", "waiting")

    def __init__(self, coro: Coroutine[Any, Any, bool], waiting: asyncio.Future[Any] | None):
        self.coro = coro
        self.waiting = waiting


@types.coroutine
def _drive(coro: Coroutine[Any, Any, bool]) -> Generator[Any, Any, bool]:
    """Drive a begun coroutine on (`await` refuses one already suspended in an await; a
    generator's `yield from` passes each wait, value and exception through, as `await`)."""
    return (yield from coro)


async def _settled(fut: asyncio.Future[Any] | None) -> None:
    """Wait until `fut` is done, leaving its outcome to the coroutine that awaits it (a
    begun handler, which takes it when resumed). The task's cancellation meanwhile cancels
    `fut`, as the task does to the future it waits on: the handler gets CancelledError."""
    while fut is not None and not fut.done():
        try:
            await fut
        except asyncio.CancelledError:
            if not fut.done():  # cancelled before the task got to cancel fut itself
                fut.cancel()
        except Exception:
            if not fut.done():
                raise


_date_cache: tuple[int, str] = (0, "")


def _http_date() -> str:
    """The Date field (RFC 9110 6.6.1), made once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]
