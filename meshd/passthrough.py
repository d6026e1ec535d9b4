"""The transparent listener's passthrough: a raw TCP splice between a client and the
destination it was going to, never parsed. Half-close is forwarded, an error becomes a reset on
the other side, and each direction's send buffer bounds what is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from meshd.transparent import TransparentCounters

# Per-direction send buffer above which the reading side is paused: bounded memory per
# passthrough connection (two of these) with enough in flight to keep a LAN link busy.
PASSTHROUGH_HIGH_WATER = 256 * 1024


def _abort_with_reset(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    cast(asyncio.Transport, transport).abort()


class PipeEnd(asyncio.Protocol):
    """One side of a passthrough splice: what it reads is written to the other side."""

    __slots__ = ("eof", "lost", "peer", "pending", "pipe", "transport")

    def __init__(self, pipe: Pipe) -> None:
        self.pipe = pipe
        self.peer: PipeEnd | None = None
        self.transport: asyncio.Transport | None = None
        # Bytes read before the other side's transport exists (a server that speaks
        # first); reading pauses until Pipe.start() flushes them.
        self.pending: list[bytes] = []
        self.eof = False
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport does not subclass asyncio.Transport but has its methods.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=PASSTHROUGH_HIGH_WATER)
        if not self.pipe.started:
            self.transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        self.pipe.counters.passthrough_bytes += len(data)
        out = self.peer.transport if self.peer is not None else None
        if not self.pipe.started or out is None:
            self.pending.append(data)
            if self.transport is not None:
                self.transport.pause_reading()
        elif not out.is_closing():
            out.write(data)

    def eof_received(self) -> bool:
        self.eof = True
        if self.pipe.started:
            self.pipe.half_closed(self)
        return True  # keep our write side open: the other direction may still flow

    def pause_writing(self) -> None:
        # Our send buffer is full: stop reading from the side that fills it.
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.eof:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe.lost(self, exc)


class Pipe:
    """A bidirectional splice between a client and its original destination.

    Half-close is forwarded (EOF on one side becomes write_eof on the other); once both
    directions have ended both sockets close. An error on either side aborts both.
    """

    __slots__ = ("client", "counters", "done", "started", "upstream")

    def __init__(self, counters: TransparentCounters, loop: asyncio.AbstractEventLoop) -> None:
        self.counters = counters
        self.client = PipeEnd(self)
        self.upstream = PipeEnd(self)
        self.client.peer, self.upstream.peer = self.upstream, self.client
        self.started = False
        self.done: asyncio.Future[None] = loop.create_future()

    def start(self) -> None:
        """Both transports exist: forward what arrived early, then let bytes flow."""
        self.started = True
        for end in (self.client, self.upstream):
            out = end.peer.transport if end.peer is not None else None
            if end.pending and out is not None and not out.is_closing():
                out.write(b"".join(end.pending))
            end.pending.clear()
        for end in (self.client, self.upstream):
            if end.eof:
                self.half_closed(end)
        for end in (self.client, self.upstream):
            if end.transport is not None and not end.transport.is_closing() and not end.eof:
                end.transport.resume_reading()

    def half_closed(self, end: PipeEnd) -> None:
        other = end.peer
        assert other is not None and other.transport is not None
        if not other.transport.is_closing() and other.transport.can_write_eof():
            other.transport.write_eof()
        if end.eof and other.eof:
            self.close()

    def lost(self, end: PipeEnd, exc: Exception | None) -> None:
        end.lost = True
        other = end.peer
        assert other is not None
        if not other.lost and other.transport is not None:
            if exc is not None:
                # Pass the failure on as a reset, not as a clean end of stream.
                _abort_with_reset(other.transport)
            else:
                other.transport.close()
        if (other.lost or other.transport is None) and not self.done.done():
            self.done.set_result(None)

    def close(self) -> None:
        for end in (self.client, self.upstream):
            if end.transport is not None:
                end.transport.close()

    def abort(self) -> None:
        for end in (self.client, self.upstream):
            if end.transport is not None:
                end.transport.abort()
