"""The control plane's transport: Envoy's Aggregated Discovery Service (state-of-the-world
and delta) on grpcio asyncio, serving the SnapshotCache, plus the publish stream that
engine agents write their resources into (over gRPC, or the same messages over the frames
port, xds/publish_frames.py, a fifth of the CPU a message, which the gRPC stream advertises).
Delta subscribers (sidecars) may take the frames port too (advertised on their ADS
stream): the same requests and responses, the same stream logic (_Stream), without gRPC.

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

Fan-out, the part that scales with subscribers x updates: the cache has one watcher, the
control plane's, which only collects changed names per type; one flush per event-loop turn
(at most one per `push_interval_s`, a debounce like Istio's) hands the collected set to
every stream, so a hundred publishes cost each stream one set union rather than a hundred
callbacks. Responses are assembled from bytes: each resource version is encoded once (its
`Resource` message framed as a response field, xds/wire.py) and the same bytes go to every
subscriber. Delta wildcard subscribers that hold the same versions (sidecars that keep up:
the usual case) are kept in lockstep (`_Lockstep`): a flush turns its changes into one
batch, whose response is the same bytes for each of them (one nonce for all); one that
falls behind queues batches and sends them merged, and one that changes its subscription or
falls far behind goes on alone, with its own versions, until it is in step again. Measured
in-process (loadtest/xds_codec_bench.py --fanout: 1000 engines, 100 subscribers, 100
updates per flush, 2-core dev box): 0.1-0.3 us per update per subscriber, against 1.4-3.9
us building and serializing a protobuf response per subscriber.

Memory, the part that scales with engines x digest blocks (1,000 engines of 40,000 blocks
hold 320 MB of hashes): a resource's body is held once. Frames are parts around the
cache's body rather than copies of it (SPLIT_BODY_BYTES), so are a digest base's, and a
delta response carries at most `max_response_bytes` of resources (the rest in the next
ones), so what each subscriber has in flight is bounded whatever arrives at once.

PrefixDigests need one thing more: a delta applies only on top of the full digest it is
based on, and the cache holds only the latest digest per engine, so a subscriber that joins
after an engine's full digest, or whose full digest was coalesced away, would hold deltas
it cannot apply until the agent's next resync. `_DigestBases` keeps each engine's last full
digest and the versions built on it; a response that would give a subscriber a delta on a
base it does not hold gives it the base instead, and the delta goes in the next response
(delta, lockstep and state-of-the-world alike; a lockstep member's merged backlog never
lets a delta replace a base).

Besides meshd's own types the cache holds the EDS view (xds/eds.py): one
ClusterLoadAssignment per pool, derived from the EndpointStates, for Envoy; with
control-plane shards (`eds_shards`), every shard's engines, the others' followed
(xds/eds_shards.py), since an Envoy follows one management server. With
`resource_ttl_s` set, an engine whose agent has published nothing for that long (agents
heartbeat their EndpointState every couple of seconds) has all its resources removed, so
a dead agent's last report does not linger as if current.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2 as pb
from google.protobuf.message import DecodeError
from grpc import aio

from xds.cache import Resource, SnapshotCache
from xds.eds import CLA_TYPE, SHARD_CLA_TYPE, EdsView
from xds.publish_frames import ADVERTISE_KEY, FramePublishServer, server_ssl_context
from xds.resources import (
    DECODERS,
    ENDPOINT_STATE_TYPE,
    PREFIX_DIGEST_TYPE,
    DigestHeader,
    EndpointState,
    ResourceError,
    decode_prefix_digest_header,
)
from xds.wire import len_field, len_header

if TYPE_CHECKING:
    from xds.eds_shards import ShardedEds

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
ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"
RESOURCE_WRAPPER_TYPE = "type.googleapis.com/envoy.service.discovery.v3.Resource"
_WRAPPER_TYPE_BYTES = RESOURCE_WRAPPER_TYPE.encode()
_INVALID_ARGUMENT = 3  # google.rpc.Code
# What a publish is checked with: each type's decoder, but a PrefixDigest's hashes are
# checked without being made into ints (the control plane never reads them).
_VALIDATORS: Mapping[str, Callable[[bytes], Any]] = {
    **DECODERS,
    PREFIX_DIGEST_TYPE: decode_prefix_digest_header,
}


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Flow control and connection settings (every limit a named setting)."""

    # Responses per stream and type sent but not yet ACKed/NACKed; more changes coalesce.
    max_unacked_per_type: int = 1
    # Changes reach the streams at most this often (0: at the next event-loop turn, which
    # still merges what arrived together). A bound on responses per stream and second.
    push_interval_s: float = 0.0
    max_message_bytes: int = 64 * 2**20
    # A delta response carries resources up to this many bytes (at least one); the rest
    # follow in the next ones, each sent once the previous is answered. Under gRPC's
    # default 4 MiB receive limit, so any client takes a burst of full PrefixDigests (a
    # restart of 1,000 engines of 40,000 blocks is 320 MB: one response before, refused
    # by the client, or by this server beyond max_message_bytes); and it bounds what a
    # response in flight holds per subscriber. A state-of-the-world response is the whole
    # subscribed set, so it is not bounded.
    max_response_bytes: int = 2 * 2**20
    keepalive_time_s: float = 30.0  # server pings an idle connection this often
    keepalive_timeout_s: float = 10.0  # and drops it when a ping goes unanswered this long
    # A frames publish connection (xds/publish_frames.py) must finish TLS within this.
    handshake_timeout_s: float = 10.0
    min_client_ping_interval_s: float = 10.0  # clients pinging more often are refused
    # Reject publishes of types the control plane cannot validate.
    accepted_types: frozenset[str] = frozenset(DECODERS)
    # Remove an engine's published resources once nothing was published under its name
    # for this long (None: keep them until removed).
    resource_ttl_s: float | None = None
    # With a tracer: a span for the first publish and every Nth after it (each one a
    # publish call, its resources and the names it changed), and for every refused one.
    # A span per publish would cost more than the publish at fleet rates (10,000/s).
    publish_trace_every: int = 1000


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

    def ssl_context(self) -> ssl.SSLContext:
        """The same for the frames publish port (xds/publish_frames.py)."""
        return server_ssl_context(self.cert_chain, self.private_key, self.client_ca)


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
    digest_bases_sent: int = 0  # full PrefixDigests sent ahead of a delta (_DigestBases)


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


