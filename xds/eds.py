"""The Envoy-consumable view of the engines: one `ClusterLoadAssignment` (EDS) per pool,
derived from the EndpointState resources in the SnapshotCache and kept in the same cache
under the EDS type URL, so any Envoy that asks for the pool by name over ADS (SotW or
delta; envoy/eds.yaml) balances with it.

Per engine, one `LbEndpoint`:

- address: the engine's `address` (an IP and a port: Envoy does not resolve names that EDS
  gives it; an engine published under a host name is left out and counted in `skipped`);
- health_status: UNHEALTHY when the engine fails its health check, DRAINING when it is
  draining (Envoy sends neither new requests), else HEALTHY;
- load_balancing_weight: capacity x headroom, see `weight`;
- locality: sub_zone = the GPU generation, so a locality-aware Envoy config can keep
  traffic on one generation; metadata `filter_metadata["meshd"]`: engine, pool, model,
  GPU, GPU count, memory and KV capacity, epoch, draining, and the weight's inputs.

Only what moves slowly goes into the view: weights are quantised (`WEIGHT_STEPS`) and the
per-request figures (running requests, tokens in flight) stay out of the metadata, so an
engine whose load moves within a step does not make every Envoy re-read its pool. Pure
state (a cache watcher), no I/O.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from envoy.config.core.v3 import address_pb2, base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import struct_pb2

from filters.gpu import GPUS, UNKNOWN
from xds.cache import SnapshotCache
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState, ResourceError, decode_endpoint_state
from xds.wire import len_field as _len_field
from xds.wire import varint

__all__ = [
    "CLA_TYPE",
    "METADATA_NAMESPACE",
    "SHARD_CLA_TYPE",
    "EdsEntry",
    "EdsView",
    "Framed",
    "encode_assignment",
    "encode_groups",
    "entry_for",
    "weight",
]

log = logging.getLogger("meshd.xds.eds")

CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# A shard's own engines of a pool, as a ClusterLoadAssignment named by the pool: what each
# shard of a sharded fleet follows of the others (xds/eds_shards.py).
SHARD_CLA_TYPE = "type.googleapis.com/meshd.v1.ShardLoadAssignment"
METADATA_NAMESPACE = "meshd"
_NAMESPACE_BYTES = METADATA_NAMESPACE.encode()
# Weight per GPU at full headroom, for a GPU of the reference ("unknown": A100) speed.
WEIGHT_PER_GPU = 10
# Headroom is rounded up to a multiple of 1 / WEIGHT_STEPS before it scales the weight.
WEIGHT_STEPS = 10
MAX_WEIGHT = 1_000_000  # Envoy's sum over a locality must stay below 2**32


def weight(state: EndpointState) -> int:
    """`load_balancing_weight`: capacity x headroom, at least 1.

    capacity = GPUs x the GPU's prefill speed relative to the reference GPU (filters/gpu.py)
    x WEIGHT_PER_GPU; headroom = free KV fraction / (1 + requests waiting per running
    slot taken), rounded up to a step. An idle H100 weighs 32, one at 75 % KV usage 10.
    """
    profile = GPUS.get(state.gpu or "", UNKNOWN)
    speed = profile.prefill_tokens_per_s / UNKNOWN.prefill_tokens_per_s
    capacity = max(1, state.gpu_count) * speed * WEIGHT_PER_GPU
    kv_free = 1.0 - (state.kv_usage or 0.0)
    queue = state.requests_waiting / max(1, state.requests_running)
    headroom = kv_free / (1.0 + queue)
    stepped = math.ceil(max(0.0, headroom) * WEIGHT_STEPS - 1e-9) / WEIGHT_STEPS
    return max(1, min(MAX_WEIGHT, round(capacity * stepped)))


@dataclass(frozen=True, slots=True)
class EdsEntry:
    """What of one engine goes into its pool's assignment (equal entries: no update)."""

    engine: str
    pool: str
    host: str
    port: int
    health: int  # envoy.config.core.v3.HealthStatus
    weight: int
    gpu: str
    gpu_count: int
    model: str
    epoch: str
    memory_total_bytes: int | None
    kv_capacity_tokens: int | None
    draining: bool
    # The serialized LbEndpoint, framed as field 2 of LocalityLbEndpoints (lb_endpoints).
    lb_endpoint: bytes = field(default=b"", compare=False, repr=False)


