"""xds/resources.py decode_endpoint_state (one pass, exact-type checks) against the
field-by-field decoder it replaced, kept here as the reference: for any body, the same
EndpointState (field values and their types) or a ResourceError with the same message.
Also the construction shortcuts (an EndpointState or Entry built through a slot twin is an
ordinary frozen instance) and Subscriber._apply on their output."""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import msgpack
import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st
from test_xds_resources import STATE

import xds.resources as resources
from xds.client import Subscriber
from xds.delta_response import Entry, _entry
from xds.resources import (
    ENDPOINT_STATE_TYPE,
    MAX_RESOURCE_BYTES,
    SCHEMA_VERSION,
    EndpointState,
    ResourceError,
    decode_endpoint_state,
)

# -- the reference: xds/resources.py's decoder before the fast path (verbatim) ------------


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


def _str(d: dict[str, Any], key: str, default: str | None = "", *, optional: bool = False) -> Any:
    v = d.get(key, default)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise ResourceError(f"{key}: string expected, got {type(v).__name__}")
    return v


def _int(d: dict[str, Any], key: str, default: int | None = 0, *, optional: bool = False) -> Any:
    v = d.get(key, default)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ResourceError(f"{key}: non-negative integer expected, got {v!r}")
    return v


def _float(d: dict[str, Any], key: str, hi: float = math.inf) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= v <= hi:
        raise ResourceError(f"{key}: number in [0, {hi}] expected, got {v!r}")
    return float(v)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ResourceError(f"{key}: bool expected, got {v!r}")
    return v


def reference_decode(body: bytes) -> EndpointState:
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


FIELDS = [f.name for f in dataclasses.fields(EndpointState)]


def outcome(decode: Any, body: bytes) -> tuple[Any, ...]:
    """What a decoder made of `body`, comparable: the error message, or the class and each
    field's type and value (EndpointState's own == would take 1 for 1.0)."""
    try:
        x = decode(body)
    except ResourceError as exc:
        return ("error", str(exc))
    return ("ok", type(x), [(k, type(getattr(x, k)), getattr(x, k)) for k in FIELDS])


# -- strategies ---------------------------------------------------------------------------

U64 = 2**64 - 1
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64)
    | st.sampled_from([0, 1, -1, U64])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, -0.0, 1.0, 0.5, math.nan, math.inf, -math.inf, 1.0000001])
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
# Any msgpack value; map keys that strict_map_key refuses (ints, nil) included.
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.text(max_size=4) | st.binary(max_size=2) | st.integers(0, 3), inner, max_size=3
        )
    ),
    max_leaves=6,
)
non_negative = st.integers(0, U64) | st.sampled_from([0, 1, 16])
optional_count = st.none() | non_negative
fraction = st.none() | st.floats(0.0, 1.0) | st.sampled_from([0, 1, 0.0, 1.0, -0.0])
seconds = st.none() | st.floats(0.0, allow_infinity=True) | st.integers(0, 10**6)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "address": st.text(min_size=1, max_size=12),
    "pool": st.text(max_size=6),
    "model": st.text(max_size=6),
    "adapters": st.dictionaries(st.text(max_size=4), st.booleans(), max_size=3),
    "gpu": st.none() | st.text(max_size=4),
    "gpu_count": non_negative,
    "memory_total_bytes": optional_count,
    "memory_used_bytes": optional_count,
    "kv_block_size": st.none() | st.integers(1, U64),
    "kv_capacity_blocks": optional_count,
    "kv_usage": fraction,
    "requests_running": non_negative,
    "requests_waiting": non_negative,
    "tokens_in_flight": non_negative,
    "ttft_s": seconds,
    "tpot_s": seconds,
    "healthy": st.booleans(),
    "draining": st.booleans(),
    "epoch": st.text(max_size=8),
}
# Near misses: a bool where an int goes and the reverse, ints for floats, empty strings, a
# bytes key or an int value among the adapters.
NEAR_MISSES = [
    *(True, False, 0, 1, -1, 1.0, 0.0, -0.0, -0.5, 1.5, math.nan, math.inf, None, U64),
    *("", "x", b"x", [], {}, {"a": 1}, {b"a": True}, {"a": None}, {"a": True, "b": 0}),
]
NEAR_MISS = st.sampled_from(NEAR_MISSES)