# One resource's encoding as a field of a response: parts to be joined as they are. A body
# of at least SPLIT_BODY_BYTES is a part of its own, the cache's bytes object itself, so
# the frames of a large resource (a PrefixDigest: 320 KB at 40,000 blocks) hold no second
# copy of it; a smaller one is joined into one part (fewer parts per response).
Frame = tuple[bytes, ...]
SPLIT_BODY_BYTES = 4096


def _frame(head: bytes, body: bytes, tail: bytes) -> Frame:
    if len(body) < SPLIT_BODY_BYTES:
        return (head + body + tail,)
    return (head, body, tail) if tail else (head, body)


def frame_size(frame: Frame) -> int:
    return sum(map(len, frame))


def _message_parts(r: Resource) -> tuple[bytes, bytes]:
    """r as an envoy.service.discovery.v3.Resource message (version, the body in an Any,
    name): the bytes before its body and after it, as protobuf's deterministic
    serialization lays them out (fields by number; empty ones left out)."""
    value = len_header(2, len(r.body)) if r.body else b""
    any_head = len_field(1, r.type_url.encode()) + value
    version = len_field(1, r.version.encode()) if r.version else b""
    head = version + len_header(2, len(any_head) + len(r.body)) + any_head
    return head, len_field(3, r.name.encode()) if r.name else b""


def _delta_frame(r: Resource) -> Frame:
    """r as DeltaDiscoveryResponse.resources (field 2)."""
    head, tail = _message_parts(r)
    size = len(head) + len(r.body) + len(tail)
    return _frame(len_header(2, size) + head, r.body, tail)


def _sotw_frame(r: Resource) -> Frame:
    """r as DiscoveryResponse.resources (field 2, an Any): wrapped in Resource for meshd's
    types, the bare body for Envoy's own."""
    if r.type_url in DECODERS:
        head, tail = _message_parts(r)
        size = len(head) + len(r.body) + len(tail)
        head = len_field(1, _WRAPPER_TYPE_BYTES) + len_header(2, size) + head
    else:
        value = len_header(2, len(r.body)) if r.body else b""
        head, tail = len_field(1, r.type_url.encode()) + value, b""
    return _frame(len_header(2, len(head) + len(r.body) + len(tail)) + head, r.body, tail)


class _Frames:
    """Each resource version's encoding as a field of a response, made the first time a
    stream needs it and shared by all: `delta` frames it as DeltaDiscoveryResponse.resources
    (field 2), `sotw` as DiscoveryResponse.resources (field 2, an Any: wrapped in Resource
    for meshd's types, the bare body for Envoy's own)."""

    __slots__ = ("_delta", "_sotw")

    def __init__(self) -> None:
        # name -> (the Resource it encodes, its frame, the frame's size); keyed by name per
        # type URL, so a new version replaces the old one and memory stays one frame per
        # resource (and a large body's frame shares the body: SPLIT_BODY_BYTES).
        self._delta: dict[str, dict[str, tuple[Resource, Frame, int]]] = {}
        self._sotw: dict[str, dict[str, tuple[Resource, Frame, int]]] = {}

    def delta_table(self, type_url: str) -> dict[str, tuple[Resource, Frame, int]]:
        """The delta frames of one type by name (read by build_delta's loop)."""
        return self._delta.setdefault(type_url, {})

    def delta(self, r: Resource) -> tuple[Resource, Frame, int]:
        """(r, its delta frame, the frame's size)."""
        table = self._delta.setdefault(r.type_url, {})
        hit = table.get(r.name)
        if hit is not None and hit[0] is r:
            return hit
        frame = _delta_frame(r)
        hit = table[r.name] = (r, frame, frame_size(frame))
        return hit

    def sotw(self, r: Resource) -> Frame:
        table = self._sotw.setdefault(r.type_url, {})
        hit = table.get(r.name)
        if hit is not None and hit[0] is r:
            return hit[1]
        frame = _sotw_frame(r)
        table[r.name] = (r, frame, frame_size(frame))
        return frame

    def forget(self, type_url: str, names: frozenset[str], live: Mapping[str, Resource]) -> None:
        """Drop the frames of `names` that are not of what `live` holds now (removed or
        replaced: an old full digest's frame would keep its body alive)."""
        for tables in (self._delta, self._sotw):
            table = tables.get(type_url)
            if table:
                for n in names:
                    hit = table.get(n)
                    if hit is not None and hit[0] is not live.get(n):
                        del table[n]


# Versions remembered per base (a delta on it each time the engine published; the agent
# resyncs long before this many). Forgetting one only costs its holder a spare full digest.
MAX_DIGEST_VERSIONS = 4096


class _DigestChain:
    """One engine's last full PrefixDigest and the versions that build on it. Its frames
    share the base's body (SPLIT_BODY_BYTES), itself the cache's while the base is the
    latest digest: an engine's full digest is held once, however many hold it."""

    __slots__ = ("_delta_frame", "_sotw_frame", "base", "epoch", "seq", "versions")

    def __init__(self, base: Resource, epoch: str, seq: int) -> None:
        self.base = base
        self.epoch = epoch
        self.seq = seq
        # The base itself and each delta published on it, oldest first (a dict as an
        # ordered set, trimmed from the front at MAX_DIGEST_VERSIONS).
        self.versions: dict[str, None] = {base.version: None}
        self._delta_frame: tuple[Frame, int] | None = None
        self._sotw_frame: Frame | None = None

    def delta_frame(self) -> tuple[Frame, int]:
        """The base as a delta response's resource and its size, made the first time it is
        needed."""
        if self._delta_frame is None:
            frame = _delta_frame(self.base)
            self._delta_frame = frame, frame_size(frame)
        return self._delta_frame

    def sotw_frame(self) -> Frame:
        """The base as a state-of-the-world response's resource, likewise."""
        if self._sotw_frame is None:
            self._sotw_frame = _sotw_frame(self.base)
        return self._sotw_frame


