"""An upstream response whose head has arrived: its body, decoded by its framing
(Content-Length, chunked, or until close; RFC 9112 6.3, 7.1), handed to the reader in
pieces, with the connection paused while too much waits unread. Its connection
(meshd/upstream_connection.py) feeds it.
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING, Any

from filters import chunked as _chunked_py
from meshd.upstream_errors import (
    UpstreamClosedError,
    UpstreamError,
    UpstreamProtocolError,
    describe_error,
)

if TYPE_CHECKING:
    from meshd.upstream_connection import UpstreamConnection

__all__ = ["BodyFraming", "UpstreamResponse"]


class BodyFraming(enum.Enum):
    NONE = 0
    LENGTH = 1
    CHUNKED = 2
    UNTIL_CLOSE = 3


class UpstreamResponse:
    """A response whose head has arrived; its body is read piecewise with `read()`."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_conn",
        "_decoder",
        "_error",
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
        conn: UpstreamConnection,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        content_type: str,
        mode: BodyFraming,
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
        self._decoder: Any = conn.pool._new_decoder() if mode is BodyFraming.CHUNKED else None
        self._keep_alive = keep_alive
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = mode is BodyFraming.NONE
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._released = False

    def header(self, name: str) -> str | None:
        """The first value of field `name` (case-insensitive), or None. A scan: a response
        is asked for one or two fields, fewer than building an index costs."""
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

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

    def unread(self, data: bytes) -> None:
        """Put bytes read back at the front of the body (a layer that looked at an error
        body before deciding who relays it)."""
        if data:
            self._chunks.insert(0, data)
            self._buffered += len(data)

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
        if mode is BodyFraming.CHUNKED:
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
        elif mode is BodyFraming.LENGTH:
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
        if self._mode is BodyFraming.UNTIL_CLOSE and exc is None:
            self._complete = True
        else:
            if self._mode is BodyFraming.LENGTH:
                where = f"{self._remaining} bytes before the end of the body"
            elif self._mode is BodyFraming.CHUNKED:
                where = "before the last chunk of the body"
            else:
                where = "during the body"
            reason = f" ({describe_error(exc)})" if exc is not None else ""
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
