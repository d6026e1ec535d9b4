"""The publish stream without gRPC: an agent's publish messages (the same serialized
DeltaDiscoveryResponse, answered by the same DeltaDiscoveryRequest ACK or NACK) as
length-prefixed frames over TCP, with TLS or mTLS as the control plane's gRPC port has it.

Why: grpc.aio reads one stream message in ~115 us of Python, so one agent per engine pod
(one update a message) cost the control plane ~150-190 us an update, against a budget of
50; over frames the same publish costs ~30 us plaintext, ~45-55 with TLS, `publish()`
itself included (loadtest/xds_ingest_bench.py --transports). The control plane advertises
the port in the gRPC publish stream's initial metadata (ADVERTISE_KEY); an agent that
sees it moves its link there (meshd/agent_link.py), so nothing is configured twice.

Wire: the client opens with PREAMBLE; then, each way, frames of a 4-byte big-endian
length and that many bytes: client to server a serialized DeltaDiscoveryResponse, server
to client the serialized DeltaDiscoveryRequest that answers it, one for one, in order. A
preamble that does not match, a frame over the server's limit or a message that does not
parse ends the connection (gRPC ends the stream for the last two).

The server reads and writes its sockets from the event loop's reader callbacks
(loop.add_reader), TLS through the ssl module's own socket: asyncio's SSL transport cost
~10-20 us a message more, in Python (same bench, same machine, runs interleaved).

The same port carries a sidecar's subscription (delta ADS without gRPC): a client that
opens with SUBSCRIBE_PREAMBLE is answered with it (the server speaks it: gRPC's response
headers), then sends serialized DeltaDiscoveryRequests as frames and is sent serialized
DeltaDiscoveryResponses, each way as the control plane's gRPC stream has them; the
control plane advertises the port on its delta ADS streams as on the publish stream
(xds/client.py's Subscriber moves there; the subscription's own logic is xds/server.py's
_Stream, whichever the transport).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

from envoy.service.discovery.v3 import discovery_pb2 as pb

from xds.resources import ResourceError

__all__ = [
    "ADVERTISE_KEY",
    "PREAMBLE",
    "SUBSCRIBE_PREAMBLE",
    "FrameError",
    "FramePublishServer",
    "FramePublisher",
    "FrameReader",
    "FrameStream",
    "frame",
    "frames_target",
    "publish_message",
    "server_ssl_context",
]

log = logging.getLogger("meshd.xds.publish_frames")

PREAMBLE = b"MESHD-PUBLISH/1\n"
SUBSCRIBE_PREAMBLE = b"MESHD-DELTA-ADS/1\n"  # a subscriber's; the server answers with it
# gRPC initial metadata (publish and delta ADS streams): the frames port.
ADVERTISE_KEY = "meshd-publish-frames-port"
_RECV_BYTES = 256 * 1024
_READ_A_TURN = 4 * 2**20  # bytes of one connection read in one go, at most


class FrameError(Exception):
    """The bytes are not a meshd publish stream (or break its limit); the connection ends."""


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


class FrameReader:
    """Sans-I/O: bytes in as they arrive, whole frames out. A frame's length is checked
    as soon as its header is in; one that is partly in waits in a bytearray (appends,
    not a copy of everything so far per read: a full PrefixDigest is hundreds of KB).
    `preamble`: what the stream must open with, or several it may open with (none a
    prefix of another; `chosen` says which came)."""

    __slots__ = ("_buf", "_fed", "_got", "_max", "_need", "_preambles", "chosen")

    def __init__(self, max_frame_bytes: int, preamble: bytes | tuple[bytes, ...] = b"") -> None:
        self._max = max_frame_bytes
        # Still expected: the candidates, and what of them came so far.
        self._preambles = (preamble,) if isinstance(preamble, bytes) else preamble
        if self._preambles == (b"",):
            self._preambles = ()
        self._got = b""
        self.chosen = b""
        self._fed = False
        self._buf = bytearray()
        self._need = 0  # bytes _buf must hold before anything can come out of it

    @property
    def partial(self) -> bool:
        """Whether part of a frame (or of the preamble) is in, waiting for the rest."""
        return bool(self._buf) or (self._fed and bool(self._preambles))

    def feed(self, data: bytes) -> list[bytes]:
        if self._buf:
            self._buf += data
            if len(self._buf) < self._need:
                return []
            data, self._buf = bytes(self._buf), bytearray()
        if self._preambles:
            self._fed = True
            got = self._got + data[: max(map(len, self._preambles))]
            alive = [p for p in self._preambles if p[: len(got)] == got[: len(p)]]
            if not alive:
                raise FrameError("not a meshd frames stream")
            done = [p for p in alive if len(got) >= len(p)]
            if not done:
                self._got, self._preambles = got, tuple(alive)
                return []
            self.chosen, self._preambles = done[0], ()
            data = data[len(done[0]) - len(self._got) :]
            self._got = b""
        frames: list[bytes] = []
        i, end = 0, len(data)
        while end - i >= 4:
            n = int.from_bytes(data[i : i + 4], "big")
            if n > self._max:
                raise FrameError(f"frame of {n} bytes over the limit of {self._max}")
            if end - i - 4 < n:
                break
            frames.append(data[i + 4 : i + 4 + n])
            i += 4 + n
        if i < end:
            self._buf = bytearray(data[i:])
            left = end - i
            self._need = 4 + int.from_bytes(data[i : i + 4], "big") if left >= 4 else 4
        return frames


def server_ssl_context(
    cert_chain: bytes, private_key: bytes, client_ca: bytes | None
) -> ssl.SSLContext:
    """The gRPC port's TLS as an SSLContext: this certificate; with `client_ca`, clients
    must present a certificate it signed (mTLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    # The ssl module loads a key pair from files only: a private directory, gone at once.
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private_key)
        cert.write_bytes(cert_chain)
        ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.load_verify_locations(cadata=client_ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _peer(sock: socket.socket) -> str:
    """As gRPC names a peer (ipv4:host:port, ipv6:[host]:port)."""
    try:
        addr = sock.getpeername()
    except OSError:
        return "unknown"
    if sock.family == socket.AF_INET6:
        return f"ipv6:[{addr[0]}]:{addr[1]}"
    return f"ipv4:{addr[0]}:{addr[1]}"


# What a message is handed to: its ACK or NACK to send back, or None to end the connection.
Ingest = Callable[[bytes, Callable[[], str]], bytes | None]


class FrameStream(Protocol):
    """A subscriber's connection as the control plane serves it (xds/server.py): each
    request frame handed to it, and told once the connection is gone."""

    def on_frame(self, payload: bytes) -> bool:
        """Handle one request; False ends the connection (it was not one)."""
        ...

    def on_close(self) -> None: ...


class _Connection:
    """One client's connection, driven by the loop's reader (and, while something is
    unsent, writer) callbacks: an agent's publishes, or (SUBSCRIBE_PREAMBLE) a sidecar's
    subscription, whose responses go out through `write`."""

    __slots__ = (
        "_drained",
        "_hs_timer",
        "_peer",
        "_reader",
        "_unsent",
        "fd",
        "loop",
        "server",
        "sock",
        "stream",
    )

    def __init__(self, server: FramePublishServer, sock: socket.socket) -> None:
        self.server = server
        self.loop = server.loop
        self.sock = sock
        self.fd = sock.fileno()
        self._peer = _peer(sock)
        preambles = (PREAMBLE, SUBSCRIBE_PREAMBLE) if server.subscribe else PREAMBLE
        self._reader = FrameReader(server.max_frame_bytes, preambles)
        self._unsent: bytes | memoryview = b""
        self._drained: asyncio.Future[None] | None = None  # a write waiting for _unsent
        self.stream: FrameStream | None = None  # a subscriber's, once its preamble came
        self._hs_timer: asyncio.TimerHandle | None = None
        if isinstance(sock, ssl.SSLSocket):
            self._hs_timer = self.loop.call_later(
                server.handshake_timeout_s, self.close, "TLS handshake timed out"
            )
            self._handshake()
        else:
            self.loop.add_reader(self.fd, self._readable)

    def peer(self) -> str:
        return self._peer

    def _handshake(self) -> None:
        sock = self.sock
        assert isinstance(sock, ssl.SSLSocket)
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self.loop.add_reader(self.fd, self._handshake)
            return
        except ssl.SSLWantWriteError:
            self.loop.add_writer(self.fd, self._handshake)
            return
        except (OSError, ssl.SSLError) as exc:
            self.close(f"TLS handshake failed: {exc}")
            return
        if self._hs_timer is not None:
            self._hs_timer.cancel()
            self._hs_timer = None
        self.loop.add_reader(self.fd, self._readable)

    def _readable(self) -> None:
        """What the socket holds: each whole message ingested and answered (a
        subscriber's: handed to its stream). While a message is partly in, reading goes
        on (up to _READ_A_TURN), so a large one takes one turn of the loop rather than one
        a TLS record; a small one costs one read."""
        sock = self.sock
        tls = sock if isinstance(sock, ssl.SSLSocket) else None
        reader, ingest, peer = self._reader, self.server.ingest, self.peer
        out: list[bytes] = []
        budget = _READ_A_TURN
        while True:
            try:
                data = sock.recv(_RECV_BYTES)
                if tls is not None and data:
                    # TLS gives one record a read; what it decrypted but did not return
                    # makes the socket no longer readable, so take it now.
                    while tls.pending():
                        data += tls.recv(_RECV_BYTES)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                break
            except ssl.SSLWantWriteError:
                self.close("TLS wants to write while reading (renegotiation is off)")
                return
            except (OSError, ssl.SSLError) as exc:
                self.close(str(exc))
                return
            if not data:
                self.close()
                return
            try:
                frames = reader.feed(data)
            except FrameError as exc:
                self.close(str(exc))
                return
            stream = self.stream
            if stream is None and reader.chosen == SUBSCRIBE_PREAMBLE:
                subscribe = self.server.subscribe
                assert subscribe is not None
                stream = self.stream = subscribe(self)
                self._send(SUBSCRIBE_PREAMBLE)  # before its writer's first response
                if self.fd < 0:
                    return
            if stream is not None:
                for payload in frames:
                    if not stream.on_frame(payload):
                        self.close("malformed subscription request")
                        return
            else:
                for payload in frames:
                    reply = ingest(payload, peer)
                    if reply is None:
                        self.close("malformed publish message")
                        return
                    out.append(len(reply).to_bytes(4, "big") + reply)
            budget -= len(data)
            if not reader.partial or budget <= 0 or self.fd < 0:
                break
        if out:
            self._send(out[0] if len(out) == 1 else b"".join(out))

    async def write(self, payload: bytes) -> None:
        """Send one frame to a subscriber, once what was sent before it has gone (a
        client that does not read holds its writer here); ConnectionError once closed."""
        while self._unsent and self.fd >= 0:
            waiter = self._drained = self.loop.create_future()
            await waiter
        if self.fd < 0:
            raise ConnectionError("subscriber connection closed")
        head = len(payload).to_bytes(4, "big")
        if isinstance(self.sock, ssl.SSLSocket):
            self._send(head + payload)  # one buffer: OpenSSL retries a write whole
            return
        # The header and the response in one call, the response not copied (a lockstep
        # batch's is every subscriber's); what the socket did not take is held as a view
        # of it (a copy each would be a response per subscriber joining at once).
        try:
            sent = self.sock.sendmsg((head, payload))
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.close(str(exc))
            return
        if sent < 4:
            self._hold(head[sent:] + payload)
        elif sent - 4 < len(payload):
            self._hold(memoryview(payload)[sent - 4 :])

    def _send(self, data: bytes | memoryview) -> None:
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            sent = 0
        except (OSError, ssl.SSLError) as exc:
            self.close(str(exc))
            return
        if sent < len(data):
            self._hold(data[sent:])

    def _hold(self, unsent: bytes | memoryview) -> None:
        """What the socket did not take: sent when it is writable."""
        self._unsent = unsent
        if self.stream is None:
            # Backpressure: read no more from a client that does not read its answers
            # (a subscriber is read on: its ACKs are what lets more go out).
            self.loop.remove_reader(self.fd)
        self.loop.add_writer(self.fd, self._writable)

    def _writable(self) -> None:
        data, self._unsent = self._unsent, b""
        self.loop.remove_writer(self.fd)
        self._send(data)
        if self._unsent or self.fd < 0:
            return
        if self.stream is None:
            self.loop.add_reader(self.fd, self._readable)
        self._wake_writer()

    def _wake_writer(self) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self, reason: str | None = None) -> None:
        if self.fd < 0:
            return
        if reason is not None:
            kind = "publish" if self.stream is None else "subscriber"
            log.info("%s connection from %s closed: %s", kind, self._peer, reason)
        if self._hs_timer is not None:
            self._hs_timer.cancel()
            self._hs_timer = None
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.fd = -1
        self.sock.close()
        self.server.connections.discard(self)
        self._wake_writer()
        if self.stream is not None:
            self.stream.on_close()