class _DigestBases:
    """What lets a subscriber apply a PrefixDigest delta it is sent: the full digest the
    delta builds on (xds/resources.py: a delta is cumulative since one full digest and
    applies only on top of it).

    The cache holds the latest digest per engine only, so two things would leave a
    subscriber holding a delta whose base it never saw, with no precise prefix knowledge of
    that engine until the agent's next resync (30 s by default): subscribing after the
    engine's last full digest (a sidecar starting, or resuming on another replica), and a
    full digest coalesced away (published, then a delta on it, within one flush or while
    the subscriber's previous response was unanswered). So the control plane keeps each
    engine's last full digest (one per engine: what any sidecar holds of it anyway) and the
    versions published on it; a response that would give a subscriber a delta on a base it
    does not hold gives it the base instead, and the delta follows in the next response.
    A spare base is harmless: a subscriber ignores a full digest older than what it has.
    """

    __slots__ = ("_chains",)

    def __init__(self) -> None:
        self._chains: dict[str, _DigestChain] = {}

    def published(self, name: str, digest: DigestHeader, r: Resource) -> None:
        """`digest` (its header) now held as `r` under `name`."""
        if digest.full:
            chain = self._chains.get(name)
            if chain is None or chain.base.version != r.version:
                self._chains[name] = _DigestChain(r, digest.epoch, digest.seq)
            return
        chain = self._chains.get(name)
        if chain is None:
            return
        if chain.epoch != digest.epoch or chain.seq != digest.base_seq:
            # On a base this control plane never saw (it started after it): nobody can be
            # helped to it, and the old base is no one's to build on any more.
            del self._chains[name]
            return
        versions = chain.versions
        versions[r.version] = None
        if len(versions) > MAX_DIGEST_VERSIONS:
            del versions[next(iter(versions))]

    def forget(self, names: frozenset[str], live: Mapping[str, Resource]) -> None:
        """Drop the chains of `names` that are no longer in `live` (removed resources)."""
        for n in names:
            if n not in live:
                self._chains.pop(n, None)

    def needed(self, name: str, r: Resource, held: str | None) -> _DigestChain | None:
        """The chain whose base must go to a subscriber holding version `held` (None:
        nothing) before `r`, or None when `r` may go as it is: `r` is not a delta on a
        known base, or the subscriber holds that base or a delta on it."""
        chain = self._chains.get(name)
        if chain is None:
            return None
        versions = chain.versions
        if r.version not in versions or r.version == chain.base.version:
            return None
        if held is not None and held in versions:
            return None
        return chain

    def is_base(self, name: str, r: Resource) -> bool:
        """Whether `r` is the full digest deltas of `name` build on (a slow lockstep
        member's merged backlog must not let a later delta replace it)."""
        chain = self._chains.get(name)
        return chain is not None and r.version == chain.base.version

    def __len__(self) -> int:
        return len(self._chains)


@dataclass(frozen=True, slots=True)
class _Push:
    """One response, serialized, and what tracing says of it."""

    payload: bytes
    type_url: str
    version: str
    nonce: str
    resources: int
    removed: int


# A lockstep member more batches behind than this goes on alone (bounds what it holds).
MAX_BACKLOG = 64


# A lockstep batch's response is kept for the members yet to send it when at most this
# large (the usual batch: a flush's EndpointStates, tens of KB); a larger one (a burst of
# full digests) is joined by each member as it sends it, so a burst holds no more than a
# response per stream in flight.
SHARED_PAYLOAD_BYTES = 256 * 2**10


@dataclass(slots=True)
class _Batch:
    """One flush's changes of one type, or max_response_bytes of them, for every subscriber
    in lockstep: `parts` a DeltaDiscoveryResponse (resources, removed_resources,
    system_version_info, type_url, nonce) of shared frames, `size` its bytes. Every member
    sends it with the same `nonce` (unique in the control plane, so in each stream), so it
    is the same bytes for all: `response()`, joined once. `entries` are the same changes by
    name (a frame, or None for a removal), to merge the batches a member fell behind by;
    `bases` the names whose frame is a full PrefixDigest (a base: never merged away by a
    later delta)."""

    parts: tuple[bytes, ...]
    size: int
    version: str
    nonce: str
    resources: int
    removed: int
    entries: tuple[tuple[str, Frame | None], ...]
    bases: frozenset[str] = frozenset()
    payload: bytes | None = None

    def response(self) -> bytes:
        payload = self.payload
        if payload is None:
            payload = b"".join(self.parts)
            if self.size <= SHARED_PAYLOAD_BYTES:
                self.payload = payload
        return payload


class _Lockstep:
    """The delta wildcard subscriptions of one type that hold, or have been given, exactly
    `sent` (name -> version: what the cache held at the last flush). Each flush turns its
    changes into one _Batch that every member gets, instead of each working out its own
    response; a member still waiting for an answer to its last response queues the batch
    (its backlog, sent merged once it may send). A member that changes its subscription or
    falls MAX_BACKLOG batches behind leaves with a copy of `sent` (its backlog still goes
    out first) and goes on alone; an idle one whose versions equal `sent` joins back."""

    __slots__ = ("members", "sent")

    def __init__(self, sent: dict[str, str]) -> None:
        self.sent = sent
        self.members: dict[_Subscription, _Stream] = {}


