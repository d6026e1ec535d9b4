"""The upstream client (meshd/upstream.py) against real aiohttp servers and raw asyncio
servers for the malformed and edge cases: bodies of each framing, keep-alive reuse and its
stale-connection retry, aborts the server sees, errors by kind, limits, backpressure, pool
exhaustion, and a property: random chunk and TCP write splits never change the payload."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.upstream import (
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
)
from meshd.upstream_connection import UpstreamConnection

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
TIMEOUT_S = 5.0  # bounds every await on an event, so a bug fails instead of hanging


def make_pool(**kw: Any) -> UpstreamPool:
    args: dict[str, Any] = {
        "connect_timeout_s": 2.0,
        "keepalive_timeout_s": 30.0,
        "max_connections_per_endpoint": 8,
    }
    args.update(kw)
    return UpstreamPool(**args)


async def read_all(resp: UpstreamResponse) -> list[bytes]:
    pieces: list[bytes] = []
    while True:
        piece = await resp.read()
        if not piece:
            return pieces
        pieces.append(piece)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and body (Content-Length framed, as the client sends them)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


class RawServer:
    """An HTTP server written by hand: `handler(reader, writer, connection_index)`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.handler(reader, writer, index)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.tasks.discard(task)
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[str, RawServer]]]]:
    started: list[RawServer] = []

    async def make(handler: Handler) -> tuple[str, RawServer]:
        server = RawServer(handler)
        url = await server.start()
        started.append(server)
        return url, server

    yield make
    for server in started:
        await server.stop()


class WebServer:
    """A real aiohttp server; records the client connections (peer addresses) it saw."""

    def __init__(self, app: web.Application) -> None:
        self.peers: set[Any] = set()
        self.requests: list[web.Request] = []
        app.middlewares.append(self._record)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        assert request.transport is not None
        self.peers.add(request.transport.get_extra_info("peername"))
        self.requests.append(request)
        response: web.StreamResponse = await handler(request)
        return response

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server  # asyncio's or uvloop's Server
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def web_server() -> AsyncIterator[
    Callable[[web.Application], Awaitable[tuple[str, WebServer]]]
]:
    started: list[WebServer] = []

    async def make(app: web.Application) -> tuple[str, WebServer]:
        server = WebServer(app)
        url = await server.start()
        started.append(server)
        return url, server

    yield make
    for server in started:
        await server.runner.cleanup()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = make_pool()
    yield p
    await p.close()


def sse_events(n: int) -> list[bytes]:
    return [b'data: {"i":%d,"text":" tok"}\n\n' % i for i in range(n)] + [b"data: [DONE]\n\n"]


def sse_app(events: list[bytes]) -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    return app


# -- bodies --------------------------------------------------------------------------------


async def test_streamed_chunked_sse(web_server: Any, pool: UpstreamPool) -> None:
    events = sse_events(200)
    url, server = await web_server(sse_app(events))
    body = json.dumps({"prompt": "hi", "stream": True}).encode()
    resp = await pool.request(
        url, "POST", "/v1/completions?x=1", [("Content-Type", "application/json")], body
    )
    assert (resp.status, resp.reason) == (200, "OK")
    assert resp.content_type == "text/event-stream"
    assert resp.header("TRANSFER-ENCODING") == "chunked"
    assert resp.header("x-absent") is None
    assert any(name == "Content-Type" for name, _ in resp.headers)
    pieces = await read_all(resp)
    assert b"".join(pieces) == b"".join(events)
    assert resp.at_eof()
    resp.release()
    request = server.requests[0]
    assert request.path_qs == "/v1/completions?x=1"
    assert request.headers["Host"] == url.removeprefix("http://")
    assert request.headers["Content-Length"] == str(len(body))
    assert pool.stats()["idle"] == 1


async def test_content_length_body_and_head(web_server: Any, pool: UpstreamPool) -> None:
    payload = b"x" * 100_000

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=payload, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/data", handler)
    url, server = await web_server(app)
    resp = await pool.request(url, "GET", "/data", [], b"")
    assert resp.header("content-length") == str(len(payload))
    assert b"".join(await read_all(resp)) == payload
    resp.release()
    head = await pool.request(url, "HEAD", "/data", [], b"")
    assert head.status == 200 and head.at_eof() and await head.read() == b""
    head.release()
    again = await pool.request(url, "GET", "/data", [], b"")
    assert b"".join(await read_all(again)) == payload
    again.release()
    assert len(server.peers) == 1
    # GET with an empty body sends no Content-Length; POST always sends one.
    assert "Content-Length" not in server.requests[0].headers