class FramePublishServer:
    """Accepts agents' publish connections on the running event loop and hands each
    message to `ingest` (ControlPlane._ingest_frame); and, with `subscribe`, sidecars'
    subscriptions."""

    def __init__(
        self,
        ingest: Ingest,
        *,
        subscribe: Callable[[_Connection], FrameStream] | None = None,
        max_frame_bytes: int,
        ssl_context: ssl.SSLContext | None = None,
        handshake_timeout_s: float = 10.0,
        keepalive_time_s: float = 30.0,
        keepalive_timeout_s: float = 10.0,
    ) -> None:
        """`keepalive_*`: TCP keepalive on each connection (probes after this long idle,
        the connection dropped after this long unanswered), as gRPC's pings do.
        `subscribe`: serve subscribers too (SUBSCRIBE_PREAMBLE), each connection's
        requests handed to the FrameStream it returns (ControlPlane._subscribe_frames)."""
        self.ingest = ingest
        self.subscribe = subscribe
        self.max_frame_bytes = max_frame_bytes
        self.ssl_context = ssl_context
        self.handshake_timeout_s = handshake_timeout_s
        self.keepalive_time_s = keepalive_time_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.connections: set[_Connection] = set()
        self.loop = asyncio.get_running_loop()
        self._listener: socket.socket | None = None
        self.port = 0

    def start(self, host: str, port: int) -> int:
        """Bind and accept; returns the port (useful with 0)."""
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=1024)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self.loop.add_reader(listener.fileno(), self._accept)
        return self.port

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):  # then let the loop run other work
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the next one may go
                log.warning("publish listener: accept failed: %s", exc)
                return
            try:
                self._setup(sock)
                if self.ssl_context is not None:
                    sock = self.ssl_context.wrap_socket(
                        sock, server_side=True, do_handshake_on_connect=False
                    )
            except OSError as exc:
                log.info("publish connection dropped: %s", exc)
                sock.close()
                continue
            self.connections.add(_Connection(self, sock))

    def _setup(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            interval = max(1, int(self.keepalive_timeout_s / 3))
            sock.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(self.keepalive_time_s))
            )
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)

    def close(self) -> None:
        if self._listener is not None:
            self.loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for conn in list(self.connections):
            conn.close()


