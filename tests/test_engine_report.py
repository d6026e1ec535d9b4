"""xds/engine_report.py: the compiled decoder (xds/_engine_report_c.pyx) against the
reference (decode_endpoint_state, then EndpointState.to_reported): for any body, the same
EngineReport (every field's type and value) or a ResourceError with the same message.
The strategies are tests/test_xds_decode_fast.py's (maps near an EndpointState, near
misses, any msgpack, garbage, damaged bodies)."""

from __future__ import annotations

import dataclasses
import gc
import math
import pickle
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_xds_decode_fast import NEAR_MISSES, VALID, _bases, anything, maps, pack
from test_xds_resources import STATE

import xds.engine_report as engine_report
from filters.endpoint_state import ReportedState
from xds.engine_report import EngineReport, decode_engine_report, reference_decode
from xds.resources import MAX_RESOURCE_BYTES, EndpointState, ResourceError

REPORTED = [f.name for f in dataclasses.fields(ReportedState)]
compiled = pytest.mark.skipif(
    engine_report.IMPLEMENTATION != "cython", reason=engine_report.IMPLEMENTATION
)


def outcome(decode: Any, body: bytes) -> tuple[Any, ...]:
    """What a decoder made of `body`, comparable: the error message, or the classes and
    each field's type and value (a dict's items with their types: == takes 1 for True)."""
    try:
        r = decode(body)
    except ResourceError as exc:
        return ("error", str(exc))

    def typed(v: object) -> object:
        if isinstance(v, dict):
            return ("dict", [(type(k), k, type(w), w) for k, w in v.items()])
        return (type(v), v)

    s = r.state
    return ("ok", type(r), typed(r.address), type(s), [(k, typed(getattr(s, k))) for k in REPORTED])


def same(body: bytes) -> None:
    assert outcome(decode_engine_report, body) == outcome(reference_decode, body)


@settings(max_examples=800, deadline=None)
@given(maps())
def test_maps_decode_as_the_reference(d: dict[Any, Any]) -> None:
    same(pack(d))


@pytest.mark.parametrize("key", ["v", *(f.name for f in dataclasses.fields(EndpointState))])
def test_each_key_dropped_or_given_each_near_miss_decodes_as_the_reference(key: str) -> None:
    for base in _bases():
        dropped = {k: v for k, v in base.items() if k != key}
        for d in [dropped, *({**base, key: near} for near in NEAR_MISSES)]:
            same(pack(d))


@settings(max_examples=300, deadline=None)
@given(anything)
def test_any_msgpack_value_decodes_as_the_reference(value: object) -> None:
    same(pack(value))


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries(VALID), st.dictionaries(st.text(max_size=8), anything, max_size=3))
def test_unknown_keys_of_any_value_decode_as_the_reference(
    kw: dict[str, Any], extra: dict[str, Any]
) -> None:
    d = {**msgpack.unpackb(EndpointState(**kw).encode()), **extra}
    same(pack(d))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_bytes_decode_as_the_reference(body: bytes) -> None:
    same(body)


@settings(max_examples=300, deadline=None)
@given(maps(), st.data())
def test_damaged_bodies_decode_as_the_reference(d: dict[Any, Any], data: st.DataObject) -> None:
    body = bytearray(pack(d))
    if data.draw(st.booleans()):
        del body[data.draw(st.integers(0, len(body) - 1)) :]  # truncated
    else:
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] ^= 1 << data.draw(st.integers(0, 7))  # one bit flipped
    same(bytes(body))


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries(VALID))
def test_encoded_states_decode_as_the_reference(kw: dict[str, Any]) -> None:
    body = EndpointState(**kw).encode()
    assert outcome(decode_engine_report, body)[0] == "ok"
    same(body)


@pytest.mark.parametrize(
    "body",
    [
        b"\xd9\x01a",  # str8 that says 1 byte: not a map
        b"\x81\xa7address\xa3a:1\x00",  # a byte after the map
        b"\x81\xa7address\xa2\xc3\x28",  # invalid UTF-8
        b"\x82\xa7address\xa3a:1\xa1x\xd4\xff\x01",  # an unknown key's ext value (timestamp)
        b"\x82\xa7address\xa3a:1\xa1x\x81\x01\x02",  # an int key in a nested map
        b"\x82\xa7address\xa3a:1\xa1x\x81\xc4\x01k\x02",  # a bin key there (allowed)
        b"\x82\xa7address\xa3a:1\xa7address\xa3b:2",  # a key twice
        b"\x82\xa7address\xa3a:1\xa8kv_usage\xca\x3e\x80\x00\x00",  # float32 0.25
        b"\x82\xa7address\xa3a:1\xa8kv_usage\xca\x3d\xcc\xcc\xcd",  # float32 0.1
        b"\x82\xa7address\xa3a:1\xa9gpu_count\xd3" + (5).to_bytes(8, "big"),  # int64 5
        b"\x82\xa7address\xa3a:1\xa9gpu_count\xd0\xff",  # int8 -1
        b"\x82\xa7address\xa3a:1\xa1v\xcc\x01",  # "v" as a uint8 1
        b"\x82\xa7address\xa3a:1\xa1v\xc3",  # "v" as true
        b"\x82\xc4\x07address\xa3a:1\xa7address\xa3b:2",  # a bin key
        b"\x81\xa7address" + b"\xd9\xff" + b"a" * 255,  # a long address
    ],
)
def test_odd_encodings_decode_as_the_reference(body: bytes) -> None:
    same(body)