class _Subscription:
    """One stream's state for one type URL."""

    __slots__ = (
        "announce_absent",
        "backlog",
        "full",
        "legacy_wildcard",
        "lockstep",
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
        # Delta, in lockstep: its versions are the _Lockstep's `sent` (its own `sent` is
        # then unused); `backlog` the batches given to it and not yet sent.
        self.lockstep: _Lockstep | None = None
        self.backlog: list[_Batch] = []

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
        self._push_spans: dict[str, Any] = {}  # nonce -> its open span (tracing on)

    # -- cache -> stream ------------------------------------------------------------------

    def on_change(self, type_url: str, names: frozenset[str]) -> None:
        sub = self.subs.get(type_url)
        if sub is None or sub.lockstep is not None:
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

    def _first_subscription(self, type_url: str) -> None:
        eds = self.cp.eds
        if eds is not None and type_url in (CLA_TYPE, SHARD_CLA_TYPE):
            eds.flush()  # the view waits while no one follows it (ControlPlane._eds_wanted)
            shards = self.cp.eds_shards
            if shards is not None and type_url == CLA_TYPE:
                if not shards.started:
                    self._eds_ready_seen = False  # (again) not before they answered
                shards.start()  # an Envoy: the other shards' engines join the view
                shards.flush()

    def _ack(self, sub: _Subscription, nonce: str, error: Any | None) -> None:
        """Account for an ACK (error None) or a NACK of `nonce`."""
        t = sub.type_url
        if self._push_spans:
            self._end_push_span(nonce, error)
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
            self._first_subscription(t)
        elif req.response_nonce != self._last_nonce.get(t, ""):
            # The protocol: a request carrying an older nonce than the latest response is
            # superseded by that response, and ignored.
            self.cp.stats.stale_nonces += 1
            return
        if req.response_nonce and not first:
            if self._push_spans:
                for n in sub.unacked:
                    if n != req.response_nonce:
                        self._end_push_span(n, None)
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
            self._first_subscription(t)
            # Resumption: what the client already holds is what we consider sent, so it
            # gets only what differs (and removals of what is gone).
            sub.sent = dict(req.initial_resource_versions)
            sub.wildcard = not req.resource_names_subscribe
        if req.response_nonce:
            if req.response_nonce in sub.unacked:
                # Older responses still unanswered are answered by this one.
                while sub.unacked and (n := sub.unacked.popleft()) != req.response_nonce:
                    if self._push_spans:
                        self._end_push_span(n, None)
                err = req.error_detail if req.HasField("error_detail") else None
                self._ack(sub, req.response_nonce, err)
            else:
                self.cp.stats.stale_nonces += 1
        if sub.lockstep is not None and (
            req.resource_names_subscribe or req.resource_names_unsubscribe
        ):
            self.cp._leave_lockstep(sub)
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
        self._maybe_join(sub)
        self.wake.set()

    def _maybe_join(self, sub: _Subscription) -> None:
        """An idle delta wildcard subscription may join its type's lockstep group."""
        if (
            self.delta
            and sub.lockstep is None
            and sub.wildcard
            and not (sub.names or sub.full or sub.pending or sub.announce_absent or sub.unacked)
            and not sub.backlog
        ):
            self.cp._join_lockstep(sub, self)

    # -- responses ------------------------------------------------------------------------

    def _next_nonce(self, sub: _Subscription) -> str:
        return self._use_nonce(sub, str(next(self._nonces)))

    def _use_nonce(self, sub: _Subscription, nonce: str) -> str:
        """Account for a response to `sub` sent with `nonce`."""
        sub.unacked.append(nonce)
        self._last_nonce[sub.type_url] = nonce
        self.cp.stats.responses[sub.type_url] += 1
        return nonce

    def build_delta(self, sub: _Subscription) -> _Push | None:
        cache, t = self.cp.cache, sub.type_url
        table = cache.resources(t)
        candidates = sub.pending
        if sub.full:
            candidates = candidates | set(sub.sent) | (set(table) if sub.wildcard else sub.names)
            sub.full = False
        sub.pending = set()
        absent, sub.announce_absent = sub.announce_absent, set()
        frames = self.cp._frames
        shared = frames.delta_table(t)
        sent, wildcard, subscribed = sub.sent, sub.wildcard, sub.names
        bases = self.cp._digest_bases if t == PREFIX_DIGEST_TYPE else None
        limit, size, count = self.cp.limits.max_response_bytes, 0, 0
        parts: list[bytes] = []
        removed: list[str] = []
        # The per-resource loop of every response to every subscriber: kept to dict
        # operations and one shared frame each (order is not part of the protocol).
        for name in candidates:
            if not (wildcard or name in subscribed):
                sent.pop(name, None)
                continue
            r = table.get(name)
            if r is None:
                # Gone, or (first time asked for) never existed: the protocol says both
                # through removed_resources.
                if sent.pop(name, None) is not None or name in absent:
                    removed.append(name)
                continue
            v = r.version
            held = sent.get(name)
            if held == v:
                continue
            if bases is not None and (chain := bases.needed(name, r, held)) is not None:
                # The base first; the delta goes in the next response.
                f, n = chain.delta_frame()
                sub.pending.add(name)
                if size and size + n > limit:
                    continue  # the response is full: the base goes in the next one
                sent[name] = chain.base.version
                self.cp.stats.digest_bases_sent += 1
            else:
                hit = shared.get(name)
                if hit is None or hit[0] is not r:
                    hit = frames.delta(r)
                _, f, n = hit
                if size and size + n > limit:
                    sub.pending.add(name)  # the response is full: it goes in the next one
                    continue
                sent[name] = v
            parts += f
            size += n
            count += 1
        if not parts and not removed:
            return None
        version = str(cache.type_version(t))
        nonce = self._next_nonce(sub)
        parts.append(len_field(1, version.encode()))  # system_version_info
        parts.append(len_field(4, t.encode()))  # type_url
        parts.extend(len_field(6, name.encode()) for name in removed)  # removed_resources
        parts.append(len_field(5, nonce.encode()))  # nonce
        return _Push(b"".join(parts), t, version, nonce, count, len(removed))

    def next_push(self, sub: _Subscription) -> _Push | None:
        """The response to send `sub` now, if any (the caller checks flow control)."""
        if sub.type_url == CLA_TYPE and not self.cp.eds_ready():
            return None  # not a view with a shard missing (xds/eds_shards.py)
        if sub.backlog:
            return self._shared(sub)
        if sub.lockstep is not None:
            return None  # a member has nothing of its own to send
        if not self.delta:
            return self.build_sotw(sub)
        push = self.build_delta(sub)
        if push is None:
            self._maybe_join(sub)  # nothing was left to send: it may be in step now
        return push

    def _shared(self, sub: _Subscription) -> _Push:
        batches = sub.backlog
        limit = self.cp.limits.max_response_bytes
        take = size = 0
        based: set[str] = set()
        for b in batches:
            # Batches merge up to max_response_bytes; and one that changes a name an earlier
            # one sent a base for waits for the next response: merged, the delta would
            # replace the base it needs.
            if take and (
                size + b.size > limit or (based and any(name in based for name, _ in b.entries))
            ):
                break
            based |= b.bases
            size += b.size
            take += 1
        batches, sub.backlog = batches[:take], batches[take:]
        if len(batches) == 1:
            b = batches[0]
            nonce = self._use_nonce(sub, b.nonce)
            return _Push(b.response(), sub.type_url, b.version, nonce, b.resources, b.removed)
        nonce = self._next_nonce(sub)
        # Behind by several: each resource once, as its latest batch has it.
        latest: dict[str, Frame | None] = {}
        for b in batches:
            latest.update(b.entries)
        self.cp.stats.coalesced[sub.type_url] += sum(len(b.entries) for b in batches) - len(latest)
        parts = [p for f in latest.values() if f is not None for p in f]
        n = sum(1 for f in latest.values() if f is not None)
        removed = [len_field(6, name.encode()) for name, f in latest.items() if f is None]
        version = batches[-1].version
        parts.extend(removed)
        parts.append(len_field(1, version.encode()))
        parts.append(len_field(4, sub.type_url.encode()))
        parts.append(len_field(5, nonce.encode()))
        return _Push(b"".join(parts), sub.type_url, version, nonce, n, len(removed))

    def build_sotw(self, sub: _Subscription) -> _Push | None:
        if not (sub.full or sub.pending):
            return None
        cache, t = self.cp.cache, sub.type_url
        table = cache.resources(t)
        sub.full, sub.pending = False, set()
        names = sorted(table) if sub.wildcard else sorted(n for n in sub.names if n in table)
        # Every response carries the full subscribed set, so absence means removal (as LDS
        # and CDS). meshd's types carry no name of their own, so they travel wrapped in
        # envoy.service.discovery.v3.Resource (name + version), which SotW clients accept.
        # (So a response is not bounded by max_response_bytes: it is the whole set.)
        frame = self.cp._frames.sotw
        if t == PREFIX_DIGEST_TYPE:
            parts = self._sotw_digests(sub, names, table)
        else:
            parts = [p for name in names for p in frame(table[name])]
        version = str(cache.type_version(t))
        nonce = self._next_nonce(sub)
        parts.append(len_field(1, version.encode()))  # version_info
        parts.append(len_field(4, t.encode()))  # type_url
        parts.append(len_field(5, nonce.encode()))  # nonce
        return _Push(b"".join(parts), t, version, nonce, len(names), 0)

    def _sotw_digests(
        self, sub: _Subscription, names: list[str], table: Mapping[str, Resource]
    ) -> list[bytes]:
        """build_sotw's frames for PrefixDigests: as build_delta, a subscriber lacking the
        base of a delta gets the base in its place and the delta in the next response
        (`sub.sent`, unused otherwise in state-of-the-world, says what it holds)."""
        bases, frame, sent = self.cp._digest_bases, self.cp._frames.sotw, sub.sent
        parts: list[bytes] = []
        for name in names:
            r = table[name]
            chain = bases.needed(name, r, sent.get(name))
            if chain is None:
                sent[name] = r.version
                parts += frame(r)
            else:
                sent[name] = chain.base.version
                parts += chain.sotw_frame()
                sub.pending.add(name)
                self.cp.stats.digest_bases_sent += 1
        for name in [n for n in sent if n not in table]:
            del sent[name]
        return parts

    async def write_loop(self, write: Callable[[bytes], Any]) -> None:
        limit = self.cp.limits.max_unacked_per_type
        tracer = self.cp._tracer
        while True:
            await self.wake.wait()
            self.wake.clear()
            for sub in list(self.subs.values()):
                if len(sub.unacked) >= limit:
                    continue
                push = self.next_push(sub)
                if push is None:
                    continue
                if tracer is not None:
                    self._start_push_span(tracer, push)
                await write(push.payload)
                # Not held while this loop waits (a subscriber's first response is its
                # own, the whole state: many joining at once would each keep theirs).
                del push
                # A push changes what wait_until predicates see (unacked responses): wake
                # them here too, not only when a request arrives (a client that never
                # answers sends none).
                await self.cp._notify_waiters()

    # -- tracing (only with a tracer provider) -------------------------------------------

    def _start_push_span(self, tracer: Any, push: _Push) -> None:
        from xds import spans as tm

        attrs: dict[str, Any] = {
            tm.ATTR_XDS_TYPE_URL: push.type_url,
            tm.ATTR_XDS_VERSION: push.version,
            tm.ATTR_XDS_NONCE: push.nonce,
            tm.ATTR_XDS_RESOURCES: push.resources,
            tm.ATTR_XDS_REMOVED: push.removed,
            tm.ATTR_XDS_DELTA: self.delta,
            tm.ATTR_XDS_NODE: self.node_id,
        }
        # Open until the client ACKs or NACKs it: the span's length is the round trip.
        self._push_spans[push.nonce] = tracer.start_span(tm.SPAN_XDS_PUSH, attributes=attrs)

    def _end_push_span(self, nonce: str, error: Any | None) -> None:
        span = self._push_spans.pop(nonce, None)
        if span is None:
            return
        from xds import spans as tm

        if error is not None:
            span.set_attribute(tm.ATTR_XDS_NACK, error.message)
            span.add_event(tm.EVENT_XDS_NACK, {tm.ATTR_XDS_NACK: error.message})
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, "NACK"))
        span.end()

    def end_spans(self) -> None:
        """End the spans of responses never answered (the stream closed)."""
        if not self._push_spans:
            return
        from xds import spans as tm

        for span in self._push_spans.values():
            span.set_attribute(tm.ATTR_XDS_UNANSWERED, True)
            span.end()
        self._push_spans.clear()

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