def publish_message(
    type_url: str, resources: Mapping[str, bytes], removed: Iterable[str], nonce: int
) -> pb.DeltaDiscoveryResponse:
    """One publish message, as both transports send it."""
    msg = pb.DeltaDiscoveryResponse(type_url=type_url, nonce=str(nonce))
    msg.removed_resources.extend(removed)
    for name, body in resources.items():
        r = msg.resources.add(name=name)
        r.resource.type_url = type_url
        r.resource.value = body
    return msg


def frames_target(target: str, port: int) -> tuple[str, int] | None:
    """The (host, port) of the frames port beside a gRPC target "host:port" or
    "[v6]:port"; None for a target gRPC resolves itself (a scheme: dns:///, unix:...)."""
    if "/" in target:
        return None
    if target.startswith("["):
        host, sep, rest = target[1:].partition("]:")
        return (host, port) if sep and rest.isdigit() else None
    host, sep, rest = target.partition(":")
    if not sep or not host or not rest.isdigit() or host in ("unix", "ipv4", "ipv6", "dns"):
        return None
    return host, port


class FramePublisher:
    """The client side: Publisher's publish() over the frames port (one message at a
    time; each ACKed, or refused with ResourceError)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_frame_bytes: int = 64 * 2**20,
    ) -> None:
        self.host, self.port = host, port
        self._ssl = ssl_context
        self._max = max_frame_bytes
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._nonce = 0
        self.answers = 0  # messages the control plane answered (ACK or NACK)

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(
            self.host,
            self.port,
            ssl=self._ssl,
            server_hostname=self.host if self._ssl is not None else None,
        )
        self._writer.write(PREAMBLE)

    async def publish(
        self, type_url: str, resources: Mapping[str, bytes], removed: Iterable[str] = ()
    ) -> None:
        async with self._lock:
            if self._writer is None:
                await self.connect()
            assert self._reader is not None and self._writer is not None
            self._nonce += 1
            msg = publish_message(type_url, resources, removed, self._nonce)
            self._writer.write(frame(msg.SerializeToString()))
            try:
                n = int.from_bytes(await self._reader.readexactly(4), "big")
                if n > self._max:
                    raise ConnectionError(f"control plane sent a frame of {n} bytes")
                reply = pb.DeltaDiscoveryRequest.FromString(await self._reader.readexactly(n))
            except asyncio.IncompleteReadError:
                await self.close()
                raise ConnectionError("control plane closed the publish connection") from None
            self.answers += 1
            if reply.HasField("error_detail"):
                raise ResourceError(reply.error_detail.message)

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
