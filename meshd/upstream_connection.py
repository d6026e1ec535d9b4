"""One upstream HTTP/1.1 connection on a raw asyncio protocol: it writes a request, parses
the response head (filters/response_head.py: status line and fields, RFC 9112 sections 4
and 5, obs-fold replaced by SP as 5.2 allows; the body's length by 6.3; compiled twin by
filters.hotpath) into an UpstreamResponse, and hands that
response the body bytes of each read. The pool (meshd/upstream.py) owns it, idle or busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, cast

from filters.hotpath import parse_response_head
from filters.response_head import ResponseHeadError
from meshd.deadlines import Deadline
from meshd.upstream_errors import (
    StaleConnection,
    UpstreamClosedError,
    UpstreamProtocolError,
    describe_error,
)
from meshd.upstream_response import BodyFraming, UpstreamResponse

if TYPE_CHECKING:
    from meshd.upstream import PoolEndpoint, UpstreamPool

__all__ = ["UpstreamConnection"]

# filters/response_head.py's framing numbers as the response's enum.
_FRAMING = {f.value: f for f in BodyFraming}


class UpstreamConnection(asyncio.Protocol):
    """One upstream connection: parses response heads and hands body bytes to the response."""

    def __init__(self, pool: UpstreamPool, ep: PoolEndpoint) -> None:
        self.pool = pool
        self.ep = ep
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.requests = 0
        self.lost = False
        self.response: UpstreamResponse | None = None
        self._idle_timer: Deadline | None = None  # on the pool's Deadlines, while idle
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
            waiter.set_exception(StaleConnection())
            return
        got = f" after {len(self._head)} bytes of it" if self._got_bytes else ""
        reason = f" ({describe_error(exc)})" if exc is not None else ""
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
        self._idle_timer = self.pool.idle_deadlines.add(
            self.loop.time() + timeout_s, self._idle_expired
        )

    def cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self.pool.idle_deadlines.cancel(self._idle_timer)
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
        start = len(self._head) - 3
        if start < 0:  # max(..., 0) without the builtin call
            start = 0
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
        try:
            parsed = parse_response_head(head, self.pool.max_headers, self._is_head)
        except ResponseHeadError as exc:
            raise UpstreamProtocolError(ep.name, str(exc)) from None
        if parsed is None:  # 1xx interim response
            return None
        status, reason, headers, content_type, mode, length, keep_alive = parsed
        return UpstreamResponse(
            self, status, reason, headers, content_type, _FRAMING[mode], length, keep_alive
        )
