"""The fault campaign's latency injector (loadtest/chaos.py, scenario "latency"): a TCP
forwarder in front of one engine that, when told, holds every chunk it forwards for N ms.
It runs in user space (tc netem needs the kernel's sch_netem) and delays only what goes
through it: the sidecar's traffic, not the campaign's own probes of the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable

CHUNK_BYTES = 65536
# Chunks one direction of a connection holds before it stops reading (the sender then
# waits, as TCP makes it): 1024 x 64 KiB bounds a delay line at 64 MiB, far above what a
# 200 ms line of SSE streams holds.
MAX_HELD_CHUNKS = 1024

# What a delay line holds: a chunk, b"" for the sender's end (FIN) or None for a reset.
_Held = tuple[float, bytes | None]


class DelayProxy:
    """Listens on 127.0.0.1 (a port of its own) and forwards each connection to `host`:`port`.
    `delay(down_ms, up_ms)` delays the bytes the upstream sends (down) and those sent to it
    (up) from then on. A delay line, not a queue behind a sleep: each chunk is held until
    its arrival + the delay of that moment, so the line keeps its throughput, and is never
    sent before the chunk ahead of it, so each connection keeps its byte order (when the
    delay drops, what arrives next waits behind what is still held). The end of a stream
    travels the same line: once either side's end (or reset) has come through, both sides
    are closed (or reset)."""

    def __init__(self, host: str, port: int, max_held_chunks: int = MAX_HELD_CHUNKS) -> None:
        self.upstream = (host, port)
        self.max_held_chunks = max_held_chunks
        self.down_s = 0.0
        self.up_s = 0.0
        self.connections = 0  # accepted so far
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "the proxy is not started"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def delay(self, down_ms: float, up_ms: float = 0.0) -> None:
        self.down_s, self.up_s = down_ms / 1000, up_ms / 1000

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def close(self) -> None:
        """Stop listening and reset every connection still open."""
        if self._server is not None:
            self._server.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                _reset(writer)
                return
            await self._relay(reader, writer, up_reader, up_writer)
        finally:
            self._relays.discard(task)

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        down = asyncio.create_task(self._line(up_reader, writer, lambda: self.down_s))
        up = asyncio.create_task(self._line(reader, up_writer, lambda: self.up_s))
        clean = False
        try:
            done, _ = await asyncio.wait((down, up), return_when=asyncio.FIRST_COMPLETED)
            clean = all(not t.cancelled() and t.exception() is None for t in done)
        finally:
            for t in (down, up):
                t.cancel()
            await asyncio.gather(down, up, return_exceptions=True)
            for w in (writer, up_writer):
                if clean:
                    w.close()
                else:
                    _reset(w)

    async def _line(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        delay_s: Callable[[], float],
    ) -> None:
        """Forward `reader` to `writer` through a delay line; returns once the reader's end
        has been forwarded, raises ConnectionResetError once its reset has."""
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[_Held] = asyncio.Queue(self.max_held_chunks)

        async def forward() -> None:
            while True:
                due, chunk = await held.get()
                while (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if chunk is None:
                    raise ConnectionResetError("the other side reset the connection")
                if not chunk:
                    return
                writer.write(chunk)
                await writer.drain()

        # A failed write ends the reading too (the group cancels it), and the other way round.
        async with asyncio.TaskGroup() as group:
            group.create_task(forward())
            try:
                while chunk := await reader.read(CHUNK_BYTES):
                    await held.put((loop.time() + delay_s(), chunk))
                end: bytes | None = b""
            except ConnectionError:
                end = None
            await held.put((loop.time() + delay_s(), end))


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), as a broken connection ends, not with an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
