"""The HTTP/1.1 exchange as the sidecar's layers see it: a request (`HttpRequest`: its
head, its body read within the listener's limits, the way back to its client), a whole
reply (`Reply`) or a streamed one (`ResponseStream`). The connection that frames them is
meshd/listener.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshd.errors import error_body

if TYPE_CHECKING:
    from meshd.listener import _Connection


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    max_header_count: int = 100
    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 8 * 1024 * 1024
    client_header_timeout_s: float = 30.0
    client_body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0


@dataclass(slots=True)
class Reply:
    """A whole response: sent in one write, framed by Content-Length."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    close: bool = False  # close the connection after it (the request was not read whole)
    code: str | None = None  # meshd's error code, for the handler's own accounting


def json_reply(doc: Any, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Reply:
    # backslashreplace: a client's bytes that are not UTF-8, echoed in an error (held as
    # surrogate escapes), come out as JSON escapes instead of failing the reply.
    body = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "backslashreplace"
    )
    return Reply(status, [("Content-Type", "application/json"), *(headers or [])], body)


def error_reply(
    status: int,
    message: str,
    code: str,
    *,
    param: str | None = None,
    retry_after_s: float | None = None,
    close: bool = False,
) -> Reply:
    """meshd's own error, as an OpenAI-style body (meshd/errors.py), code in x-meshd-error."""
    headers = [("x-meshd-error", code)]
    if retry_after_s is not None:
        headers.append(("Retry-After", str(max(1, round(retry_after_s)))))
    reply = json_reply(error_body(status, message, code, param), status, headers)
    reply.close, reply.code = close, code
    return reply


class BodyError(Exception):
    """The request body could not be read whole: the reply says why."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.reply = error_reply(status, message, code, close=True)


Handler = Callable[["HttpRequest"], Awaitable[Reply | None]]
RejectHook = Callable[[str], None]


class HttpRequest:
    """One request's head, its body as it arrives, and the way back to its client."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_continue",
        "_error",
        "_size",
        "_stream",
        "_waiter",
        "complete",
        "content_length",
        "drained",
        "headers",
        "keep_alive",
        "method",
        "path",
        "remote",
        "target",
        "transport",
        "version",
    )

    def __init__(
        self,
        conn: _Connection,
        method: str,
        target: str,
        version: str,
        headers: list[tuple[str, str]],
        keep_alive: bool,
    ) -> None:
        self._conn = conn
        self.method = method
        self.target = target  # as sent: path and query, percent-encoded
        q = target.find("?")
        self.path = target if q < 0 else target[:q]
        self.version = version  # "1.1" or "1.0"
        self.headers = headers  # in order, names as sent
        self.keep_alive = keep_alive
        self.remote: str | None = conn.remote
        self.transport: asyncio.Transport | None = conn.transport
        self.content_length: int | None = None
        self.complete = False  # the whole body has been read off the connection
        self.drained = False  # cut by a drain that ran out of time (HttpServer.shutdown)
        self._chunks: list[bytes] = []
        self._size = 0
        self._error: BodyError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._continue = False  # owes "100 Continue" before its body
        self._stream: ResponseStream | None = None

    def header(self, name: str) -> str | None:
        """The first value of a header (name case-insensitive), or None."""
        name = name.lower()
        for n, v in self.headers:
            if n.lower() == name:
                return v
        return None

    def header_all(self, name: str) -> list[str]:
        name = name.lower()
        return [v for n, v in self.headers if n.lower() == name]

    @property
    def started(self) -> bool:
        """The response head has been handed to the transport (or is held for the body)."""
        return self._stream is not None

    def ready_body(self) -> bytes | None:
        """The whole body if it has already arrived (most requests: it came with the head),
        without a coroutine; None: `await read_body()`."""
        if self._error is not None or not self.complete:
            return None
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks[0]
        body = b"".join(chunks)
        self._chunks = [body]
        return body

    async def read_body(self) -> bytes:
        """The whole body. Raises BodyError (413, 408, 400) with the reply to send."""
        if self._error is not None:
            raise self._error
        if not self.complete:
            conn = self._conn
            if self._continue:
                self._continue = False
                conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            loop = conn.loop
            self._waiter = loop.create_future()
            conn.resume_reading()
            limit = conn.limits.client_body_timeout_s
            try:
                async with asyncio.timeout(limit):
                    await self._waiter
            except TimeoutError:
                self._error = BodyError(
                    408,
                    "body_timeout",
                    f"the request body did not arrive within limits.client_body_timeout_s "
                    f"({limit:g} s)",
                )
            finally:
                self._waiter = None
            if self._error is not None:
                raise self._error
        body = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks = [body]
        return body

    def stream(
        self, status: int, headers: list[tuple[str, str]], *, hold_head: bool = False
    ) -> ResponseStream:
        """Begin a streamed response (chunked on HTTP/1.1; on HTTP/1.0 unframed, ending with
        the connection). `hold_head`: the head leaves with the first chunk, in one write."""
        assert self._stream is None, "the response has begun"
        stream = self._stream = ResponseStream(self, status, headers, hold_head)
        return stream

    # -- fed by the connection ---------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._error is not None:
            return
        self._size += len(data)
        limit = self._conn.limits.max_body_bytes
        if self._size > limit:
            self._chunks = []
            self._fail(
                BodyError(
                    413, "body_too_large", f"request body exceeds limits.max_body_bytes ({limit})"
                )
            )
            return
        self._chunks.append(data)

    def _done(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: BodyError) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