ODD_VERSIONS = st.sampled_from([1.0, True, 2, 0, None, "1"])


@st.composite
def maps(draw: st.DrawFn) -> dict[Any, Any]:
    """A map near an EndpointState: valid values, then up to three keys ("v" among them)
    dropped or given a near miss or anything; sometimes extra keys, any order."""
    d: dict[Any, Any] = {"v": SCHEMA_VERSION} if draw(st.integers(0, 4)) else {}
    d.update((key, draw(valid)) for key, valid in VALID.items())
    for key in draw(st.lists(st.sampled_from(["v", *VALID]), max_size=3, unique=True)):
        how = draw(st.sampled_from(["drop", "near", "near", "any"]))
        if how == "drop":
            d.pop(key, None)
        else:
            near = ODD_VERSIONS if key == "v" else NEAR_MISS
            d[key] = draw(near if how == "near" else anything)
    d.update(draw(st.dictionaries(st.text(max_size=8), anything, max_size=2)))
    items = list(d.items())
    if draw(st.booleans()):
        items = draw(st.permutations(items))
    return dict(items)


def pack(d: object) -> bytes:
    out: bytes = msgpack.packb(d)
    return out


# -- equivalence --------------------------------------------------------------------------


@settings(max_examples=800, deadline=None)
@given(maps())
def test_maps_decode_as_the_reference(d: dict[Any, Any]) -> None:
    body = pack(d)
    assert outcome(decode_endpoint_state, body) == outcome(reference_decode, body)


def _bases() -> list[dict[str, Any]]:
    full = msgpack.unpackb(STATE.encode())
    nones = msgpack.unpackb(
        dataclasses.replace(STATE, gpu=None, kv_usage=None, ttft_s=None, adapters={}).encode()
    )
    reordered = dict(reversed(full.items()))  # not encode()'s order
    unversioned = {k: v for k, v in full.items() if k != "v"}
    return [full, nones, reordered, unversioned]


@pytest.mark.parametrize("key", ["v", *FIELDS])
def test_each_key_dropped_or_given_each_near_miss_decodes_as_the_reference(key: str) -> None:
    for base in _bases():
        dropped = {k: v for k, v in base.items() if k != key}
        for d in [dropped, *({**base, key: near} for near in NEAR_MISSES)]:
            body = pack(d)
            assert outcome(decode_endpoint_state, body) == outcome(reference_decode, body), d


@settings(max_examples=200, deadline=None)
@given(anything)
def test_any_msgpack_value_decodes_as_the_reference(value: object) -> None:
    body = pack(value)
    assert outcome(decode_endpoint_state, body) == outcome(reference_decode, body)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_bytes_decode_as_the_reference(body: bytes) -> None:
    assert outcome(decode_endpoint_state, body) == outcome(reference_decode, body)


@settings(max_examples=200, deadline=None)
@given(maps(), st.data())
def test_damaged_bodies_decode_as_the_reference(d: dict[Any, Any], data: st.DataObject) -> None:
    body = bytearray(pack(d))
    if data.draw(st.booleans()):
        del body[data.draw(st.integers(0, len(body) - 1)) :]  # truncated
    else:
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] ^= 1 << data.draw(st.integers(0, 7))  # one bit flipped
    assert outcome(decode_endpoint_state, bytes(body)) == outcome(reference_decode, bytes(body))


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries(VALID))
def test_encoded_states_round_trip(kw: dict[str, Any]) -> None:
    body = EndpointState(**kw).encode()
    got = outcome(decode_endpoint_state, body)
    assert got[0] == "ok"
    assert got == outcome(reference_decode, body)


def test_oversized_body_gets_the_reference_error() -> None:
    body = b"\x00" * (MAX_RESOURCE_BYTES + 1)
    got = outcome(decode_endpoint_state, body)
    assert got == outcome(reference_decode, body)
    assert got[0] == "error" and "over" in got[1]


# -- the fast path itself -----------------------------------------------------------------


def _no_fallback(body: bytes) -> EndpointState:
    raise AssertionError("fell back to the field-by-field decoder")


