"""HTTP/1.1 request framing (meshd/listener.py on httptools/llhttp, meshd/http_message.py):
the bytes a client sends on one connection, through the listener with a fake transport
and an echo handler (tests/test_listener.py's harness, in small).

No twin here: the same bytes fed whole and cut into reads must get the same statuses, and
every answer is one the listener documents (200 from the handler; 400, 405, 408, 413, 417,
431 with an OpenAI-style error body whose code is in x-meshd-error); nothing escapes
data_received and no handler outlives its connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from fuzz.common import agree, require, splits
from fuzz.http_wire import FakeTransport, responses

INCLUDE = ["meshd"]
ANSWERS = {200, 400, 405, 408, 413, 417, 431}
DROPPED = "statuses: pipelined requests before unframeable bytes dropped"
STALLED = "reading paused with no request in progress, and no answer"
# Found by this target, reported, not fixed yet (corpus: known-*).
KNOWN: dict[str, str] = {}  # findings fixed: their reproducers are fixed-* seeds now


def _answered(rs: list[tuple[int, dict[str, str], bytes]]) -> list[int]:
    """The statuses to compare, 100 Continue left out, and a last 400 or 431 too: bytes
    that cannot be framed after a request still in progress close the connection after its
    answer, unanswered (meshd/listener.py _malformed, _refuse_head), while the same bytes
    arriving after that answer was sent get their own."""
    statuses = [r[0] for r in rs if r[0] != 100]
    return statuses[:-1] if statuses and statuses[-1] in (400, 431) else statuses


def setup() -> Callable[[bytes], None]:
    import logging

    from meshd.http_message import BodyError, HttpRequest, ListenerLimits, Reply
    from meshd.listener import HttpServer

    logging.getLogger("meshd.listener").disabled = True
    limits = ListenerLimits(
        max_header_count=12,
        max_header_bytes=1024,
        max_body_bytes=2048,
        client_header_timeout_s=5,
        client_body_timeout_s=5,
        keepalive_timeout_s=5,
    )

    async def echo(req: HttpRequest) -> Reply | None:
        said = ("x-echo-method", req.method)  # so that `responses` knows a HEAD's answer
        try:
            body = await req.read_body()
        except BodyError as exc:
            exc.reply.headers.append(said)
            return exc.reply
        if req.path == "/stream":
            stream = req.stream(200, [("Content-Type", "text/plain"), said])
            for part in (body[: len(body) // 2], body[len(body) // 2 :]):
                stream.write(part)
            stream.end()
            return None
        doc = {"method": req.method, "target": req.target, "body": body.decode("latin-1")}
        return Reply(200, [("Content-Type", "application/json"), said], json.dumps(doc).encode())

    async def drive(chunks: list[bytes]) -> tuple[bytes, bool]:
        server = HttpServer(echo, limits)
        conn = server()
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        for chunk in chunks:
            for _ in range(200):
                if transport.reading or transport.closing:
                    break
                await asyncio.sleep(0)
            if transport.closing:
                break
            require(transport.reading, STALLED, "before a read")
            conn.data_received(chunk)
            await asyncio.sleep(0)
        for _ in range(200):
            await asyncio.sleep(0)
            # Idle: nothing handled or queued (the connection's handler task waits on).
            if conn._current is None and not conn._queue:
                break
        closed = transport.closing
        busy = conn._current is not None or conn._queue
        require(closed or transport.reading or busy, STALLED, "at the end")
        if not transport.closing:
            transport.close()
        for _ in range(5):
            await asyncio.sleep(0)
        require(conn._task is None or conn._task.done(), "a handler outlived its connection")
        require(conn not in server.connections, "a closed connection is still tracked")
        return bytes(transport.out), closed

    loop = asyncio.new_event_loop()

    def one_input(data: bytes) -> None:
        whole = responses(loop.run_until_complete(drive([data]))[0])
        split = responses(loop.run_until_complete(drive(splits(data)))[0])
        for status, headers, body in whole + split:
            assert status in ANSWERS or status == 100, status
            if status not in (100, 200) and headers.get("x-echo-method") != "HEAD":
                assert json.loads(body)["error"]["code"] == headers["x-meshd-error"]
        a, b = _answered(whole), _answered(split)
        if len(a) < len(b) and b[: len(a)] == a:
            agree(DROPPED, a, b, ("whole", "split"))
        agree("statuses", a, b, ("whole", "split"))

    return one_input
