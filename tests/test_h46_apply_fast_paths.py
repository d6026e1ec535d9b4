"""The compiled apply's fast paths (issue #23): the EndpointState decoder's keys matched as
words, its ints read from their digits and its byte-order reads; the response reader's
ASCII versions; and the slot helper the compiled twins share (filters/_slots.pxd). Each
against the reference, at the edges the fast paths add."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb
from test_engine_report import outcome as report_outcome
from test_xds_resources import STATE

import filters.endpoint_state as endpoint_state
import meshd.control_feed as control_feed
import xds.delta_response as delta_response
import xds.engine_report as engine_report
from filters.endpoint_state import EndpointState, ReportedState
from xds.delta_response import DeltaResponse, Entry, Interest, read_response, reference_read
from xds.engine_report import EngineReport, decode_engine_report, reference_decode
from xds.resources import ENDPOINT_STATE_TYPE as T

compiled = pytest.mark.skipif(
    engine_report.IMPLEMENTATION != "cython" or delta_response.IMPLEMENTATION != "cython",
    reason=f"{engine_report.IMPLEMENTATION}; {delta_response.IMPLEMENTATION}",
)


def same(body: bytes, previous: EngineReport | None = None) -> None:
    got = report_outcome(lambda b: decode_engine_report(b, previous), body)
    assert got == report_outcome(reference_decode, body)


def test_each_key_with_any_byte_changed_decodes_as_the_reference() -> None:
    """A key matched as words (its first eight bytes, the middle ones, the last eight, or
    one masked word): a bit flipped in any byte of any key, its header included, is
    another key (or no str), read as the reference reads it."""
    packed = STATE.encode()
    for key in msgpack.unpackb(packed):
        fix = msgpack.packb(key)
        at = packed.index(fix)
        for i in range(len(fix)):
            for bit in (0x01, 0x20, 0x80):
                b = bytearray(packed)
                b[at + i] ^= bit
                same(bytes(b))


@pytest.mark.parametrize("epoch", ["", "x", "xy", "0123456789abcdef"])
def test_a_short_key_near_the_end_decodes_as_the_reference(epoch: str) -> None:
    """The last key (epoch, 6 bytes with its header) with under eight bytes left after it
    (compared a byte at a time), or eight or more (one masked word)."""
    body = dataclasses.replace(STATE, epoch=epoch).encode()
    assert body.endswith(msgpack.packb("epoch") + msgpack.packb(epoch))
    same(body)
    assert decode_engine_report(body).state.epoch == epoch
    same(body[:-1])  # cut short


BOUNDS = [0, 1, 2**30 - 1, 2**30, 2**31, 2**32, 2**60 - 1, 2**60, 2**63, 2**64 - 1]


@compiled
@pytest.mark.parametrize("value", BOUNDS)
def test_ints_at_digit_boundaries_are_the_held_one_only_when_equal(value: int) -> None:
    """An int equal to the held one is that object (read from its digits up to two of
    them, else through the C API); one that differs anywhere, a negative one or one equal
    only in its low 64 bits is not."""
    body = dataclasses.replace(STATE, memory_total_bytes=value).encode()
    for held in {value, value + 1, abs(value - 1), -value, -value - 1, value + 2**64, 2**90}:
        previous = EngineReport(STATE.address, ReportedState(memory_total_bytes=held))
        same(body, previous)
        got = decode_engine_report(body, previous).state.memory_total_bytes
        assert type(got) is int and got == value
        assert (got is previous.state.memory_total_bytes) == (held == value), held


@pytest.mark.parametrize("value", [0, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 2**32 - 1, 2**32])
def test_integers_of_every_width_decode_as_the_reference(value: int) -> None:
    """Each msgpack integer width (fixint, uint8/16/32/64, int8/16/32/64), big-endian."""
    for width in ("B", "H", "I", "Q", "b", "h", "i", "q"):
        size = {"B": 1, "H": 2, "I": 4, "Q": 8, "b": 1, "h": 2, "i": 4, "q": 8}[width]
        signed = width.islower()
        if value >= 2 ** (8 * size - signed):
            continue
        head = {1: 0xCC, 2: 0xCD, 4: 0xCE, 8: 0xCF}[size] + (4 if signed else 0)
        raw = bytes([head]) + value.to_bytes(size, "big")
        packed = STATE.encode()
        old = msgpack.packb("requests_running") + msgpack.packb(STATE.requests_running)
        assert old in packed
        body = packed.replace(old, msgpack.packb("requests_running") + raw)
        same(body)
        assert decode_engine_report(body).state.requests_running == value


def _one(version: str) -> bytes:
    m = pb.DeltaDiscoveryResponse(type_url=T, nonce="7")
    r = m.resources.add(name="e0", version=version)
    r.resource.type_url = T
    r.resource.value = STATE.encode()
    return m.SerializeToString()


@compiled
@pytest.mark.parametrize(
    "version", ["", "a", "é", "ab", "x" * 7, "x" * 8, "x" * 9, "x" * 17, "v" * 40, "x" * 16 + "é"]
)
def test_versions_of_any_length_read_as_the_reference(version: str) -> None:
    wanted = {T: Interest(True)}
    got = read_response(_one(version), wanted, {T: decode_engine_report}, 5.0)
    want = reference_read(_one(version), wanted, {T: decode_engine_report}, 5.0)
    assert type(got) is DeltaResponse and got == want
    assert got.changed is not None
    entry = got.changed["e0"]
    assert type(entry) is Entry and type(entry.version) is str and entry.version == version


@compiled
def test_every_compiled_twin_binds_through_the_shared_slot_helper() -> None:
    """The four modules that read slots through filters/_slots.pxd bind their classes (the
    import-time binds succeeded), and refuse a field that is not a plain slot."""
    from xds import _delta_response_c, _engine_report_c, _feed_c  # type: ignore[attr-defined]

    assert control_feed.LAND_IMPLEMENTATION == "cython" and control_feed.PICKER_COMMON_IN_C
    assert EndpointState.__dict__["report"] is not endpoint_state.report_reference

    @dataclasses.dataclass(frozen=True, slots=True)
    class Reported:
        address: str
        state: ReportedState

    class Inherited(Reported):  # its slots on its base, found along the MRO
        __slots__ = ()

    class Computed(Reported):  # `address` a property over the slot: not a plain slot
        __slots__ = ()

        @property  # type: ignore[misc]
        def address(self) -> Any:
            return "x"

    try:
        assert _engine_report_c.bind(Reported, ReportedState, reference_decode)
        assert not _feed_c.bind(Entry, Computed, ReportedState)
        assert _feed_c.bind(Entry, Inherited, ReportedState)
    finally:
        assert _engine_report_c.bind(EngineReport, ReportedState, reference_decode)
        assert _feed_c.bind(Entry, EngineReport, ReportedState)
        assert _feed_c.bind_picker(
            control_feed.PickerRouter,
            control_feed.PickerRouter.__dict__["report"],
            EndpointState,
        )
    assert _delta_response_c.bind(Entry, DeltaResponse, reference_read)
    same(STATE.encode(), decode_engine_report(STATE.encode()))


@compiled
def test_the_common_path_lands_through_the_class_report_when_it_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PickerRouter.report's common path calls the compiled EndpointState.report in C
    while the class has it, and whatever the class has otherwise (here a wrapper)."""
    from filters.pool_router import EndpointSpec, PickerRouter
    from xds import _feed_c  # type: ignore[attr-defined]

    if not control_feed.PICKER_COMMON_IN_C:
        pytest.skip(control_feed.LAND_IMPLEMENTATION)
    url = "http://a:1"
    router = PickerRouter([EndpointSpec(url, gpu="H100", kv_capacity_tokens=1000)])

    def state(running: int) -> ReportedState:
        return ReportedState(
            epoch="e", requests_running=running, kv_block_size=16, kv_capacity_blocks=100
        )

    assert _feed_c.picker_report(router.report, url, state(0), 1.0, 10.0) is True
    count = _feed_c.common_path_count()
    second = state(1)
    assert _feed_c.picker_report(router.report, url, second, 2.0, 10.0) is True
    assert router.states[0].reported is second and _feed_c.common_path_count() == count + 1
    calls: list[float] = []
    original = EndpointState.report

    def counting(self: EndpointState, reported: ReportedState, now: float) -> None:
        calls.append(now)
        original(self, reported, now)

    monkeypatch.setattr(EndpointState, "report", counting)
    third = state(2)
    assert _feed_c.picker_report(router.report, url, third, 3.0, 10.0) is True
    assert calls == [3.0] and router.states[0].reported is third
    assert _feed_c.common_path_count() == count + 2
    monkeypatch.undo()
    fourth = state(3)
    assert _feed_c.picker_report(router.report, url, fourth, 4.0, 10.0) is True
    assert calls == [3.0] and router.states[0].reported is fourth
    assert router.states[0].reported_at == 4.0 and router.states[0].tokens_at_report == 0
