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

Its parts: meshd/upstream_connection.py (one connection: the request out, the response head
parsed), meshd/upstream_response.py (the body, decoded by its framing, read piecewise) and
meshd/upstream_errors.py (the exceptions). This module keeps the pool and the request head.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from filters import chunked as _chunked_py
from filters.hotpath import ChunkedDecoder
from meshd.deadlines import Deadlines
from meshd.upstream_connection import UpstreamConnection
from meshd.upstream_errors import (
    StaleConnection,
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    describe_error,
)
from meshd.upstream_response import UpstreamResponse

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


@dataclass(slots=True, eq=False)
class PoolEndpoint:
    """One endpoint as the pool keeps it: where it is and its connections."""

    name: str  # the base URL, for messages
    host: str
    port: int
    host_header: str
    tls: bool
    idle: list[UpstreamConnection] = field(default_factory=list)  # most recently used last
    busy: int = 0  # connections in use or being opened
    waiters: collections.deque[asyncio.Future[UpstreamConnection | None]] = field(
        default_factory=collections.deque
    )
    live: set[UpstreamConnection] = field(default_factory=set)


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
        self._endpoints: dict[str, PoolEndpoint] = {}
        # Idle connections' keep-alive deadlines, on one timer (not one per release).
        self.idle_deadlines = Deadlines()
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
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send one request; resolves when the response head has arrived.

        `target` is the path and query as the client sent them; `headers` must already be
        free of hop-by-hop fields and of Host, Content-Length and Transfer-Encoding, which
        this adds (Content-Length when there is a body or the method is POST/PUT/PATCH).
        Head and body leave in one write. Cancelling closes the connection. A reused
        connection the server had closed (EOF or reset before any response byte) is
        retried once on a fresh one. Raises UpstreamConnectError (nothing was sent),
        UpstreamProtocolError or UpstreamClosedError; ValueError if a header holds CR/LF.

        `sent` runs once, as soon as the bytes are written or, when a connection has to be
        waited for, before that wait: the caller's bookkeeping of the request (what other
        requests must see before their turn) leaves the way to the engine, without any
        other request running in between. It does not run when this raises before either.
        """
        ep = self._endpoint(base_url)
        if self._closed:
            raise UpstreamConnectError(ep.name, "the upstream pool is closed")
        data = _encode_request(ep, method, target, headers, body)
        is_head = method == "HEAD"
        # An idle connection is taken without a coroutine; _acquire waits or connects.
        conn = self._take_idle(ep)
        if conn is None:
            if sent is not None:
                sent()
                sent = None
            conn = await self._acquire(ep)
        head = conn.send(data, is_head)
        try:
            if sent is not None:
                sent()
            return await head
        except StaleConnection:
            conn.abort()  # the slot stays with us, for the retry below
            self._stale_retries += 1
        except BaseException:
            self._exchange_failed(conn, head)
            raise
        if self._closed:
            self._release_slot(ep)
            raise UpstreamConnectError(ep.name, "the upstream pool is closed")
        # The stale connection's slot passes to a fresh one, whose failure is final.
        conn = await self._connect(ep)
        return await self._exchange(conn, data, is_head)

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
        self.idle_deadlines.close()
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

    def _endpoint(self, base_url: str) -> PoolEndpoint:
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
        ep = PoolEndpoint(name, host, port, host_header, tls)
        self._endpoints[base_url] = ep
        return ep

    def _take_idle(self, ep: PoolEndpoint) -> UpstreamConnection | None:
        """The most recently used idle connection still usable (its slot taken), or None."""
        while ep.idle:
            conn = ep.idle.pop()
            conn.cancel_idle_timer()
            if conn.usable():
                ep.busy += 1
                self._reused += 1
                return conn
            conn.abort()
        return None

    async def _acquire(self, ep: PoolEndpoint) -> UpstreamConnection:
        conn = self._take_idle(ep)
        if conn is not None:
            return conn
        if ep.busy < self.max_connections_per_endpoint:
            ep.busy += 1
            return await self._connect(ep)
        waiter: asyncio.Future[UpstreamConnection | None] = (
            asyncio.get_running_loop().create_future()
        )
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

    async def _connect(self, ep: PoolEndpoint) -> UpstreamConnection:
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
                    lambda: UpstreamConnection(self, ep),
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
                raise UpstreamConnectError(
                    ep.name, f"connect failed: {describe_error(exc)}"
                ) from exc
            raise
        self._opened += 1
        return conn

    async def _exchange(
        self, conn: UpstreamConnection, data: bytes, is_head: bool
    ) -> UpstreamResponse:
        head = conn.send(data, is_head)
        try:
            return await head
        except StaleConnection:
            conn.abort()
            raise  # the slot stays with the caller, for the retry
        except BaseException:
            self._exchange_failed(conn, head)
            raise

    def _exchange_failed(
        self, conn: UpstreamConnection, head: asyncio.Future[UpstreamResponse]
    ) -> None:
        """The wait for a response head ended otherwise (cancelled, an error): the
        connection is dropped and its slot freed, or a head that came meanwhile closed."""
        if head.done() and not head.cancelled() and head.exception() is None:
            head.result().close()  # the head came as we were cancelled
        else:
            conn.abort()
            self._release_slot(conn.ep)

    def _done(self, conn: UpstreamConnection, reusable: bool) -> None:
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

    def _release_slot(self, ep: PoolEndpoint) -> None:
        while ep.waiters:
            waiter = ep.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the waiter may open a connection in this slot
                return
        ep.busy -= 1

    def _new_decoder(self) -> Any:
        line, size, trailers = self._chunk_limits
        return ChunkedDecoder(max_line_bytes=line, max_chunk_size=size, max_trailer_bytes=trailers)


def _encode_request(
    ep: PoolEndpoint, method: str, target: str, headers: Sequence[tuple[str, str]], body: bytes
) -> bytes:
    # The fields joined by C loops (str.join over map), not a Python loop per field.
    fields = "\r\n".join(map(": ".join, headers))
    if fields:
        fields += "\r\n"
    expected = len(headers) + 3  # the request line, Host, each field, the blank line
    if body or method in _BODY_METHODS:
        fields += f"Content-Length: {len(body)}\r\n"
        expected += 1
    head = f"{method} {target} HTTP/1.1\r\nHost: {ep.host_header}\r\n{fields}\r\n"
    # Values come from a parsed request and hold no CR or LF; if one ever did, it would
    # inject a header. Counting both is cheaper than checking each value.
    if (
        head.count("\n") != expected
        or head.count("\r") != expected
        or " " in method
        or " " in target
    ):
        raise ValueError("CR, LF or space in the request method, target or a header")
    return head.encode("utf-8", "surrogateescape") + body
