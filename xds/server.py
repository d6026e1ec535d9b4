"""The control plane's transport: Envoy's Aggregated Discovery Service (state-of-the-world
and delta) on grpcio asyncio, serving the SnapshotCache, plus the publish stream that
engine agents write their resources into.

Semantics follow envoy/service/discovery/v3/discovery.proto and the xDS protocol doc
(envoyproxy/envoy, api/xds_protocol.rst); structure follows go-control-plane: the cache
holds state, and each stream only moves changes out of it.

Per stream and type URL the server keeps the subscribed names (or wildcard), the names
changed since the last response (`pending`) and, for delta, the version of each resource
it last sent. A writer task per stream builds a response from the cache's *current*
contents when the client has ACKed or NACKed the previous one (at most
`max_unacked_per_type` responses in flight, one by default as in go-control-plane), so a
slow subscriber's updates coalesce to the latest per resource and it never delays others.
A NACK is logged and counted; nothing is re-sent for it, a resource goes out again only
when its version changes.

Besides meshd's own types the cache holds the EDS view (xds/eds.py): one
ClusterLoadAssignment per pool, derived from the EndpointStates, for Envoy. With
`resource_ttl_s` set, an engine whose agent has published nothing for that long (agents
heartbeat their EndpointState every couple of seconds) has all its resources removed, so
a dead agent's last report does not linger as if current.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from envoy.service.discovery.v3 import discovery_pb2 as pb
from grpc import aio

from xds.cache import SnapshotCache
from xds.eds import EdsView
from xds.resources import DECODERS, ResourceError

__all__ = [
    "PUBLISH_METHOD",
    "ControlPlane",
    "ServerLimits",
    "ServerStats",
    "StreamInfo",
    "TlsConfig",
]

log = logging.getLogger("meshd.xds.server")

WILDCARD = "*"
# Agents publish over a stream whose messages reuse xDS's own shapes in reverse: the agent
# sends DeltaDiscoveryResponse (type_url, resources, removed_resources, nonce), the control
# plane answers each with a DeltaDiscoveryRequest that ACKs it (response_nonce) or NACKs it
# (error_detail).
PUBLISH_SERVICE = "meshd.xds.v1.ResourcePublisher"
PUBLISH_METHOD = f"/{PUBLISH_SERVICE}/Publish"
RESOURCE_WRAPPER_TYPE = "type.googleapis.com/envoy.service.discovery.v3.Resource"
_INVALID_ARGUMENT = 3  # google.rpc.Code


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Flow control and connection settings (every limit a named setting)."""

    # Responses per stream and type sent but not yet ACKed/NACKed; more changes coalesce.
    max_unacked_per_type: int = 1
    max_message_bytes: int = 64 * 2**20
    keepalive_time_s: float = 30.0  # server pings an idle connection this often
    keepalive_timeout_s: float = 10.0  # and drops it when a ping goes unanswered this long
    min_client_ping_interval_s: float = 10.0  # clients pinging more often are refused
    # Reject publishes of types the control plane cannot validate.
    accepted_types: frozenset[str] = frozenset(DECODERS)
    # Remove an engine's published resources once nothing was published under its name
    # for this long (None: keep them until removed).
    resource_ttl_s: float | None = None


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Server certificate; with `client_ca`, clients must present a certificate it signed."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(slots=True)
class ServerStats:
    """Counters by type URL (exported by the control-plane command's metrics)."""

    streams_open: int = 0
    streams_total: int = 0
    requests: int = 0
    responses: Counter[str] = field(default_factory=Counter)
    acks: Counter[str] = field(default_factory=Counter)
    nacks: Counter[str] = field(default_factory=Counter)
    last_nack: dict[str, str] = field(default_factory=dict)  # type URL -> error detail
    stale_nonces: int = 0
    coalesced: Counter[str] = field(default_factory=Counter)  # updates merged while pending
    publishes: int = 0
    publishes_rejected: int = 0
    last_publish_error: str = ""
    expired: int = 0  # engines whose resources went for want of publishes (resource_ttl_s)


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """One subscriber stream's position for one type (introspection and tests)."""

    peer: str
    node_id: str
    delta: bool
    type_url: str
    wildcard: bool
    names: frozenset[str]
    pending: int
    unacked: int


