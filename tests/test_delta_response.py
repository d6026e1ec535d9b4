"""xds/delta_response.py: the compiled reader (xds/_delta_response_c.pyx) against the
reference (protobuf's parse, then the resources decoded in order): for any bytes, the same
DeltaResponse (types and values, Entries included) or the same exception. Responses are
built with protobuf (every field the subscriber reads, fields it does not, unknown fields
of each wire type, fields given twice) and then damaged (truncated, bytes changed,
garbage)."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st
from test_xds_resources import STATE

import xds.delta_response as delta_response
from xds.delta_response import (
    DeltaResponse,
    Entry,
    Interest,
    read_response,
    reference_read,
)
from xds.engine_report import decode_engine_report
from xds.resources import ENDPOINT_STATE_TYPE, ResourceError
from xds.wire import len_field, varint

T = ENDPOINT_STATE_TYPE
OTHER = "type.googleapis.com/meshd.v1.Other"
RAW = "type.googleapis.com/meshd.v1.Raw"  # no decoder: the value as bytes
BUGGY = "type.googleapis.com/meshd.v1.Buggy"  # a decoder that fails as a bug would
NAMES = ["e0", "e1", "e2", "é3"]
BODIES = [
    STATE.encode(),
    dataclasses.replace(STATE, address="10.0.0.9:8000", kv_usage=0.5).encode(),
    b"",
    b"\x80",  # an empty map: no address
    b"\xc1garbage",
]


def _buggy(body: bytes) -> bytes:
    if body[:1] == b"\x80":
        raise KeyError("bug")
    return body


DECODERS: dict[str, Callable[[bytes], Any]] = {T: decode_engine_report, BUGGY: _buggy}

compiled = pytest.mark.skipif(
    delta_response.IMPLEMENTATION != "cython", reason=delta_response.IMPLEMENTATION
)

text = st.text(max_size=6) | st.sampled_from(NAMES)
unknown = st.tuples(
    st.sampled_from([3, 10, 11, 99, 536870911]),
    st.sampled_from([0, 1, 2, 5]),
    st.binary(max_size=5),
)


def _unknown(number: int, wire: int, data: bytes) -> bytes:
    tag = varint(number << 3 | wire)
    if wire == 0:
        return tag + varint(int.from_bytes(data[:8] or b"\0", "little") & (2**63 - 1))
    if wire == 1:
        return tag + data.ljust(8, b"\0")[:8]
    if wire == 5:
        return tag + data.ljust(4, b"\0")[:4]
    return len_field(number, data)


@st.composite
def resource(draw: st.DrawFn) -> bytes:
    r = pb.Resource(name=draw(text), version=draw(text))
    if draw(st.booleans()):
        r.resource.type_url = draw(st.sampled_from([T, OTHER, RAW, BUGGY, ""]))
        r.resource.value = draw(st.sampled_from(BODIES) | st.binary(max_size=8))
    if draw(st.integers(0, 9)) == 0:
        r.aliases.append("alias")  # a field the reader leaves to protobuf
    if draw(st.integers(0, 9)) == 0:
        r.ttl.seconds = 3
    out = r.SerializeToString()
    for u in draw(st.lists(unknown, max_size=2)):
        out += _unknown(*u)
    if draw(st.integers(0, 19)) == 0:
        out += len_field(3, b"again")  # the name given twice: protobuf keeps the last
    return out


@st.composite
def response(draw: st.DrawFn) -> bytes:
    m = pb.DeltaDiscoveryResponse(
        type_url=draw(st.sampled_from([T, OTHER, RAW, BUGGY, ""])),
        nonce=draw(text),
        system_version_info=draw(text),
    )
    m.removed_resources.extend(draw(st.lists(text, max_size=3)))
    if draw(st.integers(0, 19)) == 0:
        m.control_plane.identifier = "cp"
    parts = [m.SerializeToString()]
    parts += [len_field(2, r) for r in draw(st.lists(resource(), max_size=4))]
    parts += [_unknown(*u) for u in draw(st.lists(unknown, max_size=2))]
    # Fields in any order: a message is the concatenation of its fields' frames.
    return b"".join(draw(st.permutations(parts)))


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(response()))
    how = draw(st.integers(0, 2))
    if how == 0 and raw:
        del raw[draw(st.integers(0, len(raw) - 1)) :]
    elif how == 1 and raw:
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    else:
        raw += draw(st.binary(min_size=1, max_size=6))
    return bytes(raw)


interests = st.fixed_dictionaries(
    {},
    optional={
        t: st.builds(Interest, st.booleans(), st.sets(st.sampled_from(NAMES), max_size=3))
        for t in (T, RAW, BUGGY)
    },
)


def outcome(
    read: Any, raw: bytes, wanted: dict[str, Interest], held: Any = None
) -> tuple[Any, ...]:
    try:
        r = read(raw, wanted, DECODERS, 5.0, held)
    except Exception as exc:
        return ("raises", type(exc), str(exc))
    assert type(r) is DeltaResponse
    changed = None
    if r.changed is not None:
        changed = [
            (type(e), type(k), k, type(e.version), e.version, type(e.value), e.value, e.received_at)
            for k, e in r.changed.items()
        ]
    return ("ok", type(r.type_url), r.type_url, type(r.nonce), r.nonce, changed, r.removed, r.error)


def same(raw: bytes, wanted: dict[str, Interest]) -> None:
    assert outcome(read_response, raw, wanted) == outcome(reference_read, raw, wanted)


@compiled
@settings(max_examples=600, deadline=None)
@given(response(), interests)
def test_responses_read_as_the_reference(raw: bytes, wanted: dict[str, Interest]) -> None:
    same(raw, wanted)


@compiled
@settings(max_examples=600, deadline=None)
@given(damaged(), interests)
def test_damaged_responses_read_or_fail_as_the_reference(
    raw: bytes, wanted: dict[str, Interest]
) -> None:
    same(raw, wanted)


@compiled
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), interests)
def test_any_bytes_read_or_fail_as_the_reference(raw: bytes, wanted: dict[str, Interest]) -> None:
    same(raw, wanted)


# What a subscriber may hold when a response comes: Entries of each body under each name
# (another engine's, a body that failed), a value of another type, something else.
held_tables = st.dictionaries(
    st.sampled_from([T, RAW]),
    st.dictionaries(
        st.sampled_from(NAMES),
        st.sampled_from(BODIES[:2]).map(lambda b: Entry("x", "1", decode_engine_report(b), 1.0))
        | st.just(Entry("x", "1", b"raw", 1.0))
        | st.just("not an entry"),
        max_size=4,
    )
    | st.just("not a table"),
    max_size=2,
)


@compiled
@settings(max_examples=250, deadline=None)
@given(response(), interests, held_tables)
def test_what_the_subscriber_holds_changes_no_answer(
    raw: bytes, wanted: dict[str, Interest], held: Any
) -> None:
    assert outcome(read_response, raw, wanted, held) == outcome(reference_read, raw, wanted)


@compiled
def test_an_engine_report_takes_its_unchanged_values_from_the_held_one() -> None:
    """Read in place and given the Entry it replaces, an EndpointState keeps that report's
    unchanged values (its address, epoch, models...), or is that report when unchanged."""
    wanted = {T: Interest(True)}
    first = read_response(_message(("e0", T, BODIES[0])), wanted, DECODERS, 5.0)
    assert first.changed is not None
    was = first.changed["e0"].value
    held = {T: dict(first.changed)}
    changed = dataclasses.replace(STATE, requests_running=STATE.requests_running + 1)
    again = read_response(_message(("e0", T, BODIES[0])), wanted, DECODERS, 6.0, held)
    moved = read_response(_message(("e0", T, changed.encode())), wanted, DECODERS, 6.0, held)
    assert again.changed is not None and moved.changed is not None
    assert again.changed["e0"].value is was and again.changed["e0"].received_at == 6.0
    now = moved.changed["e0"].value
    assert now.state.requests_running == changed.requests_running
    assert now.address is was.address and now.state.models is was.state.models


def _message(*resources: tuple[str, str, bytes], removed: tuple[str, ...] = ()) -> bytes:
    m = pb.DeltaDiscoveryResponse(type_url=T, nonce="7")
    for name, type_url, body in resources:
        r = m.resources.add(name=name, version=f"v-{name}")
        r.resource.type_url = type_url
        r.resource.value = body
    m.removed_resources.extend(removed)
    return m.SerializeToString()


@pytest.mark.parametrize("read", [read_response, reference_read])
def test_subscribed_resources_become_entries(read: Any) -> None:
    raw = _message(("e0", T, BODIES[0]), ("e9", T, BODIES[0]), removed=("e2",))
    r = read(raw, {T: Interest(False, {"e0"})}, DECODERS, 5.0)
    assert r == DeltaResponse(
        T, "7", {"e0": Entry("e0", "v-e0", decode_engine_report(BODIES[0]), 5.0)}, ("e2",), None
    )
    assert read(raw, {}, DECODERS, 5.0) == DeltaResponse(T, "7", None, (), None)


@pytest.mark.parametrize("read", [read_response, reference_read])
def test_a_refused_resource_refuses_the_response_with_its_message(read: Any) -> None:
    wildcard = {T: Interest(True)}
    r = read(_message(("e0", T, BODIES[0]), ("e1", T, b"\x80")), wildcard, DECODERS, 5.0)
    with pytest.raises(ResourceError) as exc:
        decode_engine_report(b"\x80")
    assert (r.changed, r.error) == ({}, f"e1: {exc.value}")
    r = read(_message(("e0", OTHER, BODIES[0])), wildcard, DECODERS, 5.0)
    assert r.error == f"Any type {OTHER!r} in a {T} response"


@compiled
def test_entries_of_untracked_values_are_left_out_of_the_cyclic_gc() -> None:
    """An Entry of a value the GC does not track (a compiled EngineReport, bytes) can be in
    no cycle: untracked too. One of a value it tracks stays tracked."""
    wanted = {t: Interest(True) for t in (T, RAW, BUGGY)}
    listing: dict[str, Callable[[bytes], Any]] = {
        BUGGY: lambda body: [body],  # a list: tracked
        T: decode_engine_report,
    }
    for t, name in ((T, "e0"), (RAW, "r0"), (BUGGY, "b0")):
        m = pb.DeltaDiscoveryResponse(type_url=t, nonce="7")
        res = m.resources.add(name=name, version="1")
        res.resource.type_url = t
        res.resource.value = BODIES[0] if t == T else b"x"
        r = read_response(m.SerializeToString(), wanted, listing, 5.0)
        assert r.changed is not None and r.error is None
        assert gc.is_tracked(r.changed[name]) == (t == BUGGY), t


@compiled
@pytest.mark.parametrize(
    "tag",
    [
        bytes([0x99, 0x06]),  # field 99, 64-bit: skipped
        bytes([0x99, 0x86, 0x80, 0x80, 0x00]),  # the same padded to 5 bytes: protobuf takes it
        bytes([0x99, 0x8F, 0x8F, 0x8F, 0x0F]),  # 5 bytes, under 2^32
        bytes([0x99, 0x8F, 0x8F, 0x8F, 0x1F]),  # 5 bytes, over 2^32: refused
        bytes([0x99, 0x86, 0x80, 0x80, 0x80, 0x00]),  # 6 bytes: refused (fuzz's finding)
        bytes([0x99, 0x8F, 0x8F, 0x8F, 0x8F, 0x00]),
        bytes([0x01]),  # field 0: refused
    ],
)
def test_tags_read_as_protobuf_reads_them(tag: bytes) -> None:
    for wanted in ({}, {T: Interest(True)}):
        same(tag + b"\0" * 8, wanted)
        same(_message(("e0", T, BODIES[0])) + tag + b"\0" * 8, wanted)
        # Inside a resource, and inside its Any.
        inner = pb.Resource(name="e0").SerializeToString() + tag + b"\0" * 8
        same(len_field(2, inner), wanted)


# Responses of more resources than the compiled reader's batch (32: read, then the held
# reports asked for from memory, then decoded), each resource's Any type checked once.
BATCH = 32


@st.composite
def long_response(draw: st.DrawFn) -> tuple[bytes, dict[str, dict[str, Any]]]:
    """A response of up to 3 batches of EndpointStates (some unwanted, a few odd), and
    what the subscriber holds: reports under some of their names, other things under
    others."""
    count = draw(st.integers(0, 3 * BATCH + 2))
    m = pb.DeltaDiscoveryResponse(type_url=T, nonce="n")
    held: dict[str, Any] = {}
    for i in range(count):
        name = f"e{i}" if draw(st.integers(0, 9)) else "é" + str(i)
        r = m.resources.add(name=name, version=f"{i}")
        r.resource.type_url = T if draw(st.integers(0, 49)) else draw(st.sampled_from([OTHER, ""]))
        r.resource.value = draw(st.sampled_from(BODIES[:2]) | st.sampled_from(BODIES))
        kind = draw(st.integers(0, 3))
        if kind == 1:
            body = BODIES[draw(st.integers(0, 1))]
            held[name] = Entry(name, "0", decode_engine_report(body), 1.0)
        elif kind == 2:
            held[name] = draw(st.sampled_from(["not an entry", Entry(name, "0", b"raw", 1.0)]))
    raw = m.SerializeToString()
    if draw(st.integers(0, 4)) == 0 and raw:  # damaged somewhere
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
    return raw, {T: held}


@compiled
@settings(max_examples=200, deadline=None)
@given(long_response(), st.booleans(), st.sets(st.integers(0, 3 * BATCH + 2), max_size=60))
def test_responses_of_several_batches_read_as_the_reference(
    case: tuple[bytes, dict[str, dict[str, Any]]], wildcard: bool, picked: set[int]
) -> None:
    raw, held = case
    wanted = {T: Interest(wildcard, {f"e{i}" for i in picked})}
    assert outcome(read_response, raw, wanted, held) == outcome(reference_read, raw, wanted)


@compiled
def test_a_long_response_cut_anywhere_reads_or_fails_as_the_reference() -> None:
    """Malformed bytes are protobuf's DecodeError, or read as the reference reads them;
    never a crash, at any cut of a response of three batches."""
    states = [dataclasses.replace(STATE, requests_running=i).encode() for i in range(3 * BATCH)]
    raw = _message(*((f"e{i}", T, body) for i, body in enumerate(states)))
    held = {T: dict(read_response(raw, {T: Interest(True)}, DECODERS, 1.0).changed or {})}
    for cut in range(0, len(raw), 37):
        for wanted in ({T: Interest(True)}, {T: Interest(False, {"e40"})}):
            assert outcome(read_response, raw[:cut], wanted, held) == outcome(
                reference_read, raw[:cut], wanted
            )


@pytest.mark.parametrize("read", [read_response, reference_read])
@pytest.mark.parametrize("any_type", [b"\xff\xfe", b"type.googleapis.com/\xc3", "é".encode()])
def test_an_any_type_that_is_not_the_responses_is_checked_as_utf8(
    read: Any, any_type: bytes
) -> None:
    """An Any's type other than the response's (whose bytes were checked once) is
    checked itself, in a resource not subscribed to as well: invalid UTF-8 refuses the
    message as protobuf does; valid, it is the resource's refusal."""
    body = len_field(1, any_type) + len_field(2, BODIES[0])
    res = len_field(3, b"e1") + len_field(2, body)
    raw = _message(("e0", T, BODIES[0])) + len_field(2, res)
    for wanted in ({}, {T: Interest(False, {"e0"})}, {T: Interest(True)}):
        got = outcome(read, raw, wanted)
        assert got == outcome(reference_read, raw, wanted)
        if any_type == "é".encode() and wanted.get(T, Interest(False)).wildcard:
            assert got[-1] == f"Any type 'é' in a {T} response"
        elif any_type != "é".encode():
            assert got[0] == "raises"


@compiled
def test_each_resource_of_a_batch_takes_its_own_held_report() -> None:
    """Read again with what the subscriber holds, every unchanged report of a response of
    three batches (some names skipped, unwanted) is its own held one."""
    states = [dataclasses.replace(STATE, requests_running=i).encode() for i in range(3 * BATCH)]
    raw = _message(*((f"e{i}", T, body) for i, body in enumerate(states)))
    wanted = {T: Interest(False, {f"e{i}" for i in range(3 * BATCH) if i % 5})}
    first = read_response(raw, wanted, DECODERS, 1.0).changed
    assert first is not None and len(first) == len(wanted[T].names)
    again = read_response(raw, wanted, DECODERS, 2.0, {T: dict(first)}).changed
    assert again is not None and again.keys() == first.keys()
    assert all(again[n].value is first[n].value for n in first)
    assert all(again[n].value.state.requests_running == int(n[1:]) for n in again)
