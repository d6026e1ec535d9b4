"""xds/resources.py: EndpointState / PrefixDigest round trips and strict decoding."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xds.resources import (
    ENDPOINT_STATE_TYPE,
    EndpointState,
    PrefixDigest,
    ResourceError,
    decode,
    decode_endpoint_state,
    decode_prefix_digest,
)

STATE = EndpointState(
    address="10.0.0.7:8000",
    pool="h100",
    model="llama-8b",
    adapters={"sql": True, "chat": False},
    gpu="H100",
    gpu_count=2,
    memory_total_bytes=160 * 2**30,
    memory_used_bytes=100 * 2**30,
    kv_block_size=16,
    kv_capacity_blocks=40_000,
    kv_usage=0.5,
    requests_running=4,
    requests_waiting=1,
    tokens_in_flight=9000,
    ttft_s=0.2,
    tpot_s=0.02,
    healthy=True,
    draining=False,
    epoch="e1",
)


def test_endpoint_state_round_trip_and_reported_view() -> None:
    assert decode_endpoint_state(STATE.encode()) == STATE
    r = STATE.to_reported()
    assert r.kv_capacity_tokens == 16 * 40_000
    assert r.adapters == {"sql": True, "chat": False}
    assert r.models == {"llama-8b": True}


def test_unknown_keys_ignored_missing_keys_default() -> None:
    body = msgpack.packb({"v": 1, "address": "h:1", "future_field": [1, 2]})
    s = decode_endpoint_state(body)
    assert s.address == "h:1" and s.requests_running == 0 and s.healthy


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # never valid msgpack
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 2, "address": "h:1"}),
        msgpack.packb({"address": ""}),
        msgpack.packb({"address": "h:1", "kv_usage": 1.5}),
        msgpack.packb({"address": "h:1", "requests_running": -1}),
        msgpack.packb({"address": "h:1", "healthy": 1}),
        msgpack.packb({"address": "h:1", "adapters": {"a": 1}}),
        msgpack.packb({"address": "h:1", "kv_block_size": 0}),
        msgpack.packb({1: 2}),
    ],
)
def test_malformed_endpoint_state_refused(body: bytes) -> None:
    with pytest.raises(ResourceError):
        decode_endpoint_state(body)


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_resource_error(body: bytes) -> None:
    # The one-error property: arbitrary bytes either decode or raise ResourceError.
    for decoder in (decode_endpoint_state, decode_prefix_digest):
        with contextlib.suppress(ResourceError):
            decoder(body)


@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=50),
    st.lists(st.integers(0, 2**64 - 1), max_size=50),
)
def test_prefix_digest_round_trip_and_apply(added: list[int], removed: list[int]) -> None:
    full = PrefixDigest(
        "e", "ep", seq=3, base_seq=3, full=True, block_size=16, added=tuple(removed)
    )
    delta = PrefixDigest(
        "e",
        "ep",
        seq=9,
        base_seq=3,
        full=False,
        block_size=16,
        added=tuple(added),
        removed=tuple(removed),
    )
    assert decode_prefix_digest(full.encode()) == full
    assert decode_prefix_digest(delta.encode()) == delta
    base = full.apply(set())
    assert delta.apply(base) == (base - set(removed)) | set(added)


def test_prefix_digest_inconsistent_refused() -> None:
    bad = PrefixDigest("e", "ep", seq=3, base_seq=4, full=False, block_size=16).encode()
    with pytest.raises(ResourceError):
        decode_prefix_digest(bad)
    with pytest.raises(ResourceError):
        decode_prefix_digest(
            msgpack.packb(
                {"seq": 1, "base_seq": 1, "full": True, "block_size": 16, "added": b"123"}
            )
        )


def test_unknown_type_passes_through() -> None:
    assert decode("type.googleapis.com/other", b"raw") == b"raw"
    assert decode(ENDPOINT_STATE_TYPE, STATE.encode()) == STATE
