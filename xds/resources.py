"""meshd's own xDS resource types, `EndpointState`, `PrefixDigest` and `PoolDemandReport`:
what each field means, their msgpack encoding (carried as `google.protobuf.Any.value` under a
type URL in meshd's namespace, so no .proto build step), and strict decoding.

Every decoder either returns a value or raises `ResourceError` (never another exception):
the control plane refuses a malformed publish with it and a subscriber NACKs with it.
Unknown map keys are ignored (a newer agent may add fields); a known key of the wrong type
is an error. A missing key takes the field's default.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

from filters.autoscale import PoolDemand, ScalingPolicy
from filters.endpoint_state import ReportedState

__all__ = [
    "DECODERS",
    "ENDPOINT_STATE_TYPE",
    "MAX_RESOURCE_BYTES",
    "POOL_DEMAND_TYPE",
    "PREFIX_DIGEST_TYPE",
    "DigestHeader",
    "EndpointState",
    "PoolDemandReport",
    "PrefixDigest",
    "ResourceError",
    "decode",
    "decode_endpoint_state",
    "decode_pool_demand",
    "decode_prefix_digest",
    "decode_prefix_digest_header",
    "report_name",
]

ENDPOINT_STATE_TYPE = "type.googleapis.com/meshd.v1.EndpointState"
PREFIX_DIGEST_TYPE = "type.googleapis.com/meshd.v1.PrefixDigest"
POOL_DEMAND_TYPE = "type.googleapis.com/meshd.v1.PoolDemand"
SCHEMA_VERSION = 1
# A digest of a 1M-block KV cache is 8 MiB; anything larger is a bug or an attack.
MAX_RESOURCE_BYTES = 16 * 2**20


class ResourceError(ValueError):
    """A resource body that does not decode to its type (the reason is the message)."""


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One engine's state, published by its agent under the engine's name.

    msgpack map, keys exactly the field names below (plus "v": schema version, 1):

    - address: str, "host:port" of the engine's OpenAI-compatible HTTP API (via the inbound
      sidecar when there is one).
    - pool: str, the pool (set of interchangeable engines) it belongs to.
    - model: str, the base model it serves.
    - adapters: map str -> bool, LoRA adapter name -> weights loaded (warm) now.
    - gpu: str | nil, GPU generation ("H100", "A100", ...); nil when unknown.
    - gpu_count: int >= 0, GPUs the engine spans (tensor/pipeline parallel).
    - memory_total_bytes, memory_used_bytes: int >= 0 | nil, GPU memory over all its GPUs.
    - kv_block_size: int > 0 | nil, tokens per KV block.
    - kv_capacity_blocks: int >= 0 | nil, KV blocks the engine can hold.
    - kv_usage: float in [0, 1] | nil, fraction of those in use (vllm:kv_cache_usage_perc).
    - requests_running, requests_waiting: int >= 0 (vllm:num_requests_running/_waiting).
    - tokens_in_flight: int >= 0, prompt + max output tokens of running/waiting requests.
    - ttft_s, tpot_s: float >= 0 | nil, moving averages of time to first token and time
      per output token, in seconds.
    - healthy: bool, the engine answers its health check.
    - draining: bool, finishing its requests, taking no new ones.
    - epoch: str, changes whenever the engine restarts (its KV cache is then empty).
    """

    address: str
    pool: str = ""
    model: str = ""
    adapters: Mapping[str, bool] = field(default_factory=dict)
    gpu: str | None = None
    gpu_count: int = 0
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    kv_block_size: int | None = None
    kv_capacity_blocks: int | None = None
    kv_usage: float | None = None
    requests_running: int = 0
    requests_waiting: int = 0
    tokens_in_flight: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    healthy: bool = True
    draining: bool = False
    epoch: str = ""

    def encode(self) -> bytes:
        d: dict[str, Any] = {"v": SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            d[f.name] = dict(value) if f.name == "adapters" else value
        out: bytes = msgpack.packb(d)
        return out

    def to_reported(self) -> ReportedState:
        """The picker's view (filters.endpoint_state.ReportedState)."""
        return ReportedState(
            epoch=self.epoch,
            healthy=self.healthy,
            draining=self.draining,
            gpu=self.gpu,
            gpu_count=self.gpu_count or None,
            memory_total_bytes=self.memory_total_bytes,
            memory_used_bytes=self.memory_used_bytes,
            kv_block_size=self.kv_block_size,
            kv_capacity_blocks=self.kv_capacity_blocks,
            kv_usage=self.kv_usage,
            requests_running=self.requests_running,
            requests_waiting=self.requests_waiting,
            tokens_in_flight=self.tokens_in_flight,
            ttft_s=self.ttft_s,
            tpot_s=self.tpot_s,
            models={self.model: True} if self.model else {},
            adapters=dict(self.adapters),
        )


@dataclass(frozen=True, slots=True)
class PrefixDigest:
    """The KV blocks an engine holds, published under the engine's name.

    xDS coalesces a slow subscriber's updates to the latest version of each resource, so a
    digest must never depend on an earlier one being seen: a digest is either full (the
    whole set, at a periodic resync or after the engine cleared its cache) or cumulative
    since the last full one, identified by `base_seq`. A subscriber holding the full digest
    of `base_seq` applies `blocks = base - removed | added`; one that does not waits for
    the next full digest. The control plane keeps each engine's last full digest and sends
    it ahead of a delta to a subscriber without it (xds/server.py, _DigestBases), so the
    wait happens only for a base the control plane itself never saw. (The agent keeps the
    cumulative delta small by resyncing when it outgrows a fraction of the full set.)

    msgpack map, keys ("v": schema version, 1):

    - engine: str, the engine's name (as its EndpointState).
    - epoch: str, the engine's epoch; a new epoch starts with a full digest.
    - seq: int >= 0, grows with every digest of this epoch.
    - base_seq: int >= 0, the `seq` of the full digest this one is relative to (== seq
      when full).
    - full: bool.
    - block_size: int > 0, tokens per block.
    - added, removed: bytes, packed little-endian uint64 block hashes (8 bytes each);
      `removed` is empty when full. An engine cache clear is a full digest with nothing
      added.
    """

    engine: str
    epoch: str
    seq: int
    base_seq: int
    full: bool
    block_size: int
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()

    def encode(self) -> bytes:
        out: bytes = msgpack.packb(
            {
                "v": SCHEMA_VERSION,
                "engine": self.engine,
                "epoch": self.epoch,
                "seq": self.seq,
                "base_seq": self.base_seq,
                "full": self.full,
                "block_size": self.block_size,
                "added": _pack_hashes(self.added),
                "removed": _pack_hashes(self.removed),
            }
        )
        return out

    def apply(self, base: set[int]) -> set[int]:
        """The engine's blocks: this digest applied to the full digest it is based on
        (ignored when full)."""
        if self.full:
            return set(self.added)
        return (base - set(self.removed)) | set(self.added)


def _pack_hashes(hashes: tuple[int, ...]) -> bytes:
    try:
        return array("Q", hashes).tobytes()
    except OverflowError as exc:
        raise ResourceError("block hash outside uint64") from exc


def _packed(raw: object, key: str) -> bytes:
    """`raw` if it is packed uint64s (bytes, a multiple of 8 long)."""
    if not isinstance(raw, bytes) or len(raw) % 8:
        raise ResourceError(f"{key}: packed uint64 bytes expected")
    return raw


def _unpack(packed: bytes) -> tuple[int, ...]:
    a = array("Q")
    a.frombytes(packed)
    return tuple(a)


# -- strict decoding ----------------------------------------------------------------------


def _load_map(body: bytes) -> dict[str, Any]:
    if len(body) > MAX_RESOURCE_BYTES:
        raise ResourceError(f"resource of {len(body)} bytes over {MAX_RESOURCE_BYTES}")
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ResourceError(f"not msgpack: {exc}") from None
    if not isinstance(d, dict):
        raise ResourceError("msgpack map expected")
    if d.get("v", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ResourceError(f"unknown schema version {d.get('v')!r}")
    return d


def _str(
    d: Mapping[str, Any], key: str, default: str | None = "", *, optional: bool = False
) -> Any:
    v = d.get(key, default)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise ResourceError(f"{key}: string expected, got {type(v).__name__}")
    return v


def _int(d: Mapping[str, Any], key: str, default: int | None = 0, *, optional: bool = False) -> Any:
    v = d.get(key, default)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ResourceError(f"{key}: non-negative integer expected, got {v!r}")
    return v


def _float(d: Mapping[str, Any], key: str, hi: float = math.inf) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= v <= hi:
        raise ResourceError(f"{key}: number in [0, {hi}] expected, got {v!r}")
    return float(v)


def _bool(d: Mapping[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ResourceError(f"{key}: bool expected, got {v!r}")
    return v


def _decode_endpoint_state_checked(body: bytes) -> EndpointState:
    """Field by field, in a fixed order: the error a malformed body gets is the first
    failing check's. decode_endpoint_state falls back to this for anything it does not
    accept on its fast path."""
    d = _load_map(body)
    adapters = d.get("adapters", {})
    if not isinstance(adapters, dict) or not all(
        isinstance(k, str) and isinstance(w, bool) for k, w in adapters.items()
    ):
        raise ResourceError("adapters: map of str -> bool expected")
    block_size = _int(d, "kv_block_size", None, optional=True)
    if block_size == 0:
        raise ResourceError("kv_block_size: must be positive")
    address = _str(d, "address", None)
    if not address:
        raise ResourceError("address: required")
    return EndpointState(
        address=address,
        pool=_str(d, "pool"),
        model=_str(d, "model"),
        adapters=adapters,
        gpu=_str(d, "gpu", None, optional=True),
        gpu_count=_int(d, "gpu_count"),
        memory_total_bytes=_int(d, "memory_total_bytes", None, optional=True),
        memory_used_bytes=_int(d, "memory_used_bytes", None, optional=True),
        kv_block_size=block_size,
        kv_capacity_blocks=_int(d, "kv_capacity_blocks", None, optional=True),
        kv_usage=_float(d, "kv_usage", 1.0),
        requests_running=_int(d, "requests_running"),
        requests_waiting=_int(d, "requests_waiting"),
        tokens_in_flight=_int(d, "tokens_in_flight"),
        ttft_s=_float(d, "ttft_s"),
        tpot_s=_float(d, "tpot_s"),
        healthy=_bool(d, "healthy", True),
        draining=_bool(d, "draining", False),
        epoch=_str(d, "epoch"),
    )


class _EndpointStateSlots:
    """EndpointState's slot layout without its frozen `__setattr__`: the decoder fills one
    with plain attribute stores and then makes it an EndpointState (`__class__`
    assignment, allowed between classes of identical layout). The frozen dataclass's
    `__init__` stores each field through `object.__setattr__`, which made construction
    the largest single cost of decoding (loadtest/xds_codec_bench.py: "decode+apply")."""

    __slots__ = EndpointState.__slots__


_WIRE_KEYS = ("v", *(f.name for f in fields(EndpointState)))  # encode()'s order
_ABSENT = object()
# A missing key's value, as _decode_endpoint_state_checked takes it (absent "adapters":
# a new {}, so not shared).
_WIRE_DEFAULTS: tuple[object, ...] = (SCHEMA_VERSION, None, "", "", _ABSENT, None, 0)
_WIRE_DEFAULTS += (None, None, None, None, None, 0, 0, 0, None, None, True, False, "")
assert len(_WIRE_DEFAULTS) == len(_WIRE_KEYS)
_is_str = str.__instancecheck__  # isinstance(x, str), called from map() in C
_is_bool = bool.__instancecheck__
_unpackb = msgpack.unpackb
_new = object.__new__


def decode_endpoint_state(body: bytes) -> EndpointState:
    """Decode an EndpointState body, or raise ResourceError.

    One pass with exact-type checks (msgpack returns exact builtin types, so `type(x) is
    int` is `isinstance(x, int) and not isinstance(x, bool)` here) accepts well-formed
    bodies; anything it does not accept (malformed, an int where a float is usual) goes to
    the field-by-field decoder, which gives the same value or the error (the two are
    compared on arbitrary maps in tests/test_xds_decode_fast.py). Half the field-by-field
    decoder's cost, 1.7x that of msgpack.unpackb alone (loadtest/xds_codec_bench.py
    --apply); a subscriber pays it per resource applied, the control plane per publish."""
    if len(body) <= MAX_RESOURCE_BYTES:
        try:
            d = _unpackb(body, raw=False, strict_map_key=True)
        except Exception:
            d = None
        if type(d) is dict:
            (
                v,
                address,
                pool,
                model,
                adapters,
                gpu,
                gpu_count,
                memory_total_bytes,
                memory_used_bytes,
                kv_block_size,
                kv_capacity_blocks,
                kv_usage,
                requests_running,
                requests_waiting,
                tokens_in_flight,
                ttft_s,
                tpot_s,
                healthy,
                draining,
                epoch,
            ) = d.values() if tuple(d) == _WIRE_KEYS else map(d.get, _WIRE_KEYS, _WIRE_DEFAULTS)
            if adapters is _ABSENT:
                adapters = {}
            if (
                v == SCHEMA_VERSION
                and type(address) is str
                and address
                and type(pool) is str
                and type(model) is str
                and type(adapters) is dict
                and all(map(_is_str, adapters))
                and all(map(_is_bool, adapters.values()))
                and (gpu is None or type(gpu) is str)
                and type(gpu_count) is int
                and gpu_count >= 0
                and (
                    memory_total_bytes is None
                    or (type(memory_total_bytes) is int and memory_total_bytes >= 0)
                )
                and (
                    memory_used_bytes is None
                    or (type(memory_used_bytes) is int and memory_used_bytes >= 0)
                )
                and (kv_block_size is None or (type(kv_block_size) is int and kv_block_size > 0))
                and (
                    kv_capacity_blocks is None
                    or (type(kv_capacity_blocks) is int and kv_capacity_blocks >= 0)
                )
                and (kv_usage is None or (type(kv_usage) is float and 0.0 <= kv_usage <= 1.0))
                and type(requests_running) is int
                and requests_running >= 0
                and type(requests_waiting) is int
                and requests_waiting >= 0
                and type(tokens_in_flight) is int
                and tokens_in_flight >= 0
                and (ttft_s is None or (type(ttft_s) is float and ttft_s >= 0.0))
                and (tpot_s is None or (type(tpot_s) is float and tpot_s >= 0.0))
                and type(healthy) is bool
                and type(draining) is bool
                and type(epoch) is str
            ):
                s: Any = _new(_EndpointStateSlots)  # its class is EndpointState's below
                s.address = address
                s.pool = pool
                s.model = model
                s.adapters = adapters
                s.gpu = gpu
                s.gpu_count = gpu_count
                s.memory_total_bytes = memory_total_bytes
                s.memory_used_bytes = memory_used_bytes
                s.kv_block_size = kv_block_size
                s.kv_capacity_blocks = kv_capacity_blocks
                s.kv_usage = kv_usage
                s.requests_running = requests_running
                s.requests_waiting = requests_waiting
                s.tokens_in_flight = tokens_in_flight
                s.ttft_s = ttft_s
                s.tpot_s = tpot_s
                s.healthy = healthy
                s.draining = draining
                s.epoch = epoch
                s.__class__ = EndpointState
                return s
    return _decode_endpoint_state_checked(body)


@dataclass(frozen=True, slots=True)
class DigestHeader:
    """A PrefixDigest but for its block hashes, which stay packed in the body: what the
    control plane needs of a digest (which base a delta builds on), without the tuples of
    Python ints a full decode makes (40,000 blocks: 1.6 MB of ints per digest, freed at
    once but leaving the allocator's arenas fragmented). `added` and `removed` count the
    hashes."""

    engine: str
    epoch: str
    seq: int
    base_seq: int
    full: bool
    block_size: int
    added: int
    removed: int


def _checked_digest(body: bytes) -> tuple[DigestHeader, bytes, bytes]:
    """Every check decode_prefix_digest makes, in its order; the header and the packed
    added and removed hashes."""
    d = _load_map(body)
    seq, base_seq = _int(d, "seq"), _int(d, "base_seq")
    full = _bool(d, "full", False)
    if base_seq > seq or (full and base_seq != seq):
        raise ResourceError(f"base_seq {base_seq} inconsistent with seq {seq} (full={full})")
    block_size = _int(d, "block_size")
    if block_size == 0:
        raise ResourceError("block_size: must be positive")
    removed = _packed(d.get("removed", b""), "removed")
    if full and removed:
        raise ResourceError("removed: must be empty in a full digest")
    engine, epoch = _str(d, "engine"), _str(d, "epoch")
    added = _packed(d.get("added", b""), "added")
    header = DigestHeader(
        engine, epoch, seq, base_seq, full, block_size, len(added) // 8, len(removed) // 8
    )
    return header, added, removed


def decode_prefix_digest(body: bytes) -> PrefixDigest:
    h, added, removed = _checked_digest(body)
    return PrefixDigest(
        engine=h.engine,
        epoch=h.epoch,
        seq=h.seq,
        base_seq=h.base_seq,
        full=h.full,
        block_size=h.block_size,
        added=_unpack(added),
        removed=_unpack(removed),
    )


def decode_prefix_digest_header(body: bytes) -> DigestHeader:
    """decode_prefix_digest's checks and errors, without unpacking the hashes."""
    return _checked_digest(body)[0]


# -- PoolDemandReport ---------------------------------------------------------------------

# Demand figures are rates, depths and token counts: finite, non-negative, and below this.
_MAX_FIGURE = 1e15
_DEMAND_INTS = frozenset({"ttft_samples", "replicas"})
_DEMAND_FIELDS = tuple(f.name for f in fields(PoolDemand))


@dataclass(frozen=True, slots=True)
class PoolDemandReport:
    """One sidecar's demand for one pool (filters/autoscale.py PoolDemand, over its
    window) and the pool's autoscaling policy as that sidecar is configured, published by
    the sidecar every few seconds under "<pool>@<sidecar>"; the control plane sums the
    pool's reports into one desired-replicas figure (docs/autoscaling.md).

    msgpack map: "v" (1), "pool": str, "sidecar": str, "policy": map (slo_ttft_s: number |
    nil, target_utilization: number in (0, 1], min_replicas, max_replicas: int >= 0,
    scale_down_delay_s: number), "demand": map of PoolDemand's fields (numbers >= 0;
    predicted_ttft_s may be nil; ttft_samples and replicas ints).
    """

    pool: str
    sidecar: str
    demand: PoolDemand
    policy: ScalingPolicy

    @property
    def name(self) -> str:
        return report_name(self.pool, self.sidecar)

    def encode(self) -> bytes:
        p = self.policy
        d: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "pool": self.pool,
            "sidecar": self.sidecar,
            "policy": {
                "slo_ttft_s": p.slo_ttft_s,
                "target_utilization": p.target_utilization,
                "min_replicas": p.min_replicas,
                "max_replicas": p.max_replicas,
                "scale_down_delay_s": p.scale_down_delay_s,
            },
            "demand": {k: getattr(self.demand, k) for k in _DEMAND_FIELDS},
        }
        out: bytes = msgpack.packb(d)
        return out


def report_name(pool: str, sidecar: str) -> str:
    """The resource name of `sidecar`'s report for `pool`."""
    return f"{pool}@{sidecar}"


def decode_pool_demand(body: bytes) -> PoolDemandReport:
    d = _load_map(body)
    pool = _str(d, "pool")
    if not pool:
        raise ResourceError("pool: empty")
    sidecar = _str(d, "sidecar")
    raw_policy = d.get("policy", {})
    raw_demand = d.get("demand", {})
    if not isinstance(raw_policy, dict) or not isinstance(raw_demand, dict):
        raise ResourceError("policy and demand: maps expected")
    kw: dict[str, Any] = {}
    for k in _DEMAND_FIELDS:
        if k in _DEMAND_INTS:
            kw[k] = _int(raw_demand, k)
        else:
            v = _float(raw_demand, k, _MAX_FIGURE)
            if v is not None or k == "predicted_ttft_s":
                kw[k] = v
    try:
        policy = ScalingPolicy(
            slo_ttft_s=_float(raw_policy, "slo_ttft_s", _MAX_FIGURE) or None,
            target_utilization=_float(raw_policy, "target_utilization", 1.0) or 0.0,
            min_replicas=_int(raw_policy, "min_replicas"),
            max_replicas=_int(raw_policy, "max_replicas"),
            scale_down_delay_s=_float(raw_policy, "scale_down_delay_s", _MAX_FIGURE) or 0.0,
        )
    except ValueError as exc:
        raise ResourceError(f"policy: {exc}") from None
    return PoolDemandReport(pool, sidecar, PoolDemand(**kw), policy)


# type URL -> decoder; the control plane validates publishes and the subscriber decodes
# responses with these. A type not listed here is carried opaquely (bytes).
DECODERS: Mapping[str, Callable[[bytes], Any]] = {
    ENDPOINT_STATE_TYPE: decode_endpoint_state,
    PREFIX_DIGEST_TYPE: decode_prefix_digest,
    POOL_DEMAND_TYPE: decode_pool_demand,
}


def decode(type_url: str, body: bytes) -> Any:
    """Decode a known type (ResourceError when malformed); unknown types pass through."""
    decoder = DECODERS.get(type_url)
    return body if decoder is None else decoder(body)