@functools.lru_cache(maxsize=65536)  # an engine's address rarely changes: parse it once
def _split_address(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host, int(port)


def entry_for(name: str, state: EndpointState) -> EdsEntry | None:
    """The engine's EDS entry, or None when its address is not IP:port."""
    hp = _split_address(state.address)
    if hp is None:
        return None
    if not state.healthy:
        health = health_check_pb2.UNHEALTHY
    elif state.draining:
        health = health_check_pb2.DRAINING
    else:
        health = health_check_pb2.HEALTHY
    kv_cap = (
        state.kv_block_size * state.kv_capacity_blocks
        if state.kv_block_size is not None and state.kv_capacity_blocks is not None
        else None
    )
    entry = EdsEntry(
        engine=name,
        pool=state.pool,
        host=hp[0],
        port=hp[1],
        health=health,
        weight=weight(state),
        gpu=state.gpu or "unknown",
        gpu_count=state.gpu_count,
        model=state.model,
        epoch=state.epoch,
        memory_total_bytes=state.memory_total_bytes,
        kv_capacity_tokens=kv_cap,
        draining=state.draining,
    )
    return entry


def _with_bytes(entry: EdsEntry) -> EdsEntry:
    """entry with its serialized LbEndpoint; `entry` must be fresh (from entry_for, not yet
    shared): the bytes are set on it in place, dataclasses.replace costing more than all
    the encoding."""
    object.__setattr__(entry, "lb_endpoint", _len_field(2, _lb_endpoint(entry)))
    return entry


def _lb_endpoint_reference(e: EdsEntry) -> bytes:
    """The LbEndpoint as protobuf builds it (what `_lb_endpoint` must equal; tests)."""
    lb = endpoint_components_pb2.LbEndpoint()
    sa = lb.endpoint.address.socket_address
    sa.address, sa.port_value = e.host, e.port
    sa.protocol = address_pb2.SocketAddress.TCP
    lb.health_status = e.health
    lb.load_balancing_weight.value = e.weight
    lb.metadata.filter_metadata[METADATA_NAMESPACE].CopyFrom(_metadata(e, with_weight=True))
    out: bytes = lb.SerializeToString(deterministic=True)
    return out


def _metadata(e: EdsEntry, *, with_weight: bool) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.update(
        {
            "engine": e.engine,
            "pool": e.pool,
            "model": e.model,
            "gpu": e.gpu,
            "gpu_count": e.gpu_count,
            "epoch": e.epoch,
            "draining": e.draining,
        }
    )
    if with_weight:
        meta["weight"] = e.weight
    if e.memory_total_bytes is not None:
        meta["memory_total_bytes"] = e.memory_total_bytes
    if e.kv_capacity_tokens is not None:
        meta["kv_capacity_tokens"] = e.kv_capacity_tokens
    return meta


@functools.lru_cache(maxsize=65536)
def _endpoint_field(host: str, port: int) -> bytes:
    lb = endpoint_components_pb2.LbEndpoint()
    sa = lb.endpoint.address.socket_address
    sa.address, sa.port_value = host, port
    sa.protocol = address_pb2.SocketAddress.TCP
    out: bytes = lb.SerializeToString(deterministic=True)
    return out


_StaticFacts = tuple[str, str, str, str, int, str, bool, int | None, int | None]


@functools.lru_cache(maxsize=16384)
def _static_struct(facts: _StaticFacts) -> bytes:
    """The metadata Struct's entries but "weight", for one engine's slow-moving facts."""
    engine, pool, model, gpu, gpu_count, epoch, draining, memory, kv_cap = facts
    e = EdsEntry(engine, pool, "", 0, 0, 0, gpu, gpu_count, model, epoch, memory, kv_cap, draining)
    out: bytes = _metadata(e, with_weight=False).SerializeToString(deterministic=True)
    return out


@functools.lru_cache(maxsize=4096)
def _weight_fields(w: int) -> tuple[bytes, bytes]:
    """The "weight" entry of the metadata Struct, and LbEndpoint.load_balancing_weight."""
    entry = struct_pb2.Struct()
    entry["weight"] = w
    return entry.SerializeToString(deterministic=True), _len_field(4, b"\x08" + varint(w))


def _lb_endpoint(e: EdsEntry) -> bytes:
    """The LbEndpoint, assembled from parts cached per address, per engine's static facts
    and per weight: the bytes protobuf's deterministic serialization gives (fields by
    number; Struct map entries by key, and "weight" sorts after every other key), at a
    fraction of building a Struct per change."""
    weight_entry, weight_field = _weight_fields(e.weight)
    facts = (
        e.engine,
        e.pool,
        e.model,
        e.gpu,
        e.gpu_count,
        e.epoch,
        e.draining,
        e.memory_total_bytes,
        e.kv_capacity_tokens,
    )
    struct = _static_struct(facts) + weight_entry
    meta = _len_field(1, _len_field(1, _NAMESPACE_BYTES) + _len_field(2, struct))
    health = b"\x10" + varint(e.health) if e.health else b""
    return _endpoint_field(e.host, e.port) + health + _len_field(3, meta) + weight_field


def encode_assignment(pool: str, entries: Iterable[EdsEntry]) -> bytes:
    """The pool's serialized ClusterLoadAssignment: one locality per GPU generation
    (sub_zone), engines by name; the bytes ClusterLoadAssignment.SerializeToString gives.

    EdsView assembles it from each engine's LbEndpoint as serialized when that engine's
    entry changed, so a change in a pool of a hundred engines costs a join, not a hundred
    encodings: a publish with the view on went from 1,089 us to 65 us (8.5 us with it off),
    1000 engines in pools of 100, each change moving a weight (the bench's engine bodies,
    2-core dev box).
    """
    by_gpu: dict[str, list[EdsEntry]] = {}
    for e in sorted(entries, key=lambda e: e.engine):
        by_gpu.setdefault(e.gpu, []).append(e if e.lb_endpoint else _with_bytes(e))
    return encode_groups(pool, [(gpu, by_gpu[gpu]) for gpu in sorted(by_gpu)])


class Framed(Protocol):
    """An engine's serialized LbEndpoint, framed as LocalityLbEndpoints.lb_endpoints."""

    @property
    def lb_endpoint(self) -> bytes: ...


def encode_groups(pool: str, groups: Iterable[tuple[str, Iterable[Framed]]]) -> bytes:
    """The pool's serialized ClusterLoadAssignment from its engines' LbEndpoints grouped by
    GPU generation (one locality each, sub_zone = the GPU), in the order given."""
    parts = [_len_field(1, pool.encode())]  # cluster_name
    for gpu, entries in groups:
        locality = base_pb2.Locality(sub_zone=gpu).SerializeToString()
        body = _len_field(1, locality) + b"".join([e.lb_endpoint for e in entries])
        parts.append(_len_field(2, body))  # endpoints
    return b"".join(parts)


class EdsView:
    """Keeps one ClusterLoadAssignment per pool in `cache`, following its EndpointStates.

    An engine with no pool goes into the pool named `default_pool`. A pool whose last
    engine left is kept as an empty assignment (Envoy then has no hosts for it, rather
    than its last ones) until `drop_empty` is called for it.

    With `deferred=True` a change only marks the engine dirty, and `flush()` (which the
    control plane calls once per fan-out, and `assignment` calls first) rebuilds the pools
    touched since: an engine that published ten times in between costs one decode and its
    pool one encoding, and Envoy one update (Istio's push debounce does the same, for the
    same reason). `hint(name, body, state)` hands over a body's decoded state (the control
    plane decodes every publish to validate it), used when the cache still holds that body.
    """

    def __init__(
        self,
        cache: SnapshotCache,
        *,
        default_pool: str = "default",
        deferred: bool = False,
        type_url: str = CLA_TYPE,
    ) -> None:
        """`type_url`: what the assignments are kept under (a shard of a sharded fleet
        keeps its own engines' under xds/eds_shards.py's SHARD_CLA_TYPE, and serves Envoy
        every shard's, merged)."""
        self.cache = cache
        self.type_url = type_url
        self.default_pool = default_pool
        self.deferred = deferred
        self._entries: dict[str, EdsEntry] = {}  # engine name -> its entry
        self._pools: dict[str, set[str]] = {}  # pool -> engine names
        # pool -> its engines grouped by GPU, in assignment order (None: membership changed)
        self._order: dict[str, list[tuple[str, list[str]]] | None] = {}
        self._dirty: set[str] = set()  # engines changed since the last flush (deferred)
        self._hints: dict[str, tuple[bytes, EndpointState]] = {}
        self._skipped: set[str] = set()  # engines whose address Envoy could not use
        self.rebuilds = 0
        self._unwatch = cache.watch(self._on_change)
        self._apply(frozenset(cache.resources(ENDPOINT_STATE_TYPE)))

    def close(self) -> None:
        self._unwatch()

    def pools(self) -> list[str]:
        self.flush()
        return sorted(self._pools)

    @property
    def skipped(self) -> frozenset[str]:
        """Engines left out because their address is not IP:port."""
        self.flush()
        return frozenset(self._skipped)

    def assignment(self, pool: str) -> endpoint_pb2.ClusterLoadAssignment | None:
        self.flush()
        r = self.cache.get(self.type_url, pool)
        return None if r is None else endpoint_pb2.ClusterLoadAssignment.FromString(r.body)

    def hint(self, name: str, body: bytes, state: EndpointState) -> None:
        self._hints[name] = (body, state)

    @property
    def dirty(self) -> bool:
        return bool(self._dirty)

    def flush(self) -> None:
        """Rebuild the pools of the engines changed since the last flush (deferred mode)."""
        if self._dirty:
            names, self._dirty = frozenset(self._dirty), set()
            self._apply(names)

    def _on_change(self, type_url: str, names: frozenset[str]) -> None:
        if type_url != ENDPOINT_STATE_TYPE:
            return
        if self.deferred:
            self._dirty |= names
        else:
            self._apply(names)

    def _decode(self, name: str, body: bytes) -> EndpointState:
        hinted = self._hints.pop(name, None)
        if hinted is not None and hinted[0] is body:
            return hinted[1]
        return decode_endpoint_state(body)

    def _apply(self, names: frozenset[str]) -> None:
        dirty: set[str] = set()
        for name in names:
            r = self.cache.get(ENDPOINT_STATE_TYPE, name)
            entry = None
            if r is not None:
                try:
                    entry = entry_for(name, self._decode(name, r.body))
                except ResourceError:  # validated on publish; a direct cache write may not be
                    entry = None
                if entry is None:
                    self._skipped.add(name)
                else:
                    self._skipped.discard(name)
            else:
                self._hints.pop(name, None)
                self._skipped.discard(name)
            old = self._entries.get(name)
            if entry == old:
                continue  # nothing Envoy sees changed (lb_endpoint is not compared)
            new_pool = None if entry is None else entry.pool or self.default_pool
            if old is not None:
                old_pool = old.pool or self.default_pool
                dirty.add(old_pool)
                if old_pool != new_pool or old.gpu != (entry.gpu if entry else None):
                    self._pools[old_pool].discard(name)
                    self._order[old_pool] = None
                del self._entries[name]
            if entry is not None and new_pool is not None:
                self._entries[name] = _with_bytes(entry)
                members = self._pools.setdefault(new_pool, set())
                if name not in members:
                    members.add(name)
                    self._order[new_pool] = None
                dirty.add(new_pool)
        if not dirty:
            return
        self.rebuilds += len(dirty)
        self.cache.update(self.type_url, {pool: self._encode_pool(pool) for pool in dirty})

    def _encode_pool(self, pool: str) -> bytes:
        order = self._order.get(pool)
        if order is None:
            by_gpu: dict[str, list[str]] = {}
            for n in sorted(self._pools.get(pool, ())):
                by_gpu.setdefault(self._entries[n].gpu, []).append(n)
            order = self._order[pool] = [(g, by_gpu[g]) for g in sorted(by_gpu)]
        entries = self._entries
        return encode_groups(pool, [(g, [entries[n] for n in names]) for g, names in order])

    def drop_empty(self, pool: str) -> bool:
        """Remove an empty pool's assignment; False when it still has engines."""
        self.flush()
        if self._pools.get(pool):
            return False
        self._pools.pop(pool, None)
        self._order.pop(pool, None)
        return self.cache.remove(self.type_url, pool)