def test_oversized_body_gets_the_reference_error() -> None:
    body = b"\x80" + b"\x00" * MAX_RESOURCE_BYTES
    got = outcome(decode_engine_report, body)
    assert got == outcome(reference_decode, body)
    assert got[0] == "error" and "over" in got[1]


# -- what it builds ---------------------------------------------------------------------------


def test_a_report_is_an_ordinary_frozen_one() -> None:
    got = decode_engine_report(STATE.encode())
    assert type(got) is EngineReport and type(got.state) is ReportedState
    assert got == EngineReport(STATE.address, STATE.to_reported())
    assert repr(got) == repr(EngineReport(STATE.address, STATE.to_reported()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.state.epoch = "x"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(got)) == got
    assert dataclasses.replace(got.state, epoch="x").epoch == "x"
    assert got.state.kv_capacity_tokens == 16 * 40_000


@compiled
def test_strings_and_maps_repeated_are_built_once() -> None:
    a = decode_engine_report(STATE.encode())
    b = decode_engine_report(dataclasses.replace(STATE, requests_running=9).encode())
    assert a.address is b.address and a.state.epoch is b.state.epoch
    assert a.state.models is b.state.models and a.state.adapters is b.state.adapters
    assert a.state is not b.state and b.state.requests_running == 9


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries(VALID), st.fixed_dictionaries(VALID), st.data())
def test_a_previous_report_changes_no_answer(
    kw: dict[str, Any], before: dict[str, Any], data: st.DataObject
) -> None:
    """Given the report it replaces (any report: of another engine, the reference's, one
    differing in some fields), a body decodes to what the reference gives it alone."""
    mixed = {k: data.draw(st.sampled_from([kw[k], before[k]])) for k in kw}
    body = EndpointState(**mixed).encode()
    for previous in (
        decode_engine_report(EndpointState(**before).encode()),
        reference_decode(EndpointState(**before).encode()),
        decode_engine_report(EndpointState(**kw).encode()),
        EngineReport(str(kw["address"]), ReportedState()),
        None,
    ):
        assert outcome(lambda b: decode_engine_report(b, previous), body) == outcome(  # noqa: B023
            reference_decode, body
        )


@compiled
def test_unchanged_values_are_the_previous_reports() -> None:
    """An engine's next report takes its unchanged values from the last one (no new int,
    float, str or dict for them); an unchanged report is the last one itself."""
    big = dataclasses.replace(STATE, memory_total_bytes=2**40, kv_capacity_blocks=90_000)
    a = decode_engine_report(big.encode())
    b = decode_engine_report(dataclasses.replace(big, requests_running=9, kv_usage=0.5).encode(), a)
    assert b.state.requests_running == 9 and b.state.kv_usage == 0.5
    assert b.address is a.address and b.state is not a.state
    for name in ("memory_total_bytes", "kv_capacity_blocks", "ttft_s", "tpot_s", "epoch"):
        assert getattr(b.state, name) is getattr(a.state, name), name
    assert b.state.models is a.state.models and b.state.adapters is a.state.adapters
    assert decode_engine_report(big.encode(), a) is a
    assert decode_engine_report(big.encode(), reference_decode(big.encode())) == a
    # Ints equal in their low 64 bits only are other ints; -0.0 is not 0.0.
    m = big.memory_total_bytes
    assert m is not None
    odd = EngineReport(a.address, ReportedState(memory_total_bytes=2**64 + m))
    assert decode_engine_report(big.encode(), odd).state.memory_total_bytes == m
    odd = EngineReport(a.address, ReportedState(memory_total_bytes=m - 2**64))
    assert decode_engine_report(big.encode(), odd).state.memory_total_bytes == m
    z = decode_engine_report(dataclasses.replace(big, ttft_s=0.0).encode())
    n = decode_engine_report(dataclasses.replace(big, ttft_s=-0.0).encode(), z)
    assert n.state.ttft_s is not None and math.copysign(1.0, n.state.ttft_s) == -1.0