class ResponseStream:
    """A streamed response: `write` frames each chunk and hands it to the transport at once
    (one `transport.write` per chunk); `end` closes the body. Writes raise
    ConnectionResetError once the client has gone."""

    # No reference back to its HttpRequest (which holds it): the pair would be a cycle that
    # only the cyclic collector frees, a young collection every ~50 requests (issue #22).
    __slots__ = ("_chunked", "_conn", "_head", "drain_tail", "ended", "head_only")

    def __init__(
        self, request: HttpRequest, status: int, headers: list[tuple[str, str]], hold: bool
    ) -> None:
        conn = request._conn
        self._conn = conn
        self._chunked = request.version == "1.1"
        if not self._chunked:
            request.keep_alive = False  # HTTP/1.0: the body ends with the connection
        self.head_only = request.method == "HEAD"
        extra = [("Transfer-Encoding", "chunked")] if self._chunked and not self.head_only else []
        self._head = conn.head(request, status, headers + extra)
        self.ended = False
        # What the body gets before its end if a drain cuts it (an SSE stream: an error
        # event, so the client knows it did not finish); empty: it just ends.
        self.drain_tail = b""
        if not hold:
            self._flush_head()

    def _flush_head(self) -> None:
        if self._head:
            head, self._head = self._head, b""
            self._conn.write(head)

    def write(self, chunk: bytes) -> None:
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("Cannot write to closing transport")
        if not chunk or self.head_only:
            self._flush_head()
            return
        data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if self._chunked else chunk
        if self._head:
            data, self._head = self._head + data, b""
        conn.write(data)

    @property
    def paused(self) -> bool:
        """The transport's buffer is past its high-water mark: `await drain()` first."""
        return self._conn.write_paused

    async def drain(self) -> None:
        await self._conn.drain()

    def end(self, tail: bytes = b"") -> None:
        """The last bytes of the body (if any) and the end of it."""
        if self.ended:
            return
        self.ended = True
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("Cannot write to closing transport")
        data = b""
        if tail and not self.head_only:
            data = b"%x\r\n%b\r\n" % (len(tail), tail) if self._chunked else tail
        if self._chunked and not self.head_only:
            data += b"0\r\n\r\n"
        if self._head:
            data, self._head = self._head + data, b""
        if data:
            conn.write(data)
