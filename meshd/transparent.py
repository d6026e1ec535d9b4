"""The transparent listener: accepts connections redirected by iptables (`meshd iptables`).

It reads each connection's original destination with SO_ORIGINAL_DST; a configured inference
service is handed to the HTTP server, anything else is spliced through to where it was going
as raw TCP, never parsed. Works on the default asyncio loop and on uvloop.

Its parts: meshd/original_dst.py (SO_ORIGINAL_DST, canonical addresses) and
meshd/passthrough.py (the TCP splice).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import socket
import struct
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshd.original_dst import (
    Address,
    NotRedirectedError,
    normalize_address,
    original_destination,
)
from meshd.passthrough import Pipe

log = logging.getLogger(__name__)

# Pause before accepting again when out of file descriptors, so the accept loop does not
# spin while connections that are in flight finish and free theirs.
ACCEPT_BACKOFF_S = 0.1

OriginalDestinationFn = Callable[[socket.socket], Address]


def _nodelay(sock: socket.socket) -> None:
    # Nagle plus the peer's delayed ACK stalls small writes (SSE tokens) by up to 40 ms.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _reset(sock: socket.socket) -> None:
    """Close with RST, so the client sees a refused/reset connection rather than a clean EOF."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@dataclass(slots=True)
class TransparentCounters:
    """Running totals for metrics; a connection is counted once, when it is classified."""

    intercepted: int = 0
    passthrough: int = 0
    passthrough_bytes: int = 0
    passthrough_active: int = 0
    # Connections made straight to the listener's port (not redirected): closed.
    rejected: int = 0
    # Connections that were the listener's own passthrough coming back: iptables is
    # redirecting the proxy's own traffic (its UID/GID is not excluded).
    loops: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class _Route:
    original_destination: Address
    pool: str


class _RouteTag(asyncio.Protocol):
    """Records a connection's route under its transport, then steps aside.

    Registering in connection_made (before the HTTP protocol sees a byte) means a request
    handler can never look its connection up too early; set_protocol then takes this
    object out of the data path.
    """

    __slots__ = ("_inner", "_listener", "_route")

    def __init__(
        self, listener: TransparentListener, inner: asyncio.BaseProtocol, route: _Route
    ) -> None:
        self._listener = listener
        self._inner = inner
        self._route = route

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._listener._routes[transport] = self._route
        transport.set_protocol(self._inner)
        self._inner.connection_made(transport)