class _Subscription:
    """One stream's state for one type URL."""

    __slots__ = (
        "announce_absent",
        "full",
        "legacy_wildcard",
        "names",
        "pending",
        "sent",
        "type_url",
        "unacked",
        "wildcard",
    )

    def __init__(self, type_url: str) -> None:
        self.type_url = type_url
        self.names: set[str] = set()
        self.wildcard = False
        self.legacy_wildcard = False
        self.pending: set[str] = set()
        self.full = True  # the next response considers every relevant resource
        self.sent: dict[str, str] = {}  # delta: name -> version the client was sent or has
        self.announce_absent: set[str] = set()  # delta: newly subscribed, maybe nonexistent
        self.unacked: deque[str] = deque()

    def relevant(self, name: str) -> bool:
        return self.wildcard or name in self.names


class _Stream:
    """One ADS stream: request handling and response building, either variant."""

    def __init__(self, cp: ControlPlane, peer: str, delta: bool) -> None:
        self.cp = cp
        self.peer = peer
        self.delta = delta
        self.node_id = ""
        self.subs: dict[str, _Subscription] = {}
        self.wake = asyncio.Event()
        self._nonces = itertools.count(1)
        self._last_nonce: dict[str, str] = {}

    # -- cache -> stream ------------------------------------------------------------------

    def on_change(self, type_url: str, names: frozenset[str]) -> None:
        sub = self.subs.get(type_url)
        if sub is None:
            return
        relevant = names if sub.wildcard else names & sub.names
        if not relevant:
            return
        before = len(sub.pending)
        sub.pending |= relevant
        merged = len(relevant) - (len(sub.pending) - before)
        if merged:
            self.cp.stats.coalesced[type_url] += merged
        self.wake.set()

    # -- requests -------------------------------------------------------------------------

    def _ack(self, sub: _Subscription, nonce: str, error: Any | None) -> None:
        """Account for an ACK (error None) or a NACK of `nonce`."""
        t = sub.type_url
        if error is None:
            self.cp.stats.acks[t] += 1
            return
        self.cp.stats.nacks[t] += 1
        self.cp.stats.last_nack[t] = error.message
        log.warning(
            "NACK from %s (node %r) for %s nonce %s: %s",
            self.peer,
            self.node_id,
            t,
            nonce,
            error.message,
        )

    def on_sotw_request(self, req: pb.DiscoveryRequest) -> None:
        t = req.type_url
        sub = self.subs.get(t)
        first = sub is None
        if sub is None:
            sub = self.subs[t] = _Subscription(t)
        elif req.response_nonce != self._last_nonce.get(t, ""):
            # The protocol: a request carrying an older nonce than the latest response is
            # superseded by that response, and ignored.
            self.cp.stats.stale_nonces += 1
            return
        if req.response_nonce and not first:
            sub.unacked.clear()
            self._ack(
                sub, req.response_nonce, req.error_detail if req.HasField("error_detail") else None
            )
        names = set(req.resource_names)
        if first:
            sub.legacy_wildcard = not names
        elif names:
            sub.legacy_wildcard = False
        wildcard = WILDCARD in names or (sub.legacy_wildcard and not names)
        names.discard(WILDCARD)
        if first or names != sub.names or wildcard != sub.wildcard:
            sub.full = True
        sub.names, sub.wildcard = names, wildcard
        self.wake.set()

    def on_delta_request(self, req: pb.DeltaDiscoveryRequest) -> None:
        t = req.type_url
        sub = self.subs.get(t)
        if sub is None:
            sub = self.subs[t] = _Subscription(t)
            # Resumption: what the client already holds is what we consider sent, so it
            # gets only what differs (and removals of what is gone).
            sub.sent = dict(req.initial_resource_versions)
            sub.wildcard = not req.resource_names_subscribe
        if req.response_nonce:
            if req.response_nonce in sub.unacked:
                while sub.unacked and sub.unacked.popleft() != req.response_nonce:
                    pass
                err = req.error_detail if req.HasField("error_detail") else None
                self._ack(sub, req.response_nonce, err)
            else:
                self.cp.stats.stale_nonces += 1
        for name in req.resource_names_subscribe:
            if name == WILDCARD:
                if not sub.wildcard:
                    sub.wildcard, sub.full = True, True
            elif name in sub.names:
                # An explicit re-subscribe asks for the resource again.
                sub.sent.pop(name, None)
                sub.pending.add(name)
            else:
                sub.names.add(name)
                sub.pending.add(name)
                sub.announce_absent.add(name)
        for name in req.resource_names_unsubscribe:
            if name == WILDCARD:
                sub.wildcard = False
                for n in [n for n in sub.sent if n not in sub.names]:
                    del sub.sent[n]
            else:
                sub.names.discard(name)
                if not sub.wildcard:
                    sub.sent.pop(name, None)
                    sub.pending.discard(name)
                sub.announce_absent.discard(name)
        self.wake.set()

    # -- responses ------------------------------------------------------------------------

    def _next_nonce(self, sub: _Subscription) -> str:
        nonce = str(next(self._nonces))
        sub.unacked.append(nonce)
        self._last_nonce[sub.type_url] = nonce
        self.cp.stats.responses[sub.type_url] += 1
        return nonce

    def build_delta(self, sub: _Subscription) -> pb.DeltaDiscoveryResponse | None:
        cache, t = self.cp.cache, sub.type_url
        table = cache.resources(t)
        candidates = sub.pending
        if sub.full:
            candidates = candidates | set(sub.sent) | (set(table) if sub.wildcard else sub.names)
            sub.full = False
        sub.pending = set()
        absent, sub.announce_absent = sub.announce_absent, set()
        resp = pb.DeltaDiscoveryResponse(type_url=t, system_version_info=str(cache.type_version(t)))
        for name in sorted(candidates):
            if not sub.relevant(name):
                sub.sent.pop(name, None)
                continue
            r = table.get(name)
            if r is None:
                # Gone, or (first time asked for) never existed: the protocol says both
                # through removed_resources.
                if sub.sent.pop(name, None) is not None or name in absent:
                    resp.removed_resources.append(name)
                continue
            if sub.sent.get(name) == r.version:
                continue
            sub.sent[name] = r.version
            res = resp.resources.add(name=name, version=r.version)
            res.resource.type_url = t
            res.resource.value = r.body
        if not resp.resources and not resp.removed_resources:
            return None
        resp.nonce = self._next_nonce(sub)
        return resp

    def build_sotw(self, sub: _Subscription) -> pb.DiscoveryResponse | None:
        if not (sub.full or sub.pending):
            return None
        cache, t = self.cp.cache, sub.type_url
        table = cache.resources(t)
        sub.full, sub.pending = False, set()
        resp = pb.DiscoveryResponse(type_url=t, version_info=str(cache.type_version(t)))
        names = sorted(table) if sub.wildcard else sorted(n for n in sub.names if n in table)
        # Every response carries the full subscribed set, so absence means removal (as LDS
        # and CDS). meshd's types carry no name of their own, so they travel wrapped in
        # envoy.service.discovery.v3.Resource (name + version), which SotW clients accept.
        wrap = t in DECODERS
        for name in names:
            r = table[name]
            if wrap:
                inner = pb.Resource(name=name, version=r.version)
                inner.resource.type_url = t
                inner.resource.value = r.body
                resp.resources.add().Pack(inner)
            else:
                resp.resources.add(type_url=t, value=r.body)
        resp.nonce = self._next_nonce(sub)
        return resp

    async def write_loop(self, write: Callable[[Any], Any]) -> None:
        limit = self.cp.limits.max_unacked_per_type
        while True:
            await self.wake.wait()
            self.wake.clear()
            for sub in list(self.subs.values()):
                if len(sub.unacked) >= limit:
                    continue
                resp = self.build_delta(sub) if self.delta else self.build_sotw(sub)
                if resp is not None:
                    await write(resp)

    def info(self) -> list[StreamInfo]:
        return [
            StreamInfo(
                self.peer,
                self.node_id,
                self.delta,
                s.type_url,
                s.wildcard,
                frozenset(s.names),
                len(s.pending),
                len(s.unacked),
            )
            for s in self.subs.values()
        ]