def _raw(payload: bytes) -> bytes:
    return payload


def _ended(task: asyncio.Task[None]) -> str:
    """Why a frames subscriber's writer ended (it ends only once its connection did)."""
    if task.cancelled():
        return "closed"
    exc = task.exception()
    if exc is not None and not isinstance(exc, ConnectionError):
        log.error("frames subscriber's writer failed", exc_info=exc)
    return f"writer ended: {exc!r}"


class _FrameSubscriber:
    """A delta subscription over the frames port (xds/publish_frames.py): the same
    _Stream as a gRPC one, its requests from the connection's reader callback and its
    responses written to the connection (what _serve and _read do for gRPC)."""

    __slots__ = ("cp", "stream", "writer")

    def __init__(self, cp: ControlPlane, conn: Any) -> None:
        self.cp = cp
        self.stream = stream = _Stream(cp, conn.peer(), delta=True)
        cp._streams.add(stream)
        cp.stats.streams_open += 1
        cp.stats.streams_total += 1
        self.writer = asyncio.ensure_future(stream.write_loop(conn.write))
        self.writer.add_done_callback(lambda task: conn.close(_ended(task)))

    def on_frame(self, payload: bytes) -> bool:
        try:
            req = pb.DeltaDiscoveryRequest.FromString(payload)
        except DecodeError as exc:
            log.warning("unreadable subscription request from %s: %s", self.stream.peer, exc)
            return False
        self.cp._on_request(self.stream, req)
        self.cp._notify_waiters_soon()
        return True

    def on_close(self) -> None:
        cp, stream = self.cp, self.stream
        cp._streams.discard(stream)
        for sub in stream.subs.values():
            cp._leave_lockstep(sub)
        cp.stats.streams_open -= 1
        self.writer.cancel()
        stream.end_spans()
        cp._notify_waiters_soon()  # a stream gone changes what predicates see


