"""The transparent listener without iptables: the original destination is injected, every
connection is real TCP on 127.0.0.1, and each scenario runs on asyncio and on uvloop.
tests/test_netns_interception.py covers the real SO_ORIGINAL_DST under iptables."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop
from aiohttp import ClientSession, web
from hypothesis import given
from hypothesis import strategies as st

from meshd.original_dst import (
    IP6T_SO_ORIGINAL_DST,
    SO_ORIGINAL_DST,
    SOL_IPV6,
    NotRedirectedError,
    original_destination,
    parse_sockaddr,
)
from meshd.passthrough import Pipe
from meshd.transparent import TransparentListener, start_transparent_listener

LOOPS = ["asyncio", "uvloop"]
Address = tuple[str, int]


def run(kind: str, coro: Coroutine[Any, Any, None]) -> None:
    factory = uvloop.new_event_loop if kind == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(asyncio.wait_for(coro, 20))


# ---------------------------------------------------------------- sockaddr parsing


def _sockaddr_in(ip: str, port: int) -> bytes:
    family = socket.AF_INET.to_bytes(2, sys.byteorder)
    return family + struct.pack("!H", port) + socket.inet_pton(socket.AF_INET, ip) + bytes(8)


def _sockaddr_in6(ip: str, port: int) -> bytes:
    family = socket.AF_INET6.to_bytes(2, sys.byteorder)
    addr = socket.inet_pton(socket.AF_INET6, ip)
    return family + struct.pack("!HI", port, 0) + addr + struct.pack("I", 0)


@given(st.ip_addresses(v=4), st.integers(0, 65535))
def test_parse_sockaddr_in_round_trips(ip: Any, port: int) -> None:
    assert parse_sockaddr(_sockaddr_in(str(ip), port)) == (str(ip), port)


@given(st.ip_addresses(v=6), st.integers(0, 65535))
def test_parse_sockaddr_in6_round_trips(ip: Any, port: int) -> None:
    raw = _sockaddr_in6(str(ip), port)
    assert len(raw) == 28
    got_ip, got_port = parse_sockaddr(raw)
    assert (ipaddress.ip_address(got_ip), got_port) == (ip, port)


@given(st.binary(max_size=40))
def test_parse_sockaddr_accepts_or_raises_value_error(raw: bytes) -> None:
    try:
        ip, port = parse_sockaddr(raw)
    except ValueError:
        return
    assert 0 <= port <= 65535 and isinstance(ip, str)


def test_parse_sockaddr_rejects_unknown_family_and_short_input() -> None:
    with pytest.raises(ValueError, match="family"):
        parse_sockaddr(socket.AF_UNIX.to_bytes(2, sys.byteorder) + bytes(14))
    with pytest.raises(ValueError, match="too short"):
        parse_sockaddr(socket.AF_INET.to_bytes(2, sys.byteorder) + b"\x00")


class FakeSock:
    """Records the getsockopt call original_destination makes."""

    def __init__(self, family: int, peer: Address, result: bytes | OSError) -> None:
        self.family = family
        self.peer = peer
        self.result = result
        self.calls: list[tuple[int, int, int]] = []

    def getpeername(self) -> Address:
        return self.peer

    def getsockopt(self, level: int, opt: int, size: int) -> bytes:
        self.calls.append((level, opt, size))
        if isinstance(self.result, OSError):
            raise self.result
        return self.result


def test_original_destination_asks_the_right_level_per_family() -> None:
    v4 = FakeSock(socket.AF_INET, ("10.0.0.1", 5), _sockaddr_in("10.0.0.2", 8000))
    assert original_destination(v4) == ("10.0.0.2", 8000)  # type: ignore[arg-type]
    assert v4.calls == [(socket.SOL_IP, SO_ORIGINAL_DST, 16)]

    v6 = FakeSock(socket.AF_INET6, ("fd00::1", 5), _sockaddr_in6("fd00::2", 8000))
    assert original_destination(v6) == ("fd00::2", 8000)  # type: ignore[arg-type]
    assert v6.calls == [(SOL_IPV6, IP6T_SO_ORIGINAL_DST, 28)]

    # An IPv4 client on a dual-stack socket: the IPv4 conntrack table knows it.
    mapped = FakeSock(socket.AF_INET6, ("::ffff:10.0.0.1", 5), _sockaddr_in("10.0.0.2", 80))
    assert original_destination(mapped) == ("10.0.0.2", 80)  # type: ignore[arg-type]
    assert mapped.calls == [(socket.SOL_IP, SO_ORIGINAL_DST, 16)]


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ENOPROTOOPT])
def test_original_destination_without_nat_record_is_not_redirected(code: int) -> None:
    sock = FakeSock(socket.AF_INET, ("10.0.0.1", 5), OSError(code, os.strerror(code)))
    with pytest.raises(NotRedirectedError, match="not redirected") as info:
        original_destination(sock)  # type: ignore[arg-type]
    assert info.value.errno == code
    assert isinstance(info.value, OSError)


def test_original_destination_other_errors_propagate() -> None:
    sock = FakeSock(socket.AF_INET, ("10.0.0.1", 5), OSError(errno.EBADF, "bad fd"))
    with pytest.raises(OSError) as info:
        original_destination(sock)  # type: ignore[arg-type]
    assert not isinstance(info.value, NotRedirectedError)


def test_original_destination_of_a_plain_loopback_connection() -> None:
    # No NAT: the kernel either has no record or reports the socket's own address.
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            try:
                dest = original_destination(conn)
            except NotRedirectedError:
                return
            assert dest == conn.getsockname()


# ---------------------------------------------------------------- fixtures as helpers


class Dest:
    """The injected SO_ORIGINAL_DST: maps an accepted socket's peer port to a destination."""

    def __init__(self) -> None:
        self.by_peer_port: dict[int, Address] = {}
        self.default: Address | None = None

    def __call__(self, sock: socket.socket) -> Address:
        dest = self.by_peer_port.get(sock.getpeername()[1], self.default)
        if dest is None:
            raise NotRedirectedError(errno.ENOENT, "not redirected by iptables")
        return dest


