"""The subscriber side of the control channel: a delta-ADS client that keeps the last known
state of its subscriptions through control-plane outages (static stability), and the
publisher an engine agent writes its resources with.

The subscriber ACKs a response it applied and NACKs one in which any resource fails to
decode (the whole response is then ignored, as Envoy does), reconnects with jittered
exponential backoff and resumes with `initial_resource_versions`, so the control plane
sends only what changed while it was away. Given several control-plane replicas it uses
one at a time and moves to the next when a session ends or fails; resource versions are
content hashes (xds/cache.py), so resuming on another replica also sends only what differs.

A session starts on gRPC; a control plane that advertises its frames port on the stream
(xds/publish_frames.py: the same requests and responses as length-prefixed frames over
TCP, with the same TLS) is followed there instead, the move made before any request goes
over gRPC (the stream's headers say where the port is): a sidecar following 10,000
updates/s in ~205-update responses spent 3.2-4.3 us an update outside applying them over
gRPC (its read and ACK, its threads, the event loop, idle work), 2.1-2.6 over frames
(loadtest/xds_apply_bench.py (b) --transports grpc,frames). A frames connection that
fails before it answered is followed by a gRPC session at once; where gRPC answers and
names the same port twice so, the port is held off for FRAMES_RETRY_S (blocked, not
routed by a Service, refusing this client's certificate), else it is tried again (the
control plane was away). With TLS it needs `ssl_context` as well as `credentials`, and
without it stays on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2 as pb
from grpc import aio

from xds.delta_response import Entry, Interest, read_response
from xds.publish_frames import (
    ADVERTISE_KEY,
    SUBSCRIBE_PREAMBLE,
    FrameError,
    frames_target,
    publish_message,
)
from xds.resources import DECODERS, ResourceError
from xds.server import PUBLISH_METHOD, ServerLimits
from xds.wire import len_field

__all__ = ["Backoff", "Entry", "Publisher", "Subscriber", "SubscriberStats", "Update"]

log = logging.getLogger("meshd.xds.client")

DELTA_METHOD = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
WILDCARD = "*"
_INVALID_ARGUMENT = 3
MAX_RECEIVE_BYTES = ServerLimits().max_message_bytes
# After the frames port failed before it answered, sessions stay on gRPC this long.
FRAMES_RETRY_S = 300.0
# A frames connection's buffered bytes before its reading pauses (a response of more is
# still read whole: the reader resumes it as it waits).
_FRAMES_BUFFER = 2**20
_CLOSE_WAIT_S = 1.0  # a frames connection's close, at most, before it is dropped


def tls_channel_credentials(
    ca_file: str | None, cert_file: str | None, key_file: str | None, *, prefix: str = ""
) -> grpc.ChannelCredentials:
    """grpc SSL channel credentials from PEM files (a CA, and a client certificate with its
    key for mTLS). A file that cannot be read is a ValueError naming `prefix + ca_file`
    (or cert_file, key_file), so callers can say which setting pointed at it."""

    def read(key: str, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{prefix}{key}: cannot read {path}: {exc}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read("ca_file", ca_file),
        private_key=read("key_file", key_file),
        certificate_chain=read("cert_file", cert_file),
    )


def tls_client_context(
    ca_file: str | None, cert_file: str | None, key_file: str | None, *, prefix: str = ""
) -> ssl.SSLContext:
    """The same TLS as tls_channel_credentials for a plain socket (the frames publish
    port): the server's certificate checked against `ca_file` (None: the system's roots)
    and its name, this client's certificate presented (mTLS). ValueError as there."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except OSError as exc:
        raise ValueError(f"{prefix}ca_file: cannot read {ca_file}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except OSError as exc:
            raise ValueError(f"{prefix}cert_file: cannot read {cert_file}: {exc}") from None
    return ctx


@dataclass(frozen=True, slots=True)
class Backoff:
    """Reconnect delays: the ceiling doubles per failed attempt up to `max_s`; the delay is
    drawn uniformly from the upper half of it ("equal jitter"), so a fleet of sidecars that
    lost the control plane together does not come back together."""

    base_s: float = 0.25
    max_s: float = 15.0
    multiplier: float = 2.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        ceiling = min(self.max_s, self.base_s * self.multiplier ** min(attempt, 64))
        return ceiling / 2 + rng.uniform(0.0, ceiling / 2)


@dataclass(frozen=True, slots=True)
class Update:
    """What one applied response changed."""

    type_url: str
    changed: Mapping[str, Entry]
    removed: frozenset[str]


@dataclass(slots=True)
class SubscriberStats:
    responses: int = 0
    acks: int = 0
    nacks: int = 0
    last_nack: str = ""
    connects: int = 0
    disconnects: int = 0
    failovers: int = 0  # moves to another replica
    connect_failures: int = 0  # sessions that never connected
    # Thread CPU seconds spent applying responses (read, decode, the on_update callback:
    # the sidecar's routers), timed per response; what the process spends besides is
    # gRPC's read and write, the event loop and whatever else the process runs.
    apply_cpu_s: float = 0.0
    read_cpu_s: float = 0.0  # of which reading them (the parse, each resource decoded)
    frames_failures: int = 0  # frames connections that failed before they answered


class Subscriber:
    """Subscribes (delta ADS) to resource types and keeps their latest decoded state.

    `target`: host:port of the control plane, or a sequence of replicas (tried in turn).
    `subscriptions` maps a type URL to the names wanted, or None for all (wildcard); a type
    with no names is asked for only once `subscribe` gives it some. Start with `start()`;
    `close()` stops it. The state survives disconnections. `frames`: follow over the
    frames port a control plane advertises (with `credentials`, only given `ssl_context`,
    the same TLS for a plain socket: tls_client_context); False: gRPC only.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        subscriptions: Mapping[str, Iterable[str] | None],
        *,
        node_id: str = "meshd",
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Iterable[tuple[str, Any]] = (),
        backoff: Backoff | None = None,
        connect_timeout_s: float = 5.0,
        decoders: Mapping[str, Callable[[bytes], Any]] = DECODERS,
        on_update: Callable[[Update], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        ack_pace_s: Mapping[str, float] | None = None,
        frames: bool = True,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.targets: tuple[str, ...] = (target,) if isinstance(target, str) else tuple(target)
        if not self.targets:
            raise ValueError("at least one control-plane address")
        self._target_index = 0
        self.connect_timeout_s = connect_timeout_s
        self.node_id = node_id
        self._credentials = credentials
        self._channel_options = [
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            # The server's limit (ServerLimits.max_message_bytes), not gRPC's 4 MiB: a
            # response holds at least one resource, and one may be up to
            # MAX_RESOURCE_BYTES (a digest of 1M blocks is 8 MiB).
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            *channel_options,
        ]
        self.backoff = backoff or Backoff()
        self._decoders = decoders
        self._on_update = on_update
        self._clock = clock
        self._rng = rng or random.Random()
        self._interest = {
            t: Interest(wildcard=names is None, names=set(names or ()))
            for t, names in subscriptions.items()
        }
        self._state: dict[str, dict[str, Entry]] = {t: {} for t in self._interest}
        # Per type: at least this long between ACKs (so between responses: the control
        # plane sends the next once this one is ACKed, with what changed meanwhile).
        self._ack_pace = {t: s for t, s in (ack_pace_s or {}).items() if s > 0}
        self._acked_at: dict[str, float] = {}  # type -> loop time of its last ACK
        self._response_type = ""  # the type of the response _apply read last
        self.stats = SubscriberStats()
        self._connected = False
        self._last_update_at: float | None = None
        self._disconnected_at: float | None = None
        self._call: aio.StreamStreamCall | _FramesCall | None = None
        # The frames port: only where its TLS can be the channel's.
        self._frames = frames and (credentials is None or ssl_context is not None)
        self._ssl = ssl_context if credentials is not None else None
        self._frames_ports: dict[str, int] = {}  # target -> the port it advertised
        self._frames_hold: dict[tuple[str, int], float] = {}  # -> loop time to try again
        self._frames_failed: tuple[str, int] | None = None  # the last that did not answer
        # Frames ports that failed with gRPC answering between: the second time is held.
        self._frames_strikes: dict[tuple[str, int], int] = {}
        self._move = False  # the gRPC session ended to go on over frames
        self.transport = "grpc"  # what the session in use (or the last) goes over
        self._write_lock = asyncio.Lock()
        self._events = asyncio.Condition()
        self._waiters = 0  # wait_until calls waiting: a response notifies only then
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- state ----------------------------------------------------------------------------

    @property
    def target(self) -> str:
        """The replica in use (or tried next)."""
        return self.targets[self._target_index]

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def last_update_age_s(self) -> float | None:
        """Seconds since the last response from the control plane (None: never had one)."""
        return None if self._last_update_at is None else self._clock() - self._last_update_at

    @property
    def stale_for_s(self) -> float:
        """How long the state has gone unconfirmed: 0 while connected, else seconds since
        the connection was lost (or since start when it never connected)."""
        if self._connected or self._disconnected_at is None:
            return 0.0
        return self._clock() - self._disconnected_at

    def is_stale(self, max_age_s: float) -> bool:
        return self.stale_for_s > max_age_s

    def entries(self, type_url: str) -> Mapping[str, Entry]:
        return MappingProxyType(self._state.setdefault(type_url, {}))

    def get(self, type_url: str, name: str) -> Any | None:
        e = self._state.get(type_url, {}).get(name)
        return None if e is None else e.value

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; re-checked after every response and every
        connect or disconnect."""
        self._waiters += 1
        try:
            async with self._events:
                await self._events.wait_for(predicate)
        finally:
            self._waiters -= 1

    async def _notify(self) -> None:
        async with self._events:
            self._events.notify_all()

    # -- subscriptions --------------------------------------------------------------------

    async def subscribe(self, type_url: str, names: Iterable[str]) -> None:
        names = set(names)
        interest = self._interest.get(type_url)
        if interest is None:
            interest = self._interest[type_url] = Interest(wildcard=False)
            self._state.setdefault(type_url, {})
        asked = interest.wildcard or bool(interest.names)
        new = names - interest.names
        interest.names |= names
        if not new:
            return
        if not asked:
            # The type's first request on this stream: with the node and whatever we hold.
            req = self._initial_request(type_url)
            if req is not None:
                await self._send(req)
            return
        await self._send(
            pb.DeltaDiscoveryRequest(type_url=type_url, resource_names_subscribe=sorted(new))
        )

    async def unsubscribe(self, type_url: str, names: Iterable[str]) -> None:
        names = set(names)
        interest = self._interest.get(type_url)
        if interest is None:
            return
        interest.names -= names
        table = self._state.get(type_url, {})
        if not interest.wildcard:
            for n in names:
                table.pop(n, None)
        await self._send(
            pb.DeltaDiscoveryRequest(type_url=type_url, resource_names_unsubscribe=sorted(names))
        )

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._disconnected_at = self._clock()
            self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _channel(self) -> aio.Channel:
        # A fresh channel per session, so our backoff (not grpc's own, whose default
        # ceiling is two minutes) decides when to try again.
        options = [*self._channel_options, ("grpc.enable_retries", 0)]
        if self._credentials is not None:
            return aio.secure_channel(self.target, self._credentials, options=options)
        return aio.insecure_channel(self.target, options=options)

    async def _run(self) -> None:
        attempt = 0
        while not self._closed:
            got_response = connected = False
            self._move = False
            # Right after the frames port failed: gRPC, to tell which failed.
            where = self._frames_where() if self._frames_failed is None else None
            try:
                if where is not None:
                    got_response = await self._frames_session(*where)
                else:
                    got_response = await self._session()
            except asyncio.CancelledError:
                raise
            except aio.AioRpcError as exc:
                log.info("control plane %s: %s %s", self.target, exc.code().name, exc.details())
            except TimeoutError:
                log.info(
                    "control plane %s: no connection in %.1f s", self.target, self.connect_timeout_s
                )
            except (OSError, FrameError, asyncio.IncompleteReadError) as exc:
                log.info("control plane %s: frames port: %s", self.target, exc)
            except Exception:
                log.exception("subscriber session to %s failed", self.target)
            finally:
                self._call = None
                connected = self._connected
                if self._connected:
                    self._connected = False
                    self._disconnected_at = self._clock()
                    self.stats.disconnects += 1
                    log.warning(
                        "lost the control plane %s; keeping the last known state", self.target
                    )
                with contextlib.suppress(RuntimeError):
                    await self._notify()
            if where is None:
                self._frames_failed = None  # judged by gRPC's headers, or no one answered
            if where is not None and not connected:
                # The frames port failed before it answered: gRPC at once. If gRPC answers
                # and names this port again, the port is what fails (held off then, for
                # FRAMES_RETRY_S); if not, the control plane is away, and the port will be
                # tried again once it is back.
                self.stats.frames_failures += 1
                self._frames_failed = where
                continue
            if self._move:
                continue  # on to the frames port it advertised, now
            if not got_response:
                self.stats.connect_failures += 1
            attempt = 0 if got_response else attempt + 1
            n = len(self.targets)
            if n > 1:
                self._target_index = (self._target_index + 1) % n
                self.stats.failovers += 1
                log.info("trying control-plane replica %s", self.target)
            # One backoff step per round of replicas: a dead replica costs the next one only
            # the short first delay.
            await asyncio.sleep(self.backoff.delay(attempt // n, self._rng))

    def _initial_request(self, type_url: str) -> pb.DeltaDiscoveryRequest | None:
        """The type's first request on a stream (None while it wants nothing: an empty
        first request would mean the wildcard)."""
        interest = self._interest[type_url]
        if not interest.wildcard and not interest.names:
            return None
        req = pb.DeltaDiscoveryRequest(type_url=type_url)
        req.node.CopyFrom(base_pb2.Node(id=self.node_id))
        subscribe = sorted(interest.names) + ([WILDCARD] if interest.wildcard else [])
        req.resource_names_subscribe.extend(subscribe)
        for name, entry in self._state.get(type_url, {}).items():
            req.initial_resource_versions[name] = entry.version
        return req

    async def _send(self, req: pb.DeltaDiscoveryRequest) -> None:
        call = self._call
        if call is None:
            return  # the next session's initial requests carry the subscription
        async with self._write_lock:
            with contextlib.suppress(aio.AioRpcError, asyncio.InvalidStateError, OSError):
                await call.write(req)

    def _hold_failed_frames(self) -> None:
        """gRPC answered: a frames port that just failed, if it is the one advertised
        now, is tried once more (it may have failed as the control plane was coming back);
        failing again so, it is held off for FRAMES_RETRY_S (blocked, not routed,
        refusing our TLS)."""
        failed, self._frames_failed = self._frames_failed, None
        if failed is None:
            return
        if failed != self._frames_where():
            self._frames_strikes.pop(failed, None)  # another port now (a restart's)
            return
        strikes = self._frames_strikes[failed] = self._frames_strikes.get(failed, 0) + 1
        if strikes >= 2:
            del self._frames_strikes[failed]
            self._frames_hold[failed] = asyncio.get_running_loop().time() + FRAMES_RETRY_S
            log.info(
                "control plane %s: frames port %d not answering; on gRPC for %.0f s",
                self.target,
                failed[1],
                FRAMES_RETRY_S,
            )

    def _frames_where(self) -> tuple[str, int] | None:
        """The frames port to follow the current target on, if any (advertised, allowed,
        not failed lately)."""
        if not self._frames:
            return None
        port = self._frames_ports.get(self.target)
        if port is None:
            return None
        where = frames_target(self.target, port)
        if where is None:
            return None
        if asyncio.get_running_loop().time() < self._frames_hold.get(where, -math.inf):
            return None
        return where

    async def _session(self) -> bool:
        """One stream, until it ends; returns whether it connected."""
        got_response = False
        async with self._channel() as channel:
            # Responses come as bytes (read_response parses them); requests go as
            # bytes (an ACK, pre-framed) or as messages.
            method = channel.stream_stream(
                DELTA_METHOD, request_serializer=_request_bytes, response_deserializer=None
            )
            call = method()
            self._call = call

            async def open_stream() -> bool:
                """Whether to go on over the frames port instead (decided before any
                request: the control plane would answer it here)."""
                if self._frames:
                    # meshd's control plane sends its headers as a stream opens: they say
                    # where its frames port is.
                    port = _advertised_port(await call.initial_metadata())
                    if port is not None:
                        self._frames_ports[self.target] = port
                        self._hold_failed_frames()
                        if self._frames_where() is not None:
                            return True
                async with self._write_lock:
                    for t in list(self._interest):
                        req = self._initial_request(t)
                        if req is not None:
                            await call.write(req)
                # The control plane sends its headers as a stream opens (not with its first
                # response, which may never come for an empty subscription).
                await call.wait_for_connection()
                return False

            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for drops a cancel that lands
                # as the inner await completes, and close() would then wait on a live stream.
                async with asyncio.timeout(self.connect_timeout_s):
                    move = await open_stream()
            except TimeoutError:
                call.cancel()
                raise
            if move:
                self._move = True
                call.cancel()
                return False
            self.transport = "grpc"
            got_response = True
            self._connected = True
            self.stats.connects += 1
            log.info("connected to the control plane %s", self.target)
            await self._notify()
            while True:
                raw = await call.read()
                if raw is aio.EOF:
                    return got_response
                t0 = time.thread_time()
                reply = self._apply(raw)
                self.stats.apply_cpu_s += time.thread_time() - t0
                if self._ack_pace:
                    await self._pace(self._response_type)
                async with self._write_lock:
                    await call.write(reply)
                if self._waiters:
                    await self._notify()

    async def _frames_session(self, host: str, port: int) -> bool:
        """One subscription over the frames port, until it ends; returns whether the
        control plane answered (its preamble back: it serves subscriptions there)."""
        ctx = self._ssl
        async with asyncio.timeout(self.connect_timeout_s):
            reader, writer = await asyncio.open_connection(
                host,
                port,
                ssl=ctx,
                server_hostname=host if ctx is not None else None,
                limit=_FRAMES_BUFFER,
            )
        try:
            _keepalive(writer.get_extra_info("socket"))
            call = self._call = _FramesCall(writer)
            async with asyncio.timeout(self.connect_timeout_s):
                async with self._write_lock:
                    first = [SUBSCRIBE_PREAMBLE]
                    for t in list(self._interest):
                        req = self._initial_request(t)
                        if req is not None:
                            first.append(_frame(req.SerializeToString()))
                    writer.write(b"".join(first))
                hello = await reader.readexactly(len(SUBSCRIBE_PREAMBLE))
                if hello != SUBSCRIBE_PREAMBLE:
                    raise FrameError("not a meshd control plane's frames port")
            self.transport = "frames"
            self._frames_strikes.pop((host, port), None)
            self._connected = True
            self.stats.connects += 1
            log.info("connected to the control plane %s (frames port %d)", self.target, port)
            await self._notify()
            read = reader.readexactly
            while True:
                try:
                    head = await read(4)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        raise
                    return True  # closed between responses: gRPC's end of stream
                n = int.from_bytes(head, "big")
                if n > MAX_RECEIVE_BYTES:
                    raise FrameError(f"a response of {n} bytes, over {MAX_RECEIVE_BYTES}")
                raw = await read(n)
                t0 = time.thread_time()
                reply = self._apply(raw)
                self.stats.apply_cpu_s += time.thread_time() - t0
                if self._ack_pace:
                    await self._pace(self._response_type)
                await call.send(reply)
                if self._waiters:
                    await self._notify()
        finally:
            writer.close()
            # Bounded: a TLS close waits for the peer's close_notify (asyncio's default
            # patience is 30 s), and a control plane gone may never send it.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    await writer.wait_closed()
            writer.transport.abort()

    async def _pace(self, type_url: str) -> None:
        """Hold the ACK of a paced type until its pace has passed since the last one."""
        pace = self._ack_pace.get(type_url)
        if pace is None:
            return
        loop = asyncio.get_running_loop()
        wait = self._acked_at.get(type_url, -math.inf) + pace - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        self._acked_at[type_url] = loop.time()

    def _apply(self, raw: bytes) -> bytes:
        """Decode and apply one serialized response (all or nothing); the ACK or NACK to
        send, serialized. A message protobuf cannot parse raises its DecodeError (the
        session ends, as when gRPC's own parse failed)."""
        now = self._clock()
        self._last_update_at = now
        self.stats.responses += 1
        t0 = time.thread_time()
        resp = read_response(raw, self._interest, self._decoders, now, self._state)
        self.stats.read_cpu_s += time.thread_time() - t0
        t, changed = resp.type_url, resp.changed
        self._response_type = t
        if resp.error is not None:
            self.stats.nacks += 1
            self.stats.last_nack = resp.error
            log.warning("NACK %s nonce %s: %s", t, resp.nonce, resp.error)
            nack = pb.DeltaDiscoveryRequest(type_url=t, response_nonce=resp.nonce)
            nack.error_detail.code = _INVALID_ARGUMENT
            nack.error_detail.message = resp.error
            return nack.SerializeToString()
        ack = _ack(t, resp.nonce)
        if changed is None:
            return ack  # a type we unsubscribed from entirely: ACK and ignore
        table = self._state.setdefault(t, {})
        table.update(changed)
        removed = frozenset(n for n in resp.removed if table.pop(n, None) is not None)
        self.stats.acks += 1
        if self._on_update is not None and (changed or removed):
            self._on_update(Update(t, MappingProxyType(changed), removed))
        return ack


def _request_bytes(req: pb.DeltaDiscoveryRequest | bytes) -> bytes:
    return req if type(req) is bytes else req.SerializeToString()  # type: ignore[union-attr]


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


class _FramesCall:
    """A frames connection as a session's `_call`: requests out as frames."""

    __slots__ = ("_writer",)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def write(self, req: pb.DeltaDiscoveryRequest | bytes) -> None:
        await self.send(_request_bytes(req))

    async def send(self, payload: bytes) -> None:
        # One write a frame (whole, so none interleaves with another's); drain, so a
        # connection gone is an error here.
        self._writer.write(_frame(payload))
        await self._writer.drain()


def _keepalive(sock: Any) -> None:
    """TCP keepalive on a frames connection, as the gRPC channel's pings (20 s, then
    dropped within ~10 s unanswered): a control plane gone without a word is noticed."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 20)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 3)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


_ACK_TYPE: dict[str, bytes] = {}


def _ack(type_url: str, nonce: str) -> bytes:
    """DeltaDiscoveryRequest(type_url, response_nonce) serialized, framed by hand (its
    fields 2 and 6; the type's frame built once): an ACK goes out for every response."""
    head = _ACK_TYPE.get(type_url)
    if head is None:
        if len(_ACK_TYPE) >= 64:
            _ACK_TYPE.clear()
        head = _ACK_TYPE[type_url] = len_field(2, type_url.encode())
    return head + len_field(6, nonce.encode())


def _advertised_port(metadata: Any) -> int | None:
    for key, value in metadata or ():
        if key == ADVERTISE_KEY:
            port = int(value) if str(value).isdigit() else 0
            return port if 0 < port < 65536 else None
    return None


class Publisher:
    """Writes resources into a control plane over its publish stream (one batch at a time;
    each is ACKed, or refused with ResourceError)."""

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Iterable[tuple[str, Any]] = (),
    ) -> None:
        options = list(channel_options)
        self._channel = (
            aio.secure_channel(target, credentials, options=options)
            if credentials is not None
            else aio.insecure_channel(target, options=options)
        )
        self._call: aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()
        self._nonce = 0
        # The control plane's frames publish port, as its stream advertised it (None: it
        # did not, or nothing was published yet): xds/publish_frames.py.
        self.frames_port: int | None = None
        self._read_metadata = False

    async def publish(
        self, type_url: str, resources: Mapping[str, bytes], removed: Iterable[str] = ()
    ) -> None:
        async with self._lock:
            if self._call is None or self._call.done():
                self._call = self._channel.stream_stream(
                    PUBLISH_METHOD,
                    request_serializer=pb.DeltaDiscoveryResponse.SerializeToString,
                    response_deserializer=pb.DeltaDiscoveryRequest.FromString,
                )()
                self._read_metadata = False
            self._nonce += 1
            await self._call.write(publish_message(type_url, resources, removed, self._nonce))
            reply = await self._call.read()
            if reply is aio.EOF:
                self._call = None
                raise ConnectionError("control plane closed the publish stream")
            if not self._read_metadata:
                self._read_metadata = True
                self.frames_port = _advertised_port(await self._call.initial_metadata())
            if reply.HasField("error_detail"):
                raise ResourceError(reply.error_detail.message)

    async def close(self) -> None:
        if self._call is not None:
            with contextlib.suppress(Exception):
                await self._call.done_writing()
        await self._channel.close()