class _AdsServicer:
    """Both ADS methods; responses leave as the bytes the streams assembled (`_raw`)."""

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
        eds_shards: Sequence[Sequence[str]] = (),
        eds_shard_stale_s: float = 30.0,
        eds_shard_unfollow_s: float = 60.0,
        shard_credentials: grpc.ChannelCredentials | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracer_provider: Any = None,
    ) -> None:
        """`eds`: also serve the pools as ClusterLoadAssignments (xds/eds.py).
        `eds_shards`: the fleet's other control-plane shards (each its replicas'
        addresses); then the assignments are every shard's engines, the others' followed
        from the first Envoy on (xds/eds_shards.py; `shard_credentials` for their
        channels), a shard unreachable for `eds_shard_stale_s` leaving them; following
        stops once no Envoy has followed this one for `eds_shard_unfollow_s`.
        `tracer_provider`: an OpenTelemetry TracerProvider (meshd.telemetry.setup_tracing);
        then each accepted or refused publish makes a SPAN_XDS_PUBLISH span and each
        response a SPAN_XDS_PUSH span, open until the client answers it (a NACK sets
        ATTR_XDS_NACK and an event). None (the default): no spans, and no tracing cost."""
        self.cache = cache if cache is not None else SnapshotCache()
        self.limits = limits or ServerLimits()
        self.stats = ServerStats()
        self.eds: EdsView | None = None
        self.eds_shards: ShardedEds | None = None
        if eds and eds_shards:
            from xds.eds_shards import ShardedEds  # (it imports xds.client, which imports us)

            self.eds = EdsView(self.cache, deferred=True, type_url=SHARD_CLA_TYPE)
            self.eds_shards = ShardedEds(
                self.cache,
                eds_shards,
                stale_after_s=eds_shard_stale_s,
                credentials=shard_credentials,
                on_change=self._eds_shards_changed,
                clock=clock,
                followed=self._envoy_follows,
                unfollow_after_s=eds_shard_unfollow_s,
            )
        elif eds:
            self.eds = EdsView(self.cache, deferred=True)
        self._eds_ready_seen = False
        self._tracer = tracer_provider.get_tracer("meshd.xds") if tracer_provider else None
        self._clock = clock
        self._server: aio.Server | None = None
        self._streams: set[_Stream] = set()
        self._events = asyncio.Condition()
        self._waiters = 0  # coroutines in wait_until (requests notify only when there are)
        self._notifying: set[asyncio.Task[None]] = set()
        self._frames = _Frames()
        self._digest_bases = _DigestBases()
        self._dirty: dict[str, set[str]] = {}  # type URL -> names changed since the flush
        self._flush_handle: asyncio.Handle | None = None
        self._flushing = False
        self._last_flush = float("-inf")
        self._lockstep: dict[str, _Lockstep] = {}  # type URL -> its lockstep group
        self._batch_nonces = itertools.count(1)  # "b1", "b2"...: no stream's own nonce
        self._unwatch = self.cache.watch(self._on_change)
        self._published_at: dict[str, float] = {}  # resource name -> last publish
        self._sweeper: asyncio.Task[None] | None = None
        self._frame_server: FramePublishServer | None = None
        self._advertised: tuple[tuple[str, str], ...] = ()
        self.port = 0
        self.publish_port = 0  # the frames publish port, once started with one

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
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TlsConfig | None = None,
        *,
        publish_port: int | None = None,
    ) -> int:
        """Bind and serve; returns the port (useful with port 0). `publish_port`: also
        take agents' publishes as frames on this port (0: any free one; the same host
        and TLS), advertised on the gRPC publish stream (xds/publish_frames.py)."""
        server = aio.server(options=self.grpc_options())
        ads = _AdsServicer(self)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    ADS_SERVICE,
                    {
                        "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
                            ads.StreamAggregatedResources,
                            request_deserializer=pb.DiscoveryRequest.FromString,
                            response_serializer=_raw,
                        ),
                        "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
                            ads.DeltaAggregatedResources,
                            request_deserializer=pb.DeltaDiscoveryRequest.FromString,
                            response_serializer=_raw,
                        ),
                    },
                ),
            )
        )
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
        if publish_port is not None:
            lim = self.limits
            frames = FramePublishServer(
                self._ingest_frame,
                subscribe=self._subscribe_frames,
                max_frame_bytes=lim.max_message_bytes,
                ssl_context=tls.ssl_context() if tls is not None else None,
                handshake_timeout_s=lim.handshake_timeout_s,
                keepalive_time_s=lim.keepalive_time_s,
                keepalive_timeout_s=lim.keepalive_timeout_s,
            )
            self.publish_port = frames.start(host, publish_port)
            self._frame_server = frames
            self._advertised = ((ADVERTISE_KEY, str(self.publish_port)),)
        await server.start()
        self._server, self.port = server, bound
        if self.limits.resource_ttl_s is not None and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._sweep_loop(self.limits.resource_ttl_s))
        log.info(
            "control plane listening on %s:%d (%s)", host, bound, "mTLS" if tls else "plaintext"
        )
        if self._frame_server is not None:
            log.info("publish frames on %s:%d", host, self.publish_port)
        return bound

    async def stop(self, grace: float | None = None) -> None:
        if self.eds_shards is not None:
            await self.eds_shards.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._frame_server is not None:
            self._frame_server.close()
            self._frame_server = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- publishing -----------------------------------------------------------------------

    def validate(self, type_url: str, resources: Mapping[str, bytes]) -> dict[str, Any]:
        """Raise ResourceError unless every resource decodes as `type_url`; returns the
        decoded values by name (empty for a type without a decoder; a PrefixDigest's
        header only, its hashes checked but left packed)."""
        if type_url not in self.limits.accepted_types:
            raise ResourceError(f"type {type_url!r} not accepted")
        decoder = _VALIDATORS.get(type_url)
        values: dict[str, Any] = {}
        for name, body in resources.items():
            if not name:
                raise ResourceError("resource without a name")
            if decoder is not None:
                try:
                    values[name] = decoder(body)
                except ResourceError as exc:
                    raise ResourceError(f"{name}: {exc}") from None
        return values

    def published_age(self, name: str) -> float | None:
        """Seconds since a resource of this name was last published (None: never, or
        expired): how fresh a sidecar's PoolDemandReport is."""
        at = self._published_at.get(name)
        return None if at is None else self._clock() - at

    def publish(
        self, type_url: str, resources: Mapping[str, bytes], removed: tuple[str, ...] = ()
    ) -> frozenset[str]:
        """Validate then apply a batch (all or nothing); returns the names changed."""
        values = self.validate(type_url, resources)
        now = self._clock()
        for name in resources:
            self._published_at[name] = now
        if self.eds is not None and type_url == ENDPOINT_STATE_TYPE:
            for name, value in values.items():
                if isinstance(value, EndpointState):
                    self.eds.hint(name, resources[name], value)
        changed = self.cache.update(type_url, resources, removed)
        if type_url == PREFIX_DIGEST_TYPE:
            # Before any flush (the cache's watcher only schedules one).
            for name, value in values.items():
                r = self.cache.get(type_url, name)
                if isinstance(value, DigestHeader) and r is not None:
                    self._digest_bases.published(name, value, r)
        return changed

    # -- fan-out --------------------------------------------------------------------------

    def _eds_wanted(self) -> bool:
        """Whether a stream follows the EDS view, or another shard this one's part of it
        (else it waits, dirty, until one does or it is read: an engine's publish costs
        nothing for EDS while no Envoy listens)."""
        if self.eds_shards is not None and self.eds_shards.started:
            return True
        return any(CLA_TYPE in s.subs or SHARD_CLA_TYPE in s.subs for s in self._streams)

    def _envoy_follows(self) -> bool:
        """Whether a stream (an Envoy) follows the EDS view now."""
        return any(CLA_TYPE in s.subs for s in self._streams)

    def eds_ready(self) -> bool:
        """Whether Envoy may have the EDS view: always, but with shards not before every
        other shard answered once (or a timeout: ShardedEds.ready)."""
        return self.eds_shards is None or self.eds_shards.ready()

    def _eds_shards_changed(self) -> None:
        if not self._flushing and self._flush_handle is None:
            self._schedule_flush()

    def _on_change(self, type_url: str, names: frozenset[str]) -> None:
        pending = self._dirty.get(type_url)
        if pending is None:
            self._dirty[type_url] = set(names)
        else:
            pending |= names
        if not self._flushing and self._flush_handle is None:
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop, so no streams: the next flush (or `flush()`) takes it
        due = self._last_flush + self.limits.push_interval_s
        if due <= loop.time():
            self._flush_handle = loop.call_soon(self.flush)
        else:
            self._flush_handle = loop.call_at(due, self.flush)

    def flush(self) -> None:
        """Hand the changes collected since the last flush to every stream (the event loop
        calls it; a test may call it to skip the wait)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        shards = self.eds_shards
        if self.eds is not None and self._eds_wanted():
            self._flushing = True
            try:
                self.eds.flush()  # its assignments join this flush
                if shards is not None:
                    shards.flush()  # and the shards' merge, which they change
            finally:
                self._flushing = False
            if shards is not None and not self._eds_ready_seen and shards.ready():
                self._eds_ready_seen = True  # Envoys waiting for their first view get it
                for stream in self._streams:
                    if CLA_TYPE in stream.subs:
                        stream.wake.set()
        with contextlib.suppress(RuntimeError):
            self._last_flush = asyncio.get_running_loop().time()
        dirty, self._dirty = self._dirty, {}
        streams = list(self._streams)
        for type_url, names in dirty.items():
            frozen = frozenset(names)
            table = self.cache.resources(type_url)
            group = self._lockstep.get(type_url)
            if group is not None:
                self._step(type_url, group, frozen, table)
            self._frames.forget(type_url, frozen, table)
            if type_url == PREFIX_DIGEST_TYPE:
                self._digest_bases.forget(frozen, table)
            for stream in streams:
                stream.on_change(type_url, frozen)  # lockstep members ignore it

    # -- lockstep (delta wildcard subscribers that hold the same versions) ---------------

    def _step(
        self, t: str, group: _Lockstep, names: frozenset[str], table: Mapping[str, Resource]
    ) -> None:
        sent, frame = group.sent, self._frames.delta
        bases = self._digest_bases if t == PREFIX_DIGEST_TYPE else None
        # (name, frame, its size, whether it is a full digest deltas build on)
        changes: list[tuple[str, Frame, int, bool]] = []
        removed: list[str] = []
        again: list[str] = []  # names whose delta waits for the next flush
        for name in names:
            r = table.get(name)
            old = sent.get(name)
            if r is None:
                if old is not None:
                    del sent[name]
                    removed.append(name)
            elif old != r.version:
                if bases is not None and (chain := bases.needed(name, r, old)) is not None:
                    # The group lacks the base (coalesced away): it goes now, the delta
                    # with the next flush.
                    sent[name] = chain.base.version
                    f, n = chain.delta_frame()
                    changes.append((name, f, n, True))
                    again.append(name)
                    self.stats.digest_bases_sent += len(group.members)
                else:
                    sent[name] = r.version
                    _, f, n = frame(r)
                    changes.append((name, f, n, bases is not None and bases.is_base(name, r)))
        if not changes and not removed:
            return
        if again:
            self._on_change(t, frozenset(again))
        batches = self._batches(t, changes, removed)
        behind: list[_Subscription] = []
        for sub, stream in group.members.items():
            sub.backlog.extend(batches)
            if len(sub.backlog) > MAX_BACKLOG:
                behind.append(sub)
            stream.wake.set()
        for sub in behind:
            self._leave_lockstep(sub)

    def _batches(
        self, t: str, changes: list[tuple[str, Frame, int, bool]], removed: list[str]
    ) -> list[_Batch]:
        """A flush's changes as lockstep batches of at most max_response_bytes of frames
        (at least one resource each; the removals go with the last)."""
        limit = self.limits.max_response_bytes
        chunks: list[list[tuple[str, Frame, int, bool]]] = [[]]
        size = 0
        for change in changes:
            if chunks[-1] and size + change[2] > limit:
                chunks.append([])
                size = 0
            chunks[-1].append(change)
            size += change[2]
        version = str(self.cache.type_version(t))
        trailer = len_field(1, version.encode()) + len_field(4, t.encode())
        out: list[_Batch] = []
        for k, chunk in enumerate(chunks):
            gone = removed if k == len(chunks) - 1 else []
            nonce = f"b{next(self._batch_nonces)}"
            parts = [p for _, f, _, _ in chunk for p in f]
            parts.extend(len_field(6, name.encode()) for name in gone)  # removed_resources
            parts.append(trailer)  # system_version_info, type_url
            parts.append(len_field(5, nonce.encode()))
            entries: list[tuple[str, Frame | None]] = [(name, f) for name, f, _, _ in chunk]
            entries.extend((name, None) for name in gone)
            out.append(
                _Batch(
                    tuple(parts),
                    sum(map(len, parts)),
                    version,
                    nonce,
                    len(chunk),
                    len(gone),
                    tuple(entries),
                    frozenset(name for name, _, _, base in chunk if base),
                )
            )
        return out

    def _join_lockstep(self, sub: _Subscription, stream: _Stream) -> None:
        """Make an idle delta wildcard subscription a member when it holds the group's
        versions (a group is made of it when there is none)."""
        t = sub.type_url
        group = self._lockstep.get(t)
        if group is None:
            # Its versions become the group's: with nothing pending, all it lacks is what
            # changed since the last flush, which the next flush's batch carries.
            group = self._lockstep[t] = _Lockstep(sub.sent)
        elif sub.sent != group.sent:
            return
        sub.lockstep, sub.sent = group, {}
        group.members[sub] = stream

    def _leave_lockstep(self, sub: _Subscription) -> None:
        """Back on its own, holding the group's versions. Its backlog (whose versions those
        include) still goes out first, as its next response."""
        group = sub.lockstep
        if group is None:
            return
        group.members.pop(sub, None)
        sub.lockstep, sub.sent = None, dict(group.sent)
        if not group.members and self._lockstep.get(sub.type_url) is group:
            del self._lockstep[sub.type_url]

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
        # context.read(), not the request iterator: grpc's iterator holds the message it
        # gave last until the next one arrives, and so did this loop. A node's full digests
        # are MBs, whose bodies the cache holds by now: held once more per agent link, they
        # doubled the RSS after a restart (loadtest/xds_memory_bench.py, 1,000 engines of
        # 40,000 blocks over 125 links: 678-686 MiB settled, the hashes being 305).
        del request_iterator
        if self._advertised:
            await context.send_initial_metadata(self._advertised)
        while (msg := await context.read()) is not aio.EOF:
            reply = self._ingest(msg, context.peer)
            del msg
            yield reply

    def _ingest_frame(self, payload: bytes, peer: Callable[[], str]) -> bytes | None:
        """A publish message from the frames port: its ACK or NACK, serialized; None for
        bytes that are no DeltaDiscoveryResponse (the connection ends, as gRPC's stream
        does for a message it cannot deserialize)."""
        try:
            msg = pb.DeltaDiscoveryResponse.FromString(payload)
        except DecodeError as exc:
            log.warning("unreadable publish message from %s: %s", peer(), exc)
            return None
        return self._ingest(msg, peer).SerializeToString()

    def _ingest(
        self, msg: pb.DeltaDiscoveryResponse, peer: Callable[[], str]
    ) -> pb.DeltaDiscoveryRequest:
        """Apply one publish message; its ACK, or its NACK saying why it was refused."""
        tracer = self._tracer
        reply = pb.DeltaDiscoveryRequest(type_url=msg.type_url, response_nonce=msg.nonce)
        started_ns = time.time_ns() if tracer is not None else 0
        sampled = self.stats.publishes % max(1, self.limits.publish_trace_every) == 0
        changed: frozenset[str] = frozenset()
        error: str | None = None
        try:
            upserts: dict[str, bytes] = {}
            for r in msg.resources:
                if r.resource.type_url != msg.type_url:
                    raise ResourceError(
                        f"{r.name}: Any type {r.resource.type_url!r} != {msg.type_url!r}"
                    )
                upserts[r.name] = r.resource.value
            changed = self.publish(msg.type_url, upserts, tuple(msg.removed_resources))
            self.stats.publishes += 1
        except ResourceError as exc:
            error = str(exc)
            self.stats.publishes_rejected += 1
            self.stats.last_publish_error = error
            log.warning("refused publish from %s: %s", peer(), exc)
            reply.error_detail.code = _INVALID_ARGUMENT
            reply.error_detail.message = error
        if tracer is not None and (sampled or error is not None):
            self._trace_publish(tracer, started_ns, msg, changed, error, peer())
        return reply

    def _trace_publish(
        self,
        tracer: Any,
        started_ns: int,
        msg: pb.DeltaDiscoveryResponse,
        changed: frozenset[str],
        error: str | None,
        peer: str,
    ) -> None:
        from xds import spans as tm

        t = msg.type_url
        attrs: dict[str, Any] = {
            tm.ATTR_XDS_TYPE_URL: t,
            tm.ATTR_XDS_NONCE: msg.nonce,
            tm.ATTR_XDS_RESOURCES: len(msg.resources),
            tm.ATTR_XDS_REMOVED: len(msg.removed_resources),
            tm.ATTR_XDS_CHANGED: len(changed),
            tm.ATTR_XDS_VERSION: str(self.cache.type_version(t)),
            tm.ATTR_XDS_PEER: peer,
        }
        names = [r.name for r in msg.resources[:8]]
        if names:
            attrs[tm.ATTR_ENGINE] = names[0] if len(names) == 1 else names
        span = tracer.start_span(tm.SPAN_XDS_PUBLISH, start_time=started_ns, attributes=attrs)
        if error is not None:
            span.set_attribute(tm.ATTR_REASON, error)
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, "publish refused"))
        span.end()

    # -- streams --------------------------------------------------------------------------

    async def _serve(
        self, stream: _Stream, requests: AsyncIterator[Any], context: aio.ServicerContext
    ) -> None:
        # Headers now, so a client knows it is connected before any response; a delta
        # subscriber's say where the frames port is (xds/client.py moves there).
        await context.send_initial_metadata(self._advertised if stream.delta else ())
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
            self._streams.discard(stream)
            for sub in stream.subs.values():
                self._leave_lockstep(sub)
            self.stats.streams_open -= 1
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            stream.end_spans()
            await self._notify_waiters()  # a stream gone changes what predicates see

    async def _read(self, stream: _Stream, requests: AsyncIterator[Any]) -> None:
        async for req in requests:
            self._on_request(stream, req)
            await self._notify_waiters()

    def _on_request(self, stream: _Stream, req: Any) -> None:
        self.stats.requests += 1
        if not stream.node_id and req.node.id:
            stream.node_id = req.node.id
        if not req.type_url:
            log.warning("request without type_url from %s ignored", stream.peer)
        elif stream.delta:
            stream.on_delta_request(req)
        else:
            stream.on_sotw_request(req)

    def _subscribe_frames(self, conn: Any) -> _FrameSubscriber:
        """A subscriber's connection on the frames port (xds/publish_frames.py)."""
        return _FrameSubscriber(self, conn)

    async def _notify_waiters(self) -> None:
        if self._waiters:
            async with self._events:
                self._events.notify_all()

    def _notify_waiters_soon(self) -> None:
        """_notify_waiters from a callback (a frames subscriber's reader)."""
        if self._waiters:
            task = asyncio.ensure_future(self._notify_waiters())
            self._notifying.add(task)
            task.add_done_callback(self._notifying.discard)

    # -- introspection --------------------------------------------------------------------

    def streams(self) -> list[StreamInfo]:
        return [i for s in list(self._streams) for i in s.info()]

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; it is re-checked after every request handled."""
        self._waiters += 1
        try:
            async with self._events:
                await self._events.wait_for(predicate)
        finally:
            self._waiters -= 1
