"""The sidecar's upstream HTTP/1.1 client: a keep-alive connection pool on raw asyncio
protocols (uvloop-compatible), built for relaying token streams with the least work per
socket read. One `data_received` decodes everything that read holds and wakes the reader
once; aiohttp's client runs about five callbacks per chunk and finishes a whole read's
chunks before the relay sees the first.

Framing follows RFC 9112: status line and fields (section 4, 5; obs-fold replaced by SP as
5.2 allows), message body length (6.3: no body for HEAD, 1xx, 204, 304; Transfer-Encoding
chunked; Content-Length; else read until close), chunked coding (7.1, filters/chunked.py),
persistence (9.3). The caller removes hop-by-hop request fields; this module adds only Host
and Content-Length. Every limit is a named `UpstreamPool` argument.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import re
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from filters import chunked as _chunked_py
from filters.hotpath import ChunkedDecoder

__all__ = [
    "UpstreamClosedError",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
]

DEFAULT_MAX_HEADERS = 100
# Methods whose request content has a defined meaning: they always carry Content-Length
# (RFC 9110 8.6), 0 when the body is empty.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_STATUS_LINE = re.compile(r"HTTP/1\.([01]) ([0-9]{3})(?: ([^\r\n\x00]*))?")
# field-line = field-name ":" OWS field-value OWS; the name is a token (RFC 9110 5.1, 5.5).
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_FIELD_LINE = re.compile(rf"({_TOKEN}):[ \t]*([^\r\n\x00]*?)[ \t]*")
# The usual head, every line one well-formed field (no obs-fold): checked whole by one
# match, then split on CRLF and each line's first colon (a token holds none), with OWS
# stripped from the value, instead of a match per line with a lazy value that backtracks at
# every character. Splitting costs less than a capturing findall (3.3 us vs 5.1 us for a
# 5-field head, timeit).
_FIELD_BLOCK = re.compile(rf"(?:{_TOKEN}:[^\r\n\x00]*\r\n)*")


class UpstreamError(Exception):
    """The upstream exchange failed; the message names the endpoint."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(f"{endpoint}: {message}")
        self.endpoint = endpoint


class UpstreamConnectError(UpstreamError):
    """No connection (refused, timed out, unresolvable, pool exhausted): nothing was sent."""


class UpstreamProtocolError(UpstreamError):
    """The upstream broke HTTP/1.1 framing or a limit (status line, fields, head size, chunks)."""


class UpstreamClosedError(UpstreamError):
    """The connection closed or reset after the request was sent, before the body's end."""


class _StaleConnection(Exception):
    """A reused keep-alive connection closed before any response byte: retry on a fresh one."""


class _Body(enum.Enum):
    NONE = 0
    LENGTH = 1
    CHUNKED = 2
    UNTIL_CLOSE = 3