async def start_tcp(handler: Callable[..., Awaitable[None]]) -> tuple[asyncio.Server, Address]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    return server, (host, port)


async def echo_until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echoes as it reads, then (proving half-close works) sends a trailer after EOF."""
    peer = writer.get_extra_info("peername")
    writer.write(f"peer={peer[0]}:{peer[1]}\n".encode())
    while chunk := await reader.read(65536):
        writer.write(chunk)
        await writer.drain()
    writer.write(b"<after-eof>")
    await writer.drain()
    writer.close()


async def http_server(listener_ref: list[TransparentListener]) -> web.Server:
    async def handler(request: web.BaseRequest) -> web.Response:
        listener = listener_ref[0]
        sock = request.transport.get_extra_info("socket") if request.transport else None
        nodelay = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) if sock else None
        return web.json_response(
            {
                "pool": listener.pool_for(request.transport),
                "dest": listener.original_destination_of(request.transport),
                "nodelay": nodelay,
                "body": (await request.read()).decode(),
            }
        )

    return web.Server(handler)


async def read_all(reader: asyncio.StreamReader) -> bytes:
    return await reader.read(-1)


# ---------------------------------------------------------------- interception


@pytest.mark.parametrize("kind", LOOPS)
def test_inference_destination_is_handed_to_http_with_its_pool(kind: str) -> None:
    async def scenario() -> None:
        dest = Dest()
        dest.default = ("10.9.9.9", 8000)
        ref: list[TransparentListener] = []
        server = await http_server(ref)
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {("10.9.9.9", 8000): "gpu-a"}, server, original_destination_fn=dest
        )
        ref.append(listener)
        try:
            assert listener.port > 0
            async with ClientSession() as session:
                url = f"http://127.0.0.1:{listener.port}/v1/chat/completions"
                for i in range(2):  # keep-alive: one connection, two requests
                    async with session.post(url, data=f"hello {i}") as resp:
                        got = await resp.json()
                    assert got == {
                        "pool": "gpu-a",
                        "dest": ["10.9.9.9", 8000],
                        "nodelay": 1,
                        "body": f"hello {i}",
                    }
            assert listener.counters.intercepted == 1
            assert listener.counters.passthrough == 0
            assert listener.pool_for(None) is None
        finally:
            listener.close()
            await listener.wait_closed()
            await server.shutdown()

    run(kind, scenario())


@pytest.mark.parametrize("kind", LOOPS)
def test_pool_for_is_none_on_connections_the_listener_did_not_route(kind: str) -> None:
    async def scenario() -> None:
        ref: list[TransparentListener] = []
        server = await http_server(ref)
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {("10.9.9.9", 8000): "gpu-a"}, server, original_destination_fn=Dest()
        )
        ref.append(listener)
        # The same HTTP server behind an ordinary (explicit) listener.
        loop = asyncio.get_running_loop()
        plain = await loop.create_server(server, "127.0.0.1", 0)
        port = plain.sockets[0].getsockname()[1]
        try:
            url = f"http://127.0.0.1:{port}/x"
            async with ClientSession() as session, session.post(url, data="b") as resp:
                got = await resp.json()
            assert got["pool"] is None and got["dest"] is None
        finally:
            plain.close()
            listener.close()
            await listener.wait_closed()
            await server.shutdown()

    run(kind, scenario())


def test_services_must_be_ip_addresses() -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="must be an IP address"):
            await start_transparent_listener(
                "127.0.0.1", 0, {("backend.svc", 8000): "p"}, asyncio.Protocol
            )
        with pytest.raises(ValueError, match="port out of range"):
            await start_transparent_listener(
                "127.0.0.1", 0, {("10.0.0.1", 0): "p"}, asyncio.Protocol
            )

    run("asyncio", scenario())


# ---------------------------------------------------------------- passthrough


@pytest.mark.parametrize("kind", LOOPS)
def test_other_destinations_pass_through_byte_for_byte_with_half_close(kind: str) -> None:
    async def scenario() -> None:
        echo, echo_addr = await start_tcp(echo_until_eof)
        dest = Dest()
        dest.default = echo_addr  # not an inference service
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {("10.9.9.9", 8000): "gpu-a"}, asyncio.Protocol,
            original_destination_fn=dest,
        )  # fmt: skip
        try:
            payload = bytes(range(256)) * 8192  # 2 MiB, every byte value
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            sent = asyncio.create_task(_send_then_eof(writer, payload))
            header = await reader.readline()
            rest = await read_all(reader)
            await sent
            writer.close()
            # The destination saw the listener's upstream socket, not the client.
            client_port = writer.get_extra_info("sockname")[1]
            assert header.startswith(b"peer=127.0.0.1:")
            assert int(header.split(b":")[1]) != client_port
            assert rest[: len(payload)] == payload
            assert rest[len(payload) :] == b"<after-eof>"
            assert listener.counters.passthrough == 1
            assert listener.counters.intercepted == 0
            total = len(header) + len(payload) * 2 + len(b"<after-eof>")
            assert listener.counters.passthrough_bytes == total
            await _until(lambda: listener.counters.passthrough_active == 0)
        finally:
            listener.close()
            await listener.wait_closed()
            echo.close()

    run(kind, scenario())


async def _send_then_eof(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(payload)
    await writer.drain()
    writer.write_eof()


async def _until(cond: Callable[[], bool]) -> None:
    # Yields to the loop until the condition holds (bounded by the test's wait_for).
    while not cond():
        await asyncio.sleep(0)


@pytest.mark.parametrize("kind", LOOPS)
def test_passthrough_to_a_closed_port_resets_the_client(kind: str) -> None:
    async def scenario() -> None:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()
        dest = Dest()
        dest.default = closed
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {}, asyncio.Protocol, original_destination_fn=dest
        )
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            with pytest.raises(ConnectionResetError):
                await read_all(reader)
            writer.close()
            assert listener.counters.errors == 1
            assert listener.counters.passthrough == 1
        finally:
            listener.close()
            await listener.wait_closed()

    run(kind, scenario())


@pytest.mark.parametrize("kind", LOOPS)
def test_passthrough_connect_timeout_resets_the_client(kind: str) -> None:
    async def scenario() -> None:
        # A listener whose accept queue is full drops further SYNs, so connect hangs.
        full = socket.socket()
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        fillers = []
        for _ in range(2):
            f = socket.socket()
            f.setblocking(False)
            f.connect_ex(full.getsockname())
            fillers.append(f)
        dest = Dest()
        dest.default = full.getsockname()[:2]
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {}, asyncio.Protocol, original_destination_fn=dest,
            connect_timeout_s=0.3,
        )  # fmt: skip
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            with pytest.raises(ConnectionResetError):
                await read_all(reader)
            writer.close()
            assert listener.counters.errors == 1
        finally:
            listener.close()
            await listener.wait_closed()
            for f in fillers:
                f.close()
            full.close()

    run(kind, scenario())


@pytest.mark.parametrize("kind", LOOPS)
def test_destination_reset_aborts_the_client(kind: str) -> None:
    async def scenario() -> None:
        async def reset_after_hello(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readexactly(5)
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()

        srv, addr = await start_tcp(reset_after_hello)
        dest = Dest()
        dest.default = addr
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {}, asyncio.Protocol, original_destination_fn=dest
        )
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            writer.write(b"hello")
            with pytest.raises(ConnectionResetError):
                await read_all(reader)
            writer.close()
            await _until(lambda: listener.counters.passthrough_active == 0)
        finally:
            listener.close()
            await listener.wait_closed()
            srv.close()

    run(kind, scenario())


class FakeTransport:
    def __init__(self) -> None:
        self.reading = True
        self.written = bytearray()
        self.eof_written = False
        self.closed = False

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    abort = close


def test_pipe_backpressure_and_half_close_logic() -> None:
    async def scenario() -> None:
        from meshd.transparent import TransparentCounters

        pipe = Pipe(TransparentCounters(), asyncio.get_running_loop())
        client, upstream = FakeTransport(), FakeTransport()
        pipe.client.connection_made(client)  # type: ignore[arg-type]
        pipe.upstream.connection_made(upstream)  # type: ignore[arg-type]
        assert not client.reading and not upstream.reading  # nothing read before start()
        pipe.start()
        assert client.reading and upstream.reading
        # The upstream's send buffer fills: stop reading from the client that fills it.
        pipe.upstream.pause_writing()
        assert not client.reading and upstream.reading
        pipe.upstream.resume_writing()
        assert client.reading
        pipe.client.data_received(b"abc")
        assert bytes(upstream.written) == b"abc"
        assert pipe.client.eof_received() is True  # keep the other direction open
        assert upstream.eof_written and not upstream.closed and not client.closed
        pipe.upstream.data_received(b"reply")
        assert bytes(client.written) == b"reply"
        pipe.upstream.eof_received()
        assert client.eof_written and client.closed and upstream.closed
        assert pipe.counters.passthrough_bytes == 8

    run("asyncio", scenario())


# ---------------------------------------------------------------- not redirected, loops


@pytest.mark.parametrize("kind", LOOPS)
def test_direct_connections_are_closed_not_served(kind: str) -> None:
    async def scenario() -> None:
        dest = Dest()  # no record -> NotRedirectedError
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {}, asyncio.Protocol, original_destination_fn=dest
        )
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            assert await read_all(reader) == b""
            writer.close()
            # Tracked but not NATed: the kernel reports the listener's own address.
            dest.default = ("127.0.0.1", listener.port)
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            assert await read_all(reader) == b""
            writer.close()
            assert listener.counters.rejected == 2
            assert listener.counters.passthrough == 0
        finally:
            listener.close()
            await listener.wait_closed()

    run(kind, scenario())


@pytest.mark.parametrize("kind", LOOPS)
def test_own_passthrough_redirected_back_is_cut_not_multiplied(kind: str) -> None:
    async def scenario() -> None:
        dest = Dest()
        holder: list[TransparentListener] = []

        # Emulates iptables without the proxy UID excluded: the listener's passthrough to
        # the destination lands back on the listener, peer address intact.
        async def redirect_back(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            sock = w.get_extra_info("socket")
            holder[0].accept_socket(socket.socket(fileno=os.dup(sock.fileno())))
            w.transport.abort()

        emulator, target = await start_tcp(redirect_back)
        dest.default = target
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {}, asyncio.Protocol, original_destination_fn=dest
        )
        holder.append(listener)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
                data = await read_all(reader)
                if data == b"":
                    raise ConnectionResetError
            writer.close()
            assert listener.counters.loops == 1
            assert listener.counters.passthrough == 1  # the client's; the copy was cut
        finally:
            listener.close()
            await listener.wait_closed()
            emulator.close()

    run(kind, scenario())


@pytest.mark.parametrize("kind", LOOPS)
def test_close_aborts_passthrough_and_stops_accepting(kind: str) -> None:
    async def scenario() -> None:
        hold = asyncio.Event()

        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await hold.wait()
            w.close()

        srv, addr = await start_tcp(silent)
        dest = Dest()
        dest.default = addr
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {}, asyncio.Protocol, original_destination_fn=dest
        )
        port = listener.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await _until(lambda: listener.counters.passthrough_active == 1)
        listener.close()
        await listener.wait_closed()
        assert await read_all(reader) == b""
        writer.close()
        assert listener.counters.passthrough_active == 0
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        hold.set()
        srv.close()

    run(kind, scenario())


def test_many_concurrent_passthroughs_keep_their_bytes_apart() -> None:
    async def scenario() -> None:
        async def digest(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(hashlib.sha256(await r.read(-1)).digest())
            await w.drain()
            w.close()

        srv, addr = await start_tcp(digest)
        dest = Dest()
        dest.default = addr
        listener = await start_transparent_listener(
            "127.0.0.1", 0, {}, asyncio.Protocol, original_destination_fn=dest
        )

        async def one(i: int) -> None:
            payload = os.urandom(1000 + i * 997)
            reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
            await _send_then_eof(writer, payload)
            assert await read_all(reader) == hashlib.sha256(payload).digest()
            writer.close()

        try:
            await asyncio.gather(*(one(i) for i in range(40)))
            assert listener.counters.passthrough == 40
            assert listener.counters.errors == 0
        finally:
            listener.close()
            await listener.wait_closed()
            srv.close()

    run("uvloop", scenario())