class _AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[pb.DiscoveryRequest], context: aio.ServicerContext
    ) -> None:
        await self.cp._serve(
            _Stream(self.cp, context.peer(), delta=False), request_iterator, context
        )

    async def DeltaAggregatedResources(
        self,
        request_iterator: AsyncIterator[pb.DeltaDiscoveryRequest],
        context: aio.ServicerContext,
    ) -> None:
        await self.cp._serve(
            _Stream(self.cp, context.peer(), delta=True), request_iterator, context
        )


class ControlPlane:
    """The ADS + publish gRPC server over one SnapshotCache.

    Mutate the cache (or call `publish`) on the server's event loop: watchers run
    synchronously inside the mutation.
    """

    def __init__(
        self,
        cache: SnapshotCache | None = None,
        limits: ServerLimits | None = None,
        *,
        eds: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`eds`: also serve the pools as ClusterLoadAssignments (xds/eds.py)."""
        self.cache = cache if cache is not None else SnapshotCache()
        self.limits = limits or ServerLimits()
        self.stats = ServerStats()
        self.eds = EdsView(self.cache) if eds else None
        self._clock = clock
        self._server: aio.Server | None = None
        self._streams: set[_Stream] = set()
        self._events = asyncio.Condition()
        self._published_at: dict[str, float] = {}  # resource name -> last publish
        self._sweeper: asyncio.Task[None] | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------

    def grpc_options(self) -> list[tuple[str, int]]:
        lim = self.limits
        return [
            ("grpc.keepalive_time_ms", int(lim.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(lim.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            (
                "grpc.http2.min_ping_interval_without_data_ms",
                int(lim.min_client_ping_interval_s * 1000),
            ),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_receive_message_length", lim.max_message_bytes),
            ("grpc.max_send_message_length", lim.max_message_bytes),
        ]

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, tls: TlsConfig | None = None
    ) -> int:
        """Bind and serve; returns the port (useful with port 0)."""
        server = aio.server(options=self.grpc_options())
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_AdsServicer(self), server)
        publish = grpc.stream_stream_rpc_method_handler(
            self._publish_stream,
            request_deserializer=pb.DeltaDiscoveryResponse.FromString,
            response_serializer=pb.DeltaDiscoveryRequest.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(PUBLISH_SERVICE, {"Publish": publish}),)
        )
        address = f"{host}:{port}"
        bound = (
            server.add_secure_port(address, tls.credentials())
            if tls is not None
            else server.add_insecure_port(address)
        )
        if bound == 0:
            raise OSError(f"control plane cannot bind {address}")
        await server.start()
        self._server, self.port = server, bound
        if self.limits.resource_ttl_s is not None and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_loop(self.limits.resource_ttl_s))
        log.info(
            "control plane listening on %s:%d (%s)", host, bound, "mTLS" if tls else "plaintext"
        )
        return bound

    async def stop(self, grace: float | None = None) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- publishing -----------------------------------------------------------------------

    def validate(self, type_url: str, resources: Mapping[str, bytes]) -> None:
        """Raise ResourceError unless every resource decodes as `type_url`."""
        if type_url not in self.limits.accepted_types:
            raise ResourceError(f"type {type_url!r} not accepted")
        decoder = DECODERS.get(type_url)
        for name, body in resources.items():
            if not name:
                raise ResourceError("resource without a name")
            if decoder is not None:
                try:
                    decoder(body)
                except ResourceError as exc:
                    raise ResourceError(f"{name}: {exc}") from None

    def publish(
        self, type_url: str, resources: Mapping[str, bytes], removed: tuple[str, ...] = ()
    ) -> frozenset[str]:
        """Validate then apply a batch (all or nothing); returns the names changed."""
        self.validate(type_url, resources)
        now = self._clock()
        for name in resources:
            self._published_at[name] = now
        return self.cache.update(type_url, resources, removed)

    def expire(self, now: float) -> list[str]:
        """Remove every resource of the engines that published nothing for
        `resource_ttl_s`; returns their names."""
        ttl = self.limits.resource_ttl_s
        if ttl is None:
            return []
        silent = [n for n, at in self._published_at.items() if now - at >= ttl]
        if not silent:
            return []
        for name in silent:
            del self._published_at[name]
        removed: set[str] = set()
        for type_url in sorted(self.limits.accepted_types):
            removed |= self.cache.update(type_url, {}, removed=silent)
        if removed:
            self.stats.expired += len(removed)
            log.warning(
                "no publish for %.1f s from %d engine(s), removed: %s",
                ttl,
                len(removed),
                sorted(removed)[:20],
            )
        return sorted(removed)

    async def _sweep_loop(self, ttl_s: float) -> None:
        while True:
            await asyncio.sleep(max(0.05, ttl_s / 4))
            self.expire(self._clock())

    async def _publish_stream(
        self,
        request_iterator: AsyncIterator[pb.DeltaDiscoveryResponse],
        context: aio.ServicerContext,
    ) -> AsyncIterator[pb.DeltaDiscoveryRequest]:
        async for msg in request_iterator:
            reply = pb.DeltaDiscoveryRequest(type_url=msg.type_url, response_nonce=msg.nonce)
            try:
                upserts: dict[str, bytes] = {}
                for r in msg.resources:
                    if r.resource.type_url != msg.type_url:
                        raise ResourceError(
                            f"{r.name}: Any type {r.resource.type_url!r} != {msg.type_url!r}"
                        )
                    upserts[r.name] = r.resource.value
                self.publish(msg.type_url, upserts, tuple(msg.removed_resources))
                self.stats.publishes += 1
            except ResourceError as exc:
                self.stats.publishes_rejected += 1
                self.stats.last_publish_error = str(exc)
                log.warning("refused publish from %s: %s", context.peer(), exc)
                reply.error_detail.code = _INVALID_ARGUMENT
                reply.error_detail.message = str(exc)
            yield reply

    # -- streams --------------------------------------------------------------------------

    async def _serve(
        self, stream: _Stream, requests: AsyncIterator[Any], context: aio.ServicerContext
    ) -> None:
        # Headers now, so a client knows it is connected before any response.
        await context.send_initial_metadata(())
        unwatch = self.cache.watch(stream.on_change)
        self._streams.add(stream)
        self.stats.streams_open += 1
        self.stats.streams_total += 1
        writer = asyncio.ensure_future(stream.write_loop(context.write))
        reader = asyncio.ensure_future(self._read(stream, requests))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            unwatch()
            self._streams.discard(stream)
            self.stats.streams_open -= 1
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)

    async def _read(self, stream: _Stream, requests: AsyncIterator[Any]) -> None:
        async for req in requests:
            self.stats.requests += 1
            if not stream.node_id and req.node.id:
                stream.node_id = req.node.id
            if not req.type_url:
                log.warning("request without type_url from %s ignored", stream.peer)
            elif stream.delta:
                stream.on_delta_request(req)
            else:
                stream.on_sotw_request(req)
            async with self._events:
                self._events.notify_all()

    # -- introspection --------------------------------------------------------------------

    def streams(self) -> list[StreamInfo]:
        return [i for s in list(self._streams) for i in s.info()]

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; it is re-checked after every request handled."""
        async with self._events:
            await self._events.wait_for(predicate)