@compiled
def test_what_it_builds_is_left_out_of_the_cyclic_gc() -> None:
    """Frozen, holding strs, numbers and str -> bool dicts, a report can be in no cycle: the
    GC need not walk the 1,000 a sidecar holds, replaced 10,000 times a second. The
    reference's, built through __init__, are tracked as usual."""
    got = decode_engine_report(STATE.encode())
    assert not gc.is_tracked(got) and not gc.is_tracked(got.state)
    assert gc.is_tracked(reference_decode(STATE.encode()))


@compiled
def test_the_compiled_decoder_falls_back_only_off_its_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from xds import _engine_report_c  # type: ignore[attr-defined]

    calls: list[bytes] = []

    def counting(body: bytes) -> EngineReport:
        calls.append(body)
        return reference_decode(body)

    _engine_report_c.bind(EngineReport, ReportedState, counting)
    try:
        decode_engine_report(STATE.encode())
        decode_engine_report(pack({"future_field": [1, {"a": b"x"}], "address": "a:1"}))
        assert calls == []
        decode_engine_report(dataclasses.replace(STATE, kv_usage=1).encode())
        assert len(calls) == 1
    finally:
        assert _engine_report_c.bind(EngineReport, ReportedState, reference_decode)


@compiled
def test_classes_it_cannot_build_through_slots_are_built_through_their_init() -> None:
    from xds import _engine_report_c  # type: ignore[attr-defined]

    @dataclasses.dataclass(frozen=True)
    class Loose:  # no slots
        address: str
        state: ReportedState

    try:
        assert not _engine_report_c.bind(Loose, ReportedState, reference_decode)
        got = decode_engine_report(STATE.encode())
        assert type(got) is Loose and got.state == STATE.to_reported()
    finally:
        assert _engine_report_c.bind(EngineReport, ReportedState, reference_decode)


# The fast paths of the compiled decoder (issue #23): strings checked as ASCII eight bytes
# at a time, and the key encode() writes next matched whole, header included.
_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # 32 bytes: four words


@pytest.mark.parametrize("at", range(len(_MODEL)))
@pytest.mark.parametrize("odd", [b"\xff", b"\xc3\xa9", b"\xc3", b"\x80", b"\x7f"])
def test_a_non_ascii_byte_anywhere_in_a_string_decodes_as_the_reference(
    at: int, odd: bytes
) -> None:
    """Invalid UTF-8 (refused), valid UTF-8 (taken), a lone lead or continuation byte,
    and DEL (ASCII) at each offset of a word-checked string: in the model, the address,
    an adapter's name, an unknown key's name and value."""
    text = _MODEL.encode()
    s = text[:at] + odd + text[at + 1 :]
    header = bytes([0xA0 | len(s)]) if len(s) < 32 else b"\xd9" + bytes([len(s)])
    body = msgpack.unpackb(STATE.encode())
    packed = msgpack.packb(body)
    model = msgpack.packb("model") + msgpack.packb(body["model"])
    assert model in packed
    same(packed.replace(model, msgpack.packb("model") + header + s))
    addr = msgpack.packb("address") + msgpack.packb(body["address"])
    same(packed.replace(addr, msgpack.packb("address") + header + s))
    adapters = msgpack.packb("adapters") + msgpack.packb(body["adapters"])
    assert adapters in packed
    same(packed.replace(adapters, msgpack.packb("adapters") + b"\x81" + header + s + b"\xc3"))
    same(_with(packed, header + s + header + s))  # an unknown key, a str value


def _with(packed: bytes, pair: bytes) -> bytes:
    """`packed` (a map16) with one more key/value pair at its end."""
    assert packed[0] == 0xDE
    return b"\xde" + (int.from_bytes(packed[1:3], "big") + 1).to_bytes(2, "big") + packed[3:] + pair


@pytest.mark.parametrize("key", ["v", *(f.name for f in dataclasses.fields(EndpointState))])
def test_a_key_in_another_encoding_or_place_decodes_as_the_reference(key: str) -> None:
    """The key expected next matched whole is one path; a key as str8 (not fixstr), out of
    encode()'s order, cut short at the map's end, or a name one byte off takes the other,
    with the same answers."""
    d = msgpack.unpackb(STATE.encode())
    if key not in d:
        d[key] = None
    packed = msgpack.packb(d)
    fix = msgpack.packb(key)
    str8 = b"\xd9" + bytes([len(key)]) + key.encode()
    assert packed.count(fix) >= 1
    same(packed.replace(fix, str8, 1))
    first = {key: d[key], **{k: v for k, v in d.items() if k != key}}
    same(msgpack.packb(first))
    same(packed[: packed.index(fix) + len(fix)])  # the key, then nothing
    off = key[:-1] + chr(ord(key[-1]) ^ 1)
    same(packed.replace(fix, msgpack.packb(off), 1))