class TransparentListener:
    """Accepts redirected connections and routes each by its original destination.

    - original destination in `services` -> handed to `http_protocol_factory` (the HTTP
      server); `pool_for(transport)` then names the pool for that connection.
    - anything else -> passed through untouched as TCP to the original destination.
    - not redirected (a connection made straight to this port) -> closed and counted in
      `counters.rejected`: serving it would mean guessing a destination, and passing it
      through would connect to ourselves.
    - our own passthrough coming back (iptables does not exclude the proxy's UID) -> reset
      and counted in `counters.loops`, so a misconfiguration cannot multiply connections.

    close() stops accepting and aborts passthrough connections in flight; connections
    already handed to the HTTP server belong to it.
    """

    def __init__(
        self,
        sock: socket.socket,
        services: Mapping[Address, str],
        http_protocol_factory: Callable[[], asyncio.BaseProtocol],
        *,
        connect_timeout_s: float = 5.0,
        original_destination_fn: OriginalDestinationFn = original_destination,
    ) -> None:
        if connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be positive, got {connect_timeout_s}")
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._http_factory = http_protocol_factory
        self._connect_timeout_s = connect_timeout_s
        self._original_destination = original_destination_fn
        self._services: dict[Address, str] = {}
        self.set_services(services)
        self._routes: weakref.WeakKeyDictionary[asyncio.BaseTransport, _Route] = (
            weakref.WeakKeyDictionary()
        )
        # Local addresses of our passthrough upstream sockets, recorded as soon as connect()
        # picks them, so a redirected copy of one is recognised when it is accepted.
        self._upstream_names: set[Address] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pipes: set[Pipe] = set()
        self._closing = False
        self.counters = TransparentCounters()
        self._address = normalize_address(sock.getsockname())
        self._accept_task = self._loop.create_task(self._accept_loop())

    # -- lookups for the HTTP side -------------------------------------------------------

    def pool_for(self, transport: asyncio.BaseTransport | None) -> str | None:
        """The pool an intercepted connection was going to; None for any other connection."""
        route = self._routes.get(transport) if transport is not None else None
        return route.pool if route is not None else None

    def original_destination_of(self, transport: asyncio.BaseTransport | None) -> Address | None:
        """The (ip, port) an intercepted connection was going to; None for any other."""
        route = self._routes.get(transport) if transport is not None else None
        return route.original_destination if route is not None else None

    def set_services(self, services: Mapping[Address, str]) -> None:
        """Replace the inference services (for config reload); applies to new connections."""
        table: dict[Address, str] = {}
        for (ip, port), pool in services.items():
            try:
                key = normalize_address((ipaddress.ip_address(ip).compressed, port))
            except ValueError:
                raise ValueError(
                    f"transparent service address {ip!r} must be an IP address: the original "
                    "destination the kernel reports is never a name"
                ) from None
            if not 1 <= int(port) <= 65535:
                raise ValueError(f"transparent service {ip}:{port}: port out of range 1..65535")
            table[key] = pool
        self._services = table

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def port(self) -> int:
        return self._address[1]

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._accept_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        for pipe in list(self._pipes):
            pipe.abort()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self._accept_task
        pending = [*self._tasks, *(pipe.done for pipe in self._pipes)]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    # -- accepting -----------------------------------------------------------------------

    async def _accept_loop(self) -> None:
        try:
            await self._accept_forever()
        finally:
            # Closed here, not in close(): the fd must leave the event loop's reader set
            # (sock_accept's cancellation does that) before it is closed.
            self._sock.close()

    async def _accept_forever(self) -> None:
        while True:
            try:
                conn, _ = await self._loop.sock_accept(self._sock)
            except OSError as exc:
                if self._closing:
                    return
                self.counters.errors += 1
                log.warning("transparent listener %s: accept failed: %s", self._address, exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    await asyncio.sleep(ACCEPT_BACKOFF_S)
                continue
            self.accept_socket(conn)

    def accept_socket(self, conn: socket.socket) -> None:
        """Route a connection accepted elsewhere (an inherited or socket-activated listener)
        exactly as if this listener had accepted it; takes ownership of `conn`."""
        try:
            self._dispatch(conn)
        except Exception:
            self.counters.errors += 1
            log.exception("transparent listener %s: dispatch failed", self._address)
            conn.close()

    def _dispatch(self, conn: socket.socket) -> None:
        if self._closing:
            conn.close()
            return
        conn.setblocking(False)
        _nodelay(conn)
        try:
            dest = normalize_address(self._original_destination(conn))
            local = normalize_address(conn.getsockname())
            peer = normalize_address(conn.getpeername())
        except NotRedirectedError:
            self.counters.rejected += 1
            conn.close()
            return
        except OSError as exc:
            # The client may already have gone (getpeername -> ENOTCONN).
            self.counters.errors += 1
            log.debug("transparent listener: dropping connection: %s", exc)
            conn.close()
            return
        if peer in self._upstream_names:
            self.counters.loops += 1
            self.counters.errors += 1
            log.error(
                "transparent listener: our own passthrough to %s:%d was redirected back to "
                "us; exclude the proxy's UID/GID in iptables (meshd iptables --proxy-uid)",
                *dest,
            )
            _reset(conn)
            return
        if dest == local:
            self.counters.rejected += 1
            conn.close()
            return
        pool = self._services.get(dest)
        if pool is not None:
            self.counters.intercepted += 1
            self._spawn(self._intercept(conn, _Route(dest, pool)))
        else:
            self.counters.passthrough += 1
            self._spawn(self._passthrough(conn, dest))

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _intercept(self, conn: socket.socket, route: _Route) -> None:
        try:
            await self._loop.connect_accepted_socket(
                lambda: _RouteTag(self, self._http_factory(), route), conn
            )
        except asyncio.CancelledError:
            conn.close()
            raise
        except Exception as exc:
            self.counters.errors += 1
            log.warning("transparent listener: handing %s to HTTP failed: %s", route, exc)
            conn.close()

    # -- passthrough ---------------------------------------------------------------------

    async def _passthrough(self, conn: socket.socket, dest: Address) -> None:
        family = socket.AF_INET6 if ":" in dest[0] else socket.AF_INET
        try:
            upstream = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            self.counters.errors += 1
            log.warning("passthrough to %s:%d: no socket: %s", *dest, exc)
            _reset(conn)
            return
        names: list[Address] = []
        try:
            upstream.setblocking(False)
            _nodelay(upstream)
            await self._connect(upstream, dest, names)
        except asyncio.CancelledError:
            self._forget(names)
            upstream.close()
            _reset(conn)
            raise
        except OSError as exc:
            self._forget(names)
            self.counters.errors += 1
            log.info("passthrough to %s:%d failed: %s", *dest, str(exc) or "connect timed out")
            upstream.close()
            _reset(conn)
            return
        await self._splice(conn, upstream, names)

    def _forget(self, names: list[Address]) -> None:
        for name in names:
            self._upstream_names.discard(name)

    async def _connect(self, sock: socket.socket, dest: Address, names: list[Address]) -> None:
        """Non-blocking connect that records our local address as soon as connect() picks it.

        A redirected copy of this connection (a loop) is accepted only after the handshake,
        so the address is always known by then; it stays recorded for the connection's
        life (appended to `names`; the caller forgets it).
        """
        err = sock.connect_ex(dest)
        if err in (0, errno.EINPROGRESS, errno.EAGAIN):
            with contextlib.suppress(OSError):
                name = normalize_address(sock.getsockname())
                self._upstream_names.add(name)
                names.append(name)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            raise OSError(err, f"connect to {dest[0]}:{dest[1]}: {os.strerror(err)}")
        if err == 0:
            return
        writable: asyncio.Future[None] = self._loop.create_future()

        def on_writable() -> None:
            if not writable.done():
                writable.set_result(None)

        fd = sock.fileno()
        self._loop.add_writer(fd, on_writable)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await writable
        finally:
            self._loop.remove_writer(fd)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err != 0:
            raise OSError(err, f"connect to {dest[0]}:{dest[1]}: {os.strerror(err)}")

    async def _splice(
        self, conn: socket.socket, upstream: socket.socket, names: list[Address]
    ) -> None:
        pipe = Pipe(self.counters, self._loop)
        try:
            await self._loop.connect_accepted_socket(lambda: pipe.client, conn)
            await self._loop.create_connection(lambda: pipe.upstream, sock=upstream)
        except BaseException as exc:
            self._forget(names)
            if not isinstance(exc, asyncio.CancelledError):
                self.counters.errors += 1
                log.warning("passthrough setup failed: %s", exc)
            pipe.abort()
            if pipe.client.transport is None:
                _reset(conn)
            if pipe.upstream.transport is None:
                upstream.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._pipes.add(pipe)
        self.counters.passthrough_active += 1
        pipe.done.add_done_callback(lambda _: self._pipe_finished(pipe, names))
        if self._closing:
            pipe.abort()
        else:
            pipe.start()

    def _pipe_finished(self, pipe: Pipe, names: list[Address]) -> None:
        self._forget(names)
        self._pipes.discard(pipe)
        self.counters.passthrough_active -= 1


async def start_transparent_listener(
    host: str,
    port: int,
    services: Mapping[Address, str],
    http_protocol_factory: Callable[[], asyncio.BaseProtocol],
    *,
    connect_timeout_s: float = 5.0,
    backlog: int = 1024,
    original_destination_fn: OriginalDestinationFn = original_destination,
) -> TransparentListener:
    """Bind `host:port` (port 0 picks one) and start accepting redirected connections.

    `services` maps an inference service's (ip, port) to its pool name. iptables REDIRECT
    from OUTPUT rewrites the destination to 127.0.0.1 (::1 for IPv6), so bind 0.0.0.0,
    127.0.0.1 or '::'. `original_destination_fn` is for tests without iptables.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # Dual stack: IPv4 redirects arrive as ::ffff:127.0.0.1.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
        return TransparentListener(
            sock,
            services,
            http_protocol_factory,
            connect_timeout_s=connect_timeout_s,
            original_destination_fn=original_destination_fn,
        )
    except BaseException:
        sock.close()
        raise