@pytest.mark.parametrize(
    "body",
    [
        STATE.encode(),
        dataclasses.replace(STATE, gpu=None, kv_usage=None, ttft_s=None, adapters={}).encode(),
        # another encoder: keys in another order, some missing, one unknown
        pack({"future_field": [1, 2], "epoch": "e", "address": "a:1", "kv_usage": 0.25}),
    ],
)
def test_well_formed_bodies_take_the_fast_path(
    body: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = reference_decode(body)
    monkeypatch.setattr(resources, "_decode_endpoint_state_checked", _no_fallback)
    assert outcome(decode_endpoint_state, body) == outcome(lambda b: expected, body)


def test_an_int_where_a_float_goes_is_converted_as_before() -> None:
    body = dataclasses.replace(STATE, kv_usage=1, ttft_s=0).encode()  # type: ignore[arg-type]
    got = decode_endpoint_state(body)
    assert type(got.kv_usage) is float and type(got.ttft_s) is float
    assert outcome(decode_endpoint_state, body) == outcome(reference_decode, body)


def test_a_fast_path_state_is_an_ordinary_frozen_endpoint_state() -> None:
    got = decode_endpoint_state(STATE.encode())
    assert type(got) is EndpointState and got == STATE and repr(got) == repr(STATE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.pool = "other"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(got)) == STATE
    assert dataclasses.replace(got, pool="p").pool == "p"
    assert dataclasses.asdict(got) == dataclasses.asdict(STATE)
    assert got.to_reported() == STATE.to_reported()


def test_a_missing_adapters_map_is_a_new_dict_each_time() -> None:
    body = pack({"address": "a:1"})
    a, b = decode_endpoint_state(body), decode_endpoint_state(body)
    assert a.adapters == {} and a.adapters is not b.adapters


# -- client.py: Entry construction and _apply ---------------------------------------------


def test_entry_shortcut_is_an_ordinary_frozen_entry() -> None:
    e = _entry("e1", "v1", STATE, 12.5)
    assert type(e) is Entry and e == Entry("e1", "v1", STATE, 12.5)
    assert repr(e) == repr(Entry("e1", "v1", STATE, 12.5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.version = "v2"  # type: ignore[misc]


def _response(bodies: dict[str, bytes], nonce: str = "1") -> bytes:
    resp = pb.DeltaDiscoveryResponse(type_url=ENDPOINT_STATE_TYPE, nonce=nonce)
    for name, body in bodies.items():
        r = resp.resources.add(name=name, version=f"v-{name}")
        r.resource.type_url = ENDPOINT_STATE_TYPE
        r.resource.value = body
    return resp.SerializeToString()


def _reply(raw: bytes) -> pb.DeltaDiscoveryRequest:
    return pb.DeltaDiscoveryRequest.FromString(raw)


def test_apply_acks_with_entries_as_the_reference_decodes_them() -> None:
    updates: list[Any] = []
    sub = Subscriber(
        "127.0.0.1:1",
        {ENDPOINT_STATE_TYPE: ["e1", "e2"]},
        on_update=updates.append,
        clock=lambda: 7.0,
    )
    bodies = {
        "e1": STATE.encode(),
        "e2": dataclasses.replace(STATE, address="10.0.0.8:8000").encode(),
        "e3": STATE.encode(),  # not subscribed to
    }
    reply = _reply(sub._apply(_response(bodies)))
    assert not reply.HasField("error_detail") and reply.response_nonce == "1"
    expected = {n: Entry(n, f"v-{n}", reference_decode(bodies[n]), 7.0) for n in ("e1", "e2")}
    assert dict(sub.entries(ENDPOINT_STATE_TYPE)) == expected
    assert [dict(u.changed) for u in updates] == [expected]


def test_apply_nacks_a_malformed_resource_with_the_reference_message() -> None:
    sub = Subscriber("127.0.0.1:1", {ENDPOINT_STATE_TYPE: None})
    bad = pack({"v": 1, "address": "a:1", "requests_running": True})
    reply = _reply(sub._apply(_response({"e1": STATE.encode(), "e2": bad})))
    with pytest.raises(ResourceError) as exc:
        reference_decode(bad)
    assert reply.error_detail.message == f"e2: {exc.value}"
    assert dict(sub.entries(ENDPOINT_STATE_TYPE)) == {}  # all or nothing
