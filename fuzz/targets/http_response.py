"""HTTP/1.1 response framing (meshd/upstream_connection.py: status line, fields, the
body's length; meshd/upstream_response.py: the body by Content-Length, chunked or until
close): the bytes an upstream answers a GET with, through one UpstreamConnection with a
fake transport, and then the connection's end.

Run with the compiled and with the pure-Python chunked decoder, fed in reads: the same
head, body and error. Fed whole: the same outcome, except that a body refused mid-read
loses what was decoded in that read. Documented errors: UpstreamProtocolError for a
malformed head or body, UpstreamClosedError for a body cut short; nothing may escape
data_received.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fuzz.common import agree, splits, typed

INCLUDE = ["meshd", "filters"]


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closing = False
        self.paused = False

    def write(self, data: Any) -> None:
        assert not self.closing, "a write after abort"

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True

    close = abort

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def setup() -> Callable[[bytes], None]:
    from filters import _chunked_c as compiled  # type: ignore[attr-defined]
    from filters import chunked as pure
    from meshd.upstream import PoolEndpoint
    from meshd.upstream_connection import UpstreamConnection
    from meshd.upstream_errors import UpstreamError

    class _Pool:
        max_head_bytes = 1024
        max_headers = 16
        high_water = 64

        def __init__(self, decoder: Any) -> None:
            self.decoder = decoder

        def _new_decoder(self) -> Any:
            return self.decoder(max_line_bytes=64, max_chunk_size=1 << 20, max_trailer_bytes=128)

        def _done(self, conn: Any, reusable: bool) -> None:
            pass

    async def drive(decoder: Any, reads: list[bytes], is_head: bool) -> Any:
        ep = PoolEndpoint("http://engine:8000", "engine", 8000, "engine:8000", False)
        conn = UpstreamConnection(_Pool(decoder), ep)  # type: ignore[arg-type]
        transport = _Transport()
        conn.connection_made(transport)
        waiter = conn.send(b"GET / HTTP/1.1\r\n\r\n", is_head)
        body: list[bytes] = []
        for r in reads:
            if transport.closing:
                break
            conn.data_received(r)
            resp = conn.response
            if resp is not None and resp._chunks:
                body.append(resp._take())
        conn.connection_lost(None)
        if not waiter.done():
            return ("no head",)
        exc = waiter.exception()
        if exc is not None:
            assert isinstance(exc, UpstreamError), repr(exc)
            return ("head error", str(exc))
        resp = waiter.result()
        try:
            while True:
                piece = await resp.read()
                if not piece:
                    break
                body.append(piece)
            end = "complete"
        except UpstreamError as e:
            end = f"{type(e).__name__}: {e}"
        head = (resp.status, resp.reason, resp.headers, resp.content_type, resp._mode.name)
        return ("response", typed(head), b"".join(body), end)

    loop = asyncio.new_event_loop()

    def one_input(data: bytes) -> None:
        reads = splits(data)
        for is_head in (False, True):
            p = loop.run_until_complete(drive(pure.ChunkedDecoder, reads, is_head))
            c = loop.run_until_complete(drive(compiled.ChunkedDecoder, reads, is_head))
            agree(f"response is_head={is_head}", c, p)
            w = loop.run_until_complete(drive(pure.ChunkedDecoder, reads[:1] and [data], is_head))
            if p[0] == "response" and w[0] == "response" and "malformed chunked" in w[3]:
                p, w = p[:2] + p[3:], w[:2] + w[3:]  # bytes of the refused read are dropped
            agree(f"response whole/split is_head={is_head}", w, p, ("whole", "split"))

    return one_input