@dataclass(slots=True, eq=False)
class _Endpoint:
    name: str  # the base URL, for messages
    host: str
    port: int
    host_header: str
    tls: bool
    idle: list[_Connection] = field(default_factory=list)  # most recently used last
    busy: int = 0  # connections in use or being opened
    waiters: collections.deque[asyncio.Future[_Connection | None]] = field(
        default_factory=collections.deque
    )
    live: set[_Connection] = field(default_factory=set)


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections per endpoint ("http://host:port" or https), bounded
    in number. `ssl_context` verifies https endpoints (default: the system's trust store).

    `request()` resolves once the response head has arrived. The caller reads the body with
    `UpstreamResponse.read()` and then MUST call `release()` (body read) or `close()`.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        keepalive_timeout_s: float,
        max_connections_per_endpoint: int,
        max_idle_per_endpoint: int = 64,
        max_head_bytes: int = 64 * 1024,
        max_headers: int = DEFAULT_MAX_HEADERS,
        high_water: int = 256 * 1024,
        max_chunk_line_bytes: int = _chunked_py.DEFAULT_MAX_LINE_BYTES,
        max_chunk_size: int = _chunked_py.DEFAULT_MAX_CHUNK_SIZE,
        max_trailer_bytes: int = _chunked_py.DEFAULT_MAX_TRAILER_BYTES,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if max_connections_per_endpoint < 1:
            raise ValueError("max_connections_per_endpoint must be at least 1")
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.max_connections_per_endpoint = max_connections_per_endpoint
        self.max_idle_per_endpoint = max_idle_per_endpoint
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.high_water = high_water
        self._chunk_limits = (max_chunk_line_bytes, max_chunk_size, max_trailer_bytes)
        self._ssl_context = ssl_context
        self._endpoints: dict[str, _Endpoint] = {}
        self._closed = False
        self._opened = 0
        self._reused = 0
        self._stale_retries = 0

    async def request(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send one request; resolves when the response head has arrived.

        `target` is the path and query as the client sent them; `headers` must already be
        free of hop-by-hop fields and of Host, Content-Length and Transfer-Encoding, which
        this adds (Content-Length when there is a body or the method is POST/PUT/PATCH).
        Head and body leave in one write. Cancelling closes the connection. A reused
        connection the server had closed (EOF or reset before any response byte) is
        retried once on a fresh one. Raises UpstreamConnectError (nothing was sent),
        UpstreamProtocolError or UpstreamClosedError; ValueError if a header holds CR/LF.
        """
        ep = self._endpoint(base_url)
        if self._closed:
            raise UpstreamConnectError(ep.name, "the upstream pool is closed")
        data = _encode_request(ep, method, target, headers, body)
        conn = await self._acquire(ep)
        try:
            return await self._exchange(conn, data, method == "HEAD")
        except _StaleConnection:
            self._stale_retries += 1
        if self._closed:
            self._release_slot(ep)
            raise UpstreamConnectError(ep.name, "the upstream pool is closed")
        # The stale connection's slot passes to a fresh one, whose failure is final.
        conn = await self._connect(ep)
        return await self._exchange(conn, data, method == "HEAD")

    async def close(self) -> None:
        """Close every connection; responses still being read end with UpstreamClosedError."""
        self._closed = True
        for ep in self._endpoints.values():
            while ep.waiters:
                waiter = ep.waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(UpstreamConnectError(ep.name, "the pool is closed"))
            for conn in list(ep.live):
                conn.abort()
            ep.idle.clear()
        # Let the transports run connection_lost before the loop may close.
        await asyncio.sleep(0)

    def stats(self) -> dict[str, int]:
        eps = self._endpoints.values()
        return {
            "opened": self._opened,
            "reused": self._reused,
            "stale_retries": self._stale_retries,
            "idle": sum(len(ep.idle) for ep in eps),
            "in_use": sum(ep.busy for ep in eps),
            "waiting": sum(sum(1 for w in ep.waiters if not w.done()) for ep in eps),
        }

    # -- connections -------------------------------------------------------------------

    def _endpoint(self, base_url: str) -> _Endpoint:
        ep = self._endpoints.get(base_url)
        if ep is not None:
            return ep
        name = base_url.rstrip("/")
        try:
            parts = urlsplit(base_url)
            tls = parts.scheme == "https"
            port = parts.port or (443 if tls else 80)
        except ValueError as exc:
            raise UpstreamConnectError(name, f"invalid upstream URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamConnectError(name, "upstream URL must be http(s)://host[:port]")
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        host_header = f"{shown}:{parts.port}" if parts.port else shown
        ep = _Endpoint(name, host, port, host_header, tls)
        self._endpoints[base_url] = ep
        return ep

    async def _acquire(self, ep: _Endpoint) -> _Connection:
        while ep.idle:
            conn = ep.idle.pop()
            conn.cancel_idle_timer()
            if conn.usable():
                ep.busy += 1
                self._reused += 1
                return conn
            conn.abort()
        if ep.busy < self.max_connections_per_endpoint:
            ep.busy += 1
            return await self._connect(ep)
        waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        ep.waiters.append(waiter)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                conn_or_slot = await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                # Handed a connection (or a slot) just as we gave up: pass it on.
                handed = waiter.result()
                if handed is None:
                    self._release_slot(ep)
                else:
                    self._done(handed, reusable=True)
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    ep.waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise UpstreamConnectError(
                    ep.name,
                    f"pool exhausted: all {self.max_connections_per_endpoint} connections "
                    f"(max_connections_per_endpoint) stayed busy for connect_timeout_s "
                    f"({self.connect_timeout_s:g} s)",
                ) from None
            raise
        if conn_or_slot is None:
            return await self._connect(ep)
        self._reused += 1
        return conn_or_slot

    async def _connect(self, ep: _Endpoint) -> _Connection:
        # The caller holds a slot for this connection; a failure gives it back.
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if ep.tls:
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            tls = self._ssl_context
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, ep),
                    ep.host,
                    ep.port,
                    ssl=tls,
                    server_hostname=ep.host if tls else None,
                )
        except BaseException as exc:
            self._release_slot(ep)
            if isinstance(exc, TimeoutError):
                raise UpstreamConnectError(
                    ep.name,
                    f"connect timed out after connect_timeout_s ({self.connect_timeout_s:g} s)",
                ) from None
            if isinstance(exc, OSError):
                raise UpstreamConnectError(ep.name, f"connect failed: {_describe(exc)}") from exc
            raise
        self._opened += 1
        return conn

    async def _exchange(self, conn: _Connection, data: bytes, is_head: bool) -> UpstreamResponse:
        head = conn.send(data, is_head)
        try:
            return await head
        except _StaleConnection:
            conn.abort()
            raise  # the slot stays with the caller, for the retry
        except BaseException:
            if head.done() and not head.cancelled() and head.exception() is None:
                head.result().close()  # the head came as we were cancelled
            else:
                conn.abort()
                self._release_slot(conn.ep)
            raise

    def _done(self, conn: _Connection, reusable: bool) -> None:
        """A response is finished with its connection: reuse it or close it."""
        ep = conn.ep
        if reusable and not self._closed and conn.usable():
            while ep.waiters:
                waiter = ep.waiters.popleft()
                if not waiter.done():
                    waiter.set_result(conn)
                    return
            if len(ep.idle) < self.max_idle_per_endpoint:
                ep.busy -= 1
                conn.go_idle(self.keepalive_timeout_s)
                ep.idle.append(conn)
                return
        conn.abort()
        self._release_slot(ep)

    def _release_slot(self, ep: _Endpoint) -> None:
        while ep.waiters:
            waiter = ep.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the waiter may open a connection in this slot
                return
        ep.busy -= 1

    def _new_decoder(self) -> Any:
        line, size, trailers = self._chunk_limits
        return ChunkedDecoder(max_line_bytes=line, max_chunk_size=size, max_trailer_bytes=trailers)


class _Connection(asyncio.Protocol):
    """One upstream connection: parses response heads and hands body bytes to the response."""

    def __init__(self, pool: UpstreamPool, ep: _Endpoint) -> None:
        self.pool = pool
        self.ep = ep
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.requests = 0
        self.lost = False
        self.response: UpstreamResponse | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._head = b""  # an incomplete response head
        self._got_bytes = False
        self._is_head = False

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.ep.live.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Small writes (a request head) must leave at once, not wait for an ACK.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is not None:
            response._feed(data)
            return
        if self._head_waiter is None:
            # Bytes nobody asked for, on an idle connection: it can't be trusted again.
            self.abort()
            return
        self._got_bytes = True
        try:
            self._parse_heads(data)
        except UpstreamProtocolError as exc:
            waiter, self._head_waiter = self._head_waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.ep.live.discard(self)
        if self._idle_timer is not None:
            self.cancel_idle_timer()
            with contextlib.suppress(ValueError):
                self.ep.idle.remove(self)
        if self._head_waiter is not None:
            self._fail_head(exc)
        elif self.response is not None:
            self.response._connection_lost(exc)

    def _fail_head(self, exc: Exception | None) -> None:
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is None or waiter.done():
            return
        if not self._got_bytes and self.requests > 1:
            waiter.set_exception(_StaleConnection())
            return
        got = f" after {len(self._head)} bytes of it" if self._got_bytes else ""
        reason = f" ({_describe(exc)})" if exc is not None else ""
        waiter.set_exception(
            UpstreamClosedError(
                self.ep.name,
                f"the connection closed before the response head arrived{got}{reason}",
            )
        )

    # -- used by the pool and the response ---------------------------------------------

    def send(self, data: bytes, is_head: bool) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None and self.response is None
        self.requests += 1
        self._head_waiter = waiter = self.loop.create_future()
        self._head = b""
        self._got_bytes = False
        self._is_head = is_head
        if self.usable():
            self.transport.write(data)
        else:
            # Closed between leaving the pool and this write (nothing more will report it).
            self._fail_head(None)
        return waiter

    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.abort()

    def go_idle(self, timeout_s: float) -> None:
        self._idle_timer = self.loop.call_later(timeout_s, self._idle_expired)

    def cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_expired(self) -> None:
        self._idle_timer = None
        with contextlib.suppress(ValueError):
            self.ep.idle.remove(self)
        if self.transport is not None:
            self.transport.close()

    # -- response heads ----------------------------------------------------------------

    def _parse_heads(self, data: bytes) -> None:
        limit = self.pool.max_head_bytes
        buf = self._head + data if self._head else data
        start = max(len(self._head) - 3, 0)
        while True:
            end = buf.find(b"\r\n\r\n", start)
            if end < 0 or end + 4 > limit:
                if end >= 0 or len(buf) > limit:
                    raise UpstreamProtocolError(
                        self.ep.name, f"response head larger than max_head_bytes ({limit})"
                    )
                self._head = buf
                return
            response = self._parse_head(buf[:end])
            if response is None:  # 1xx interim response: skip it
                buf = buf[end + 4 :]
                start = 0
                continue
            self._head = b""
            waiter, self._head_waiter = self._head_waiter, None
            self.response = response
            if waiter is not None and not waiter.done():
                waiter.set_result(response)
            rest = buf[end + 4 :]
            if rest:
                response._feed(rest)
            return

    def _parse_head(self, head: bytes) -> UpstreamResponse | None:
        ep = self.ep
        first, _, block = head.decode("utf-8", "surrogateescape").partition("\r\n")
        status_line = _STATUS_LINE.fullmatch(first)
        if status_line is None:
            raise UpstreamProtocolError(ep.name, f"malformed status line {first[:80]!r}")
        minor, code, reason = status_line.groups()
        status = int(code)
        if 100 <= status < 200:
            if status == 101:
                raise UpstreamProtocolError(ep.name, "unexpected 101 Switching Protocols")
            return None
        headers: list[tuple[str, str]] = []
        if block:
            block += "\r\n"
            lines = block.count("\r\n")
            if lines > self.pool.max_headers:
                raise UpstreamProtocolError(
                    ep.name,
                    f"{lines} response header lines exceed max_headers ({self.pool.max_headers})",
                )
            if _FIELD_BLOCK.fullmatch(block) is not None:
                for line in block.split("\r\n")[:-1]:
                    name, _, value = line.partition(":")
                    headers.append((name, value.strip(" \t")))
            else:
                headers = self._fields_line_by_line(block)
        content_length: str | None = None
        chunked = False
        close = minor == "0"
        content_type = "application/octet-stream"  # RFC 9110 8.3, when none is given
        for name, value in headers:
            lname = name.lower()
            if lname == "content-length":
                for part in value.split(","):
                    part = part.strip(" \t")
                    if (
                        not part.isdigit()
                        or not part.isascii()
                        or (content_length is not None and int(part) != int(content_length))
                    ):
                        raise UpstreamProtocolError(ep.name, f"invalid Content-Length {value!r}")
                    content_length = part
            elif lname == "transfer-encoding":
                codings = [c.strip(" \t").lower() for c in value.split(",") if c.strip(" \t")]
                if chunked or codings != ["chunked"]:
                    # Another coding would reach the client still encoded once we drop the
                    # header; refusing is safer than relaying bytes nobody can read.
                    raise UpstreamProtocolError(
                        ep.name, f"unsupported Transfer-Encoding {value!r} (only chunked)"
                    )
                chunked = True
            elif lname == "connection":
                if any(t.strip(" \t").lower() == "close" for t in value.split(",")):
                    close = True
            elif lname == "content-type":
                content_type = _media_type(value)
        if self._is_head or status in (204, 304):
            mode, length = _Body.NONE, 0
        elif chunked:
            if content_length is not None:
                # RFC 9112 6.3 item 3: both may be a smuggling attempt; handle as an error.
                raise UpstreamProtocolError(
                    ep.name, "response has both Transfer-Encoding and Content-Length"
                )
            mode, length = _Body.CHUNKED, 0
        elif content_length is not None:
            length = int(content_length)
            mode = _Body.LENGTH if length else _Body.NONE
        else:
            mode, length, close = _Body.UNTIL_CLOSE, 0, True
        return UpstreamResponse(
            self, status, reason or "", headers, content_type, mode, length, not close
        )

    def _fields_line_by_line(self, block: str) -> list[tuple[str, str]]:
        """The fields of a head `_FIELD_BLOCK` refused: obs-fold joined, else the error."""
        headers: list[tuple[str, str]] = []
        for line in block.split("\r\n")[:-1]:
            if line[:1] in (" ", "\t") and headers:
                # obs-fold: the line continues the previous field's value (RFC 9112 5.2).
                name, value = headers[-1]
                folded = line.strip(" \t")
                headers[-1] = (name, f"{value} {folded}" if folded else value)
                continue
            field_line = _FIELD_LINE.fullmatch(line)
            if field_line is None:
                raise UpstreamProtocolError(
                    self.ep.name, f"malformed response header {line[:80]!r}"
                )
            name, value = field_line.groups()
            headers.append((name, value))
        return headers


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip(" \t").lower()


class UpstreamResponse:
    """A response whose head has arrived; its body is read piecewise with `read()`."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_conn",
        "_decoder",
        "_error",
        "_index",
        "_keep_alive",
        "_mode",
        "_paused",
        "_released",
        "_remaining",
        "_waiter",
        "content_type",
        "endpoint",
        "headers",
        "reason",
        "status",
    )

    def __init__(
        self,
        conn: _Connection,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        content_type: str,
        mode: _Body,
        length: int,
        keep_alive: bool,
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers  # as received, names as the server sent them
        self.content_type = content_type  # media type, lower-cased, without parameters
        self.endpoint = conn.ep.name
        self._conn = conn
        self._mode = mode
        self._remaining = length
        self._decoder: Any = conn.pool._new_decoder() if mode is _Body.CHUNKED else None
        self._keep_alive = keep_alive
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = mode is _Body.NONE
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._released = False
        self._index: dict[str, str] | None = None

    def header(self, name: str) -> str | None:
        """The first value of field `name` (case-insensitive), or None."""
        if self._index is None:
            self._index = {}
            for key, value in self.headers:
                self._index.setdefault(key.lower(), value)
        return self._index.get(name.lower())

    @property
    def buffered(self) -> int:
        """Decoded body bytes received and not yet read."""
        return self._buffered

    def at_eof(self) -> bool:
        """The whole body has arrived and been read."""
        return self._complete and not self._chunks

    async def read(self) -> bytes:
        """The next piece of decoded body: all of it that has arrived, in one piece; b"" at
        the end. Raises UpstreamClosedError (or UpstreamProtocolError) if the body breaks,
        after the bytes that came before the break have been read."""
        while True:
            if self._chunks:
                return self._take()
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            if self._waiter is not None:
                raise RuntimeError("UpstreamResponse.read() is already being awaited")
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def release(self) -> None:
        """Done with a fully read body: the connection goes back to the pool if it can be
        reused (HTTP/1.1 keep-alive, body complete, nothing after it), else it closes."""
        if self._released:
            return
        self._released = True
        self._chunks.clear()
        self._conn.response = None
        reusable = self._complete and self._keep_alive and self._error is None
        self._conn.pool._done(self._conn, reusable)

    def close(self) -> None:
        """Abort now (the client went away, a timeout): the upstream sees the connection
        close. A pending or later `read()` raises UpstreamClosedError."""
        if self._released:
            return
        self._released = True
        if not self._complete and self._error is None:
            self._error = UpstreamClosedError(
                self.endpoint, "the response was closed before its end"
            )
        self._chunks.clear()
        self._wake()
        self._conn.response = None
        self._conn.pool._done(self._conn, reusable=False)

    # -- fed by the connection ---------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._complete or self._error is not None:
            self._keep_alive = False  # bytes after the body's end
            return
        mode = self._mode
        if mode is _Body.CHUNKED:
            decoder = self._decoder
            try:
                out = decoder.feed(data)
            except _chunked_py.ChunkedError as exc:
                self._fail(UpstreamProtocolError(self.endpoint, f"malformed chunked body: {exc}"))
                return
            if decoder.done:
                self._complete = True
                if decoder.unused:
                    self._keep_alive = False
        elif mode is _Body.LENGTH:
            if len(data) >= self._remaining:
                if len(data) > self._remaining:
                    self._keep_alive = False
                    data = data[: self._remaining]
                self._remaining = 0
                self._complete = True
            else:
                self._remaining -= len(data)
            out = data
        else:
            out = data
        if out:
            self._chunks.append(out)
            self._buffered += len(out)
            if self._buffered > self._conn.pool.high_water and not self._complete:
                transport = self._conn.transport
                if transport is not None and not self._paused:
                    self._paused = True
                    transport.pause_reading()
        if out or self._complete:
            self._wake()

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._complete or self._error is not None:
            return
        if self._mode is _Body.UNTIL_CLOSE and exc is None:
            self._complete = True
        else:
            if self._mode is _Body.LENGTH:
                where = f"{self._remaining} bytes before the end of the body"
            elif self._mode is _Body.CHUNKED:
                where = "before the last chunk of the body"
            else:
                where = "during the body"
            reason = f" ({_describe(exc)})" if exc is not None else ""
            self._error = UpstreamClosedError(
                self.endpoint, f"the connection closed {where}{reason}"
            )
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        self._conn.abort()
        self._wake()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            transport = self._conn.transport
            if transport is not None and not self._conn.lost:
                transport.resume_reading()
        return data

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _encode_request(
    ep: _Endpoint, method: str, target: str, headers: Sequence[tuple[str, str]], body: bytes
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {ep.host_header}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers]
    if body or method in _BODY_METHODS:
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    head = "".join(lines)
    # Values come from a parsed request and hold no CR or LF; if one ever did, it would
    # inject a header. Counting both is cheaper than checking each value.
    expected = len(lines) + 1
    if (
        head.count("\n") != expected
        or head.count("\r") != expected
        or " " in method
        or " " in target
    ):
        raise ValueError("CR, LF or space in the request method, target or a header")
    return head.encode("utf-8", "surrogateescape") + body


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