async def test_read_until_close(raw_server: Any, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello ")
        await writer.drain()
        writer.write(b"world")

    url, _ = await raw_server(handler)
    resp = await pool.request(url, "GET", "/", [], b"")
    assert b"".join(await read_all(resp)) == b"hello world"
    resp.release()
    assert pool.stats()["idle"] == 0  # a body ended by close leaves no connection to reuse


async def test_http10_response_not_reused(raw_server: Any, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await reader.read()

    url, server = await raw_server(handler)
    for _ in range(2):
        resp = await pool.request(url, "GET", "/", [], b"")
        assert await resp.read() == b"ok"
        assert await resp.read() == b""
        resp.release()
    assert server.connections == 2


async def test_no_body_statuses(raw_server: Any, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for status in (b"204 No Content", b"304 Not Modified"):
            await read_request(reader)
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 10\r\n\r\n")

    url, server = await raw_server(handler)
    for status in (204, 304):
        resp = await pool.request(url, "GET", "/", [], b"")
        assert resp.status == status and resp.at_eof()
        resp.release()
    assert server.connections == 1


# -- keep-alive ----------------------------------------------------------------------------


async def test_keepalive_reuse(web_server: Any, pool: UpstreamPool) -> None:
    events = sse_events(5)
    url, server = await web_server(sse_app(events))
    for _ in range(6):
        resp = await pool.request(url, "POST", "/v1/completions", [], b"{}")
        assert b"".join(await read_all(resp)) == b"".join(events)
        resp.release()
    assert len(server.peers) == 1
    stats = pool.stats()
    assert (stats["opened"], stats["reused"], stats["idle"], stats["in_use"]) == (1, 5, 1, 0)


async def test_sent_runs_once_after_the_write_or_before_a_wait(
    web_server: Any, pool: UpstreamPool
) -> None:
    """`sent` (the caller's bookkeeping, issue #22): on an idle connection it runs after the
    request was written; with none idle, before the wait for a new one; never when the
    request fails before either."""
    url, _ = await web_server(sse_app(sse_events(1)))
    seen: list[tuple[int, int]] = []  # (connections opened, requests written) as it ran

    def sent() -> None:
        written = sum(c.requests for ep in pool._endpoints.values() for c in ep.live)
        seen.append((pool.stats()["opened"], written))

    for _ in range(2):
        resp = await pool.request(url, "POST", "/v1/completions", [], b"{}", sent)
        await read_all(resp)
        resp.release()
    assert seen == [(0, 0), (1, 2)]  # before connecting; after the second write
    with pytest.raises(ValueError, match="CR, LF"):
        await pool.request(url, "GET", "/", [("X", "a\r\nEvil: 1")], b"", sent)
    assert len(seen) == 2


async def test_stale_keepalive_retried_once(raw_server: Any, pool: UpstreamPool) -> None:
    """The first connection answers one request, then closes on the next without a byte:
    the race with a server's idle timeout. The client retries on a fresh connection."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, i: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n" + str(i).encode())
        await writer.drain()
        if i == 0:
            await read_request(reader)
            return  # closes without answering
        await reader.read()

    url, server = await raw_server(handler)
    first = await pool.request(url, "POST", "/", [], b"a")
    assert await first.read() == b"0"
    first.release()
    second = await pool.request(url, "POST", "/", [], b"b")
    assert await second.read() == b"1"
    second.release()
    assert server.connections == 2
    assert pool.stats()["stale_retries"] == 1


async def test_fresh_connection_closed_raises(raw_server: Any, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)

    url, server = await raw_server(handler)
    with pytest.raises(UpstreamClosedError, match="closed before the response head") as info:
        await pool.request(url, "GET", "/", [], b"")
    assert url in str(info.value)
    assert server.connections == 1
    assert pool.stats()["stale_retries"] == 0
    assert pool.stats()["in_use"] == 0


async def test_idle_connection_closed_by_server_is_dropped(
    raw_server: Any, pool: UpstreamPool
) -> None:
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        closed.set()

    url, _ = await raw_server(handler)
    resp = await pool.request(url, "GET", "/", [], b"")
    resp.release()
    await asyncio.wait_for(closed.wait(), TIMEOUT_S)
    # The FIN is in flight on loopback; yield to the loop (no timed sleep) until it lands.
    async with asyncio.timeout(TIMEOUT_S):
        while pool.stats()["idle"]:
            await asyncio.sleep(0)
    assert pool.stats()["stale_retries"] == 0


async def test_idle_connection_expires(raw_server: Any) -> None:
    eof = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await reader.read()  # returns at the client's FIN
        eof.set()

    url, _ = await raw_server(handler)
    pool = make_pool(keepalive_timeout_s=0.05)
    try:
        resp = await pool.request(url, "GET", "/", [], b"")
        resp.release()
        assert pool.stats()["idle"] == 1
        await asyncio.wait_for(eof.wait(), TIMEOUT_S)
        assert pool.stats()["idle"] == 0
    finally:
        await pool.close()


async def test_connection_close_not_reused(web_server: Any, pool: UpstreamPool) -> None:
    async def handler(request: web.Request) -> web.Response:
        resp = web.Response(text="bye")
        resp.force_close()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    url, server = await web_server(app)
    for _ in range(2):
        resp = await pool.request(url, "GET", "/", [], b"")
        assert resp.header("connection") == "close"
        assert b"".join(await read_all(resp)) == b"bye"
        resp.release()
        assert pool.stats()["idle"] == 0
    assert len(server.peers) == 2


async def test_unused_bytes_after_body_prevent_reuse(raw_server: Any, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\nEXTRA"
        )
        await reader.read()

    url, _ = await raw_server(handler)
    resp = await pool.request(url, "GET", "/", [], b"")
    assert b"".join(await read_all(resp)) == b"ok"
    resp.release()
    assert pool.stats()["idle"] == 0


# -- aborts and broken bodies ----------------------------------------------------------


async def test_close_mid_body_reaches_the_server(web_server: Any, pool: UpstreamPool) -> None:
    started = asyncio.Event()
    disconnected = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        started.set()
        try:
            await asyncio.Event().wait()  # an engine still generating
        except asyncio.CancelledError:
            disconnected.set()
            raise
        return resp

    app = web.Application()
    app.router.add_post("/", handler)
    url, _ = await web_server(app)
    resp = await pool.request(url, "POST", "/", [], b"{}")
    assert await resp.read() == b"data: first\n\n"
    await asyncio.wait_for(started.wait(), TIMEOUT_S)
    reading = asyncio.create_task(resp.read())
    await asyncio.sleep(0)  # let the read wait for data
    resp.close()
    await asyncio.wait_for(disconnected.wait(), TIMEOUT_S)
    with pytest.raises(UpstreamClosedError, match="closed before its end"):
        await reading
    assert pool.stats()["in_use"] == 0 and pool.stats()["idle"] == 0


async def test_cancel_while_waiting_for_head_closes(raw_server: Any, pool: UpstreamPool) -> None:
    received = asyncio.Event()
    eof = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        received.set()
        await reader.read()
        eof.set()

    url, _ = await raw_server(handler)
    task = asyncio.create_task(pool.request(url, "POST", "/", [], b"{}"))
    await asyncio.wait_for(received.wait(), TIMEOUT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(eof.wait(), TIMEOUT_S)
    assert pool.stats()["in_use"] == 0


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\nab",
            "closed before the last chunk",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello", "5 bytes before the end"),
    ],
)
async def test_early_eof_mid_body(
    raw_server: Any, pool: UpstreamPool, response: bytes, message: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(response)
        await writer.drain()

    url, _ = await raw_server(handler)
    resp = await pool.request(url, "GET", "/", [], b"")
    received = b""
    with pytest.raises(UpstreamClosedError, match=message):
        while True:
            received += await resp.read()
    assert received.startswith(b"hello")
    assert not resp.at_eof()
    resp.close()
    assert pool.stats()["in_use"] == 0


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (b"HTTP/2 200 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed status line"),
        (b"ICY 200 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n", "malformed response header"),
        (b"HTTP/1.1 200 OK\r\nno-colon\r\n\r\n", "malformed response header"),
        (b"HTTP/1.1 200 OK\r\nX: a\nb\r\n\r\n", "malformed response header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "unsupported Transfer"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
            "both Transfer-Encoding and Content-Length",
        ),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "unexpected 101"),
    ],
)
async def test_malformed_head(
    raw_server: Any, pool: UpstreamPool, head: bytes, message: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(head)
        await reader.read()

    url, _ = await raw_server(handler)
    with pytest.raises(UpstreamProtocolError, match=message) as info:
        await pool.request(url, "GET", "/", [], b"")
    assert str(info.value).startswith(url)
    assert pool.stats()["in_use"] == 0


async def test_malformed_chunk_framing(raw_server: Any, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n")
        await reader.read()

    url, _ = await raw_server(handler)
    resp = await pool.request(url, "GET", "/", [], b"")
    with pytest.raises(UpstreamProtocolError, match="malformed chunked body: invalid chunk size"):
        await resp.read()
    resp.close()


async def test_obs_fold_and_lenient_whitespace(raw_server: Any, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 \r\nX-Long: one\r\n  two\r\nContent-Type:TEXT/Plain ;q=1 \r\n"
            b"Content-Length: 2, 2\r\n\r\nok"
        )

    url, _ = await raw_server(handler)
    resp = await pool.request(url, "GET", "/", [], b"")
    assert resp.reason == ""
    assert resp.header("x-long") == "one two"
    assert resp.content_type == "text/plain"
    assert await resp.read() == b"ok"
    resp.release()


async def test_connect_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pool = make_pool()
    try:
        with pytest.raises(UpstreamConnectError, match="connect failed") as info:
            await pool.request(f"http://127.0.0.1:{port}", "GET", "/", [], b"")
        assert f"127.0.0.1:{port}" in str(info.value)
        assert pool.stats()["in_use"] == 0
        with pytest.raises(UpstreamConnectError, match="must be http"):
            await pool.request("ftp://127.0.0.1:1", "GET", "/", [], b"")
    finally:
        await pool.close()


def self_signed(tmp_path: Any) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as PEM files; the cert is its own CA."""
    pytest.importorskip("cryptography")
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshd test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


async def test_https_endpoint(tmp_path: Any) -> None:
    import ssl

    cert, key = self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    events = sse_events(20)
    server = WebServer(sse_app(events))
    await server.runner.setup()
    site = web.TCPSite(server.runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    sockets: Any = site._server
    url = f"https://127.0.0.1:{sockets.sockets[0].getsockname()[1]}"
    trusting = make_pool(ssl_context=ssl.create_default_context(cafile=cert))
    default = make_pool()
    try:
        for _ in range(2):
            resp = await trusting.request(url, "POST", "/v1/completions", [], b"{}")
            assert b"".join(await read_all(resp)) == b"".join(events)
            resp.release()
        assert len(server.peers) == 1
        with pytest.raises(UpstreamConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await default.request(url, "POST", "/v1/completions", [], b"{}")
    finally:
        await trusting.close()
        await default.close()
        await server.runner.cleanup()


async def test_pool_close_ends_reads(web_server: Any) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"part")
        await asyncio.Event().wait()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    url, _ = await web_server(app)
    pool = make_pool()
    resp = await pool.request(url, "GET", "/", [], b"")
    assert await resp.read() == b"part"
    await pool.close()
    with pytest.raises(UpstreamClosedError):
        await resp.read()
    resp.close()
    with pytest.raises(UpstreamConnectError, match="closed"):
        await pool.request(url, "GET", "/", [], b"")


async def test_concurrent_requests_open_connections(web_server: Any, pool: UpstreamPool) -> None:
    events = sse_events(10)
    url, server = await web_server(sse_app(events))

    async def one() -> bytes:
        resp = await pool.request(url, "POST", "/v1/completions", [], b"{}")
        body = b"".join(await read_all(resp))
        resp.release()
        return body

    bodies = await asyncio.gather(*(one() for _ in range(4)))
    assert bodies == [b"".join(events)] * 4
    assert pool.stats()["opened"] == len(server.peers) == 4
    assert pool.stats()["idle"] == 4 and pool.stats()["in_use"] == 0


async def test_errors_share_a_base() -> None:
    for cls in (UpstreamConnectError, UpstreamProtocolError, UpstreamClosedError):
        assert issubclass(cls, UpstreamError)


async def test_header_injection_refused(pool: UpstreamPool) -> None:
    with pytest.raises(ValueError, match="CR, LF"):
        await pool.request("http://127.0.0.1:1", "GET", "/", [("X", "a\r\nEvil: 1")], b"")


# -- limits ----------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [0, 1])
async def test_head_size_limit(raw_server: Any, extra: int) -> None:
    limit = 1024
    base = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nX-Pad: \r\n\r\n"
    head = base.replace(b"X-Pad: ", b"X-Pad: " + b"p" * (limit - len(base) + extra))

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        for i in range(0, len(head), 100):  # split, so the limit holds across reads
            writer.write(head[i : i + 100])
            await writer.drain()
        await reader.read()

    url, _ = await raw_server(handler)
    pool = make_pool(max_head_bytes=limit)
    try:
        if extra:
            with pytest.raises(UpstreamProtocolError, match=r"larger than max_head_bytes \(1024\)"):
                await pool.request(url, "GET", "/", [], b"")
        else:
            resp = await pool.request(url, "GET", "/", [], b"")
            assert resp.status == 200
            resp.release()
    finally:
        await pool.close()


async def test_header_count_limit(raw_server: Any) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"X: 1\r\n" * 4 + b"\r\n")
        await reader.read()

    url, _ = await raw_server(handler)
    pool = make_pool(max_headers=3)
    try:
        with pytest.raises(UpstreamProtocolError, match=r"exceed max_headers \(3\)"):
            await pool.request(url, "GET", "/", [], b"")
    finally:
        await pool.close()


async def test_100_continue_skipped(raw_server: Any, pool: UpstreamPool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 201 Created\r\n")
        await writer.drain()
        writer.write(b"Content-Length: 2\r\n\r\nok")
        await reader.read()

    url, _ = await raw_server(handler)
    resp = await pool.request(url, "POST", "/", [], b"{}")
    assert (resp.status, resp.reason) == (201, "Created")
    assert resp.header("link") is None
    assert await resp.read() == b"ok"
    resp.release()


async def test_backpressure_bounds_the_buffer(web_server: Any) -> None:
    """A reader that doesn't read: the client stops reading the socket once more than
    high_water bytes wait, and starts again when read() drains them."""
    total = 8 * 1024 * 1024
    piece = b"z" * 65536

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(total // len(piece)):
            await resp.write(piece)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    url, _ = await web_server(app)
    high_water = 256 * 1024
    pool = make_pool(high_water=high_water)
    try:
        resp = await pool.request(url, "GET", "/", [], b"")
        transport = resp._conn.transport
        assert transport is not None
        paused = asyncio.Event()
        pause = transport.pause_reading

        def record_pause() -> None:
            paused.set()
            pause()

        transport.pause_reading = record_pause  # type: ignore[method-assign]
        await asyncio.wait_for(paused.wait(), TIMEOUT_S)
        # At most one socket read (asyncio reads up to 256 KiB) lands past the mark.
        assert high_water < resp.buffered <= high_water + 256 * 1024
        received = sum(len(p) for p in await read_all(resp))
        assert received == total
        resp.release()
    finally:
        await pool.close()


async def test_pool_exhaustion_waits_then_proceeds(web_server: Any) -> None:
    events = sse_events(3)
    url, server = await web_server(sse_app(events))
    pool = make_pool(max_connections_per_endpoint=1, connect_timeout_s=TIMEOUT_S)
    try:
        first = await pool.request(url, "POST", "/v1/completions", [], b"{}")
        second = asyncio.create_task(pool.request(url, "POST", "/v1/completions", [], b"{}"))
        await asyncio.sleep(0)  # one step: the second request queues for the connection
        assert pool.stats()["waiting"] == 1 and not second.done()
        assert b"".join(await read_all(first)) == b"".join(events)
        first.release()
        resp = await asyncio.wait_for(second, TIMEOUT_S)
        assert b"".join(await read_all(resp)) == b"".join(events)
        resp.release()
        assert len(server.peers) == 1
        assert pool.stats()["waiting"] == 0
    finally:
        await pool.close()


async def test_pool_exhaustion_times_out(web_server: Any) -> None:
    url, _ = await web_server(sse_app(sse_events(1)))
    pool = make_pool(max_connections_per_endpoint=1, connect_timeout_s=0.05)
    try:
        first = await pool.request(url, "POST", "/v1/completions", [], b"{}")
        with pytest.raises(UpstreamConnectError, match="pool exhausted"):
            await pool.request(url, "POST", "/v1/completions", [], b"{}")
        first.close()  # a closed connection frees its slot for a new one
        again = await pool.request(url, "POST", "/v1/completions", [], b"{}")
        await read_all(again)
        again.release()
        assert pool.stats() == {
            "opened": 2,
            "reused": 0,
            "stale_retries": 0,
            "idle": 1,
            "in_use": 0,
            "waiting": 0,
        }
    finally:
        await pool.close()


# -- uvloop and the split property -----------------------------------------------------


def run_on(loop_kind: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    factory = uvloop.new_event_loop if loop_kind == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


def chunk_encode(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"


async def serve_splits(wire: bytes, cuts: list[int], requests: int) -> list[bytes]:
    """A raw server answering `requests` requests on one connection with `wire` written in
    the pieces `cuts` makes; returns each response's read() concatenation."""
    points = sorted({c % (len(wire) + 1) for c in cuts})
    edges = [0, *points, len(wire)]
    writes = [wire[a:b] for a, b in itertools.pairwise(edges) if b > a]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        for _ in range(requests):
            await read_request(reader)
            for w in writes:
                writer.write(w)
                await writer.drain()
        await reader.read()

    server = RawServer(handler)
    url = await server.start()
    pool = make_pool()
    out = []
    try:
        for _ in range(requests):
            resp = await pool.request(url, "POST", "/", [], b"{}")
            out.append(b"".join(await read_all(resp)))
            resp.release()
        assert server.connections == 1
    finally:
        await pool.close()
        await server.stop()
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(st.binary(max_size=600), max_size=15),
    cuts=st.lists(st.integers(0, 20_000), max_size=12),
    loop_kind=st.sampled_from(["asyncio", "uvloop"]),
)
def test_random_chunks_and_write_splits(
    pieces: list[bytes], cuts: list[int], loop_kind: str
) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    head += b"\r\n"
    wire = head + chunk_encode(pieces)
    results: list[bytes] = []

    async def main() -> None:
        results.extend(await serve_splits(wire, cuts, requests=2))

    run_on(loop_kind, main)
    assert results == [b"".join(pieces)] * 2


def test_uvloop_stream_reuse_and_abort() -> None:
    events = sse_events(50)

    async def main() -> None:
        disconnected = asyncio.Event()

        async def endless(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"data: x\n\n")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                disconnected.set()
                raise
            return resp

        app = sse_app(events)
        app.router.add_get("/endless", endless)
        server = WebServer(app)
        url = await server.start()
        pool = make_pool()
        try:
            for _ in range(3):
                resp = await pool.request(url, "POST", "/v1/completions", [], b"{}")
                assert b"".join(await read_all(resp)) == b"".join(events)
                resp.release()
            assert len(server.peers) == 1
            resp = await pool.request(url, "GET", "/endless", [], b"")
            assert await resp.read() == b"data: x\n\n"
            resp.close()
            await asyncio.wait_for(disconnected.wait(), TIMEOUT_S)
        finally:
            await pool.close()
            await server.runner.cleanup()

    run_on("uvloop", main)


_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# The reference: a capturing findall over the validated block, trailing OWS stripped.
_REF_FIELD_LINES = re.compile(rf"([{re.escape(_TOKEN_CHARS)}]+):[ \t]*([^\r\n\x00]*)\r\n")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(_TOKEN_CHARS, min_size=1, max_size=12),
            st.text(
                st.characters(exclude_characters="\r\n\x00", exclude_categories=["Cs"]),
                max_size=20,
            ),
        ),
        max_size=8,
    )
)
def test_response_fields_match_the_regex_reference(fields: list[tuple[str, str]]) -> None:
    head = "HTTP/1.1 204 No Content\r\n" + "".join(f"{n}:{v}\r\n" for n, v in fields)
    raw = head[:-2].encode("utf-8", "surrogateescape")

    async def parse() -> UpstreamResponse | None:
        pool = make_pool()
        return UpstreamConnection(pool, pool._endpoint("http://127.0.0.1:1"))._parse_head(raw)

    response = asyncio.run(parse())
    assert response is not None
    block = head.partition("\r\n")[2]
    assert response.headers == [(n, v.rstrip(" \t")) for n, v in _REF_FIELD_LINES.findall(block)]
