"""xds/resources.py: EndpointState / PrefixDigest round trips and strict decoding."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xds.resources import (
    ENDPOINT_STATE_TYPE,
    EndpointState,
    PrefixDigest,
    ResourceError,
    decode,
    decode_endpoint_state,
    decode_prefix_digest,
    decode_prefix_digest_header,
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


# -- the control plane's check of a PrefixDigest ---------------------------------------------

_U64 = st.integers(0, 2**64 - 1)
_KEYS = ("v", "engine", "epoch", "seq", "base_seq", "full", "block_size", "added", "removed")
_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 2**64 - 1),
    st.text(max_size=8),
    st.binary(max_size=40),
    st.lists(_U64, max_size=5).map(lambda xs: b"".join(x.to_bytes(8, "little") for x in xs)),
)


def _verdict(decode: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "ok", decode(body)
    except ResourceError as exc:
        return "error", str(exc)


@given(
    st.one_of(
        st.dictionaries(st.sampled_from(_KEYS), _ANY, max_size=len(_KEYS)).map(msgpack.packb),
        st.builds(
            PrefixDigest,
            engine=st.text(max_size=8),
            epoch=st.text(max_size=8),
            seq=st.integers(0, 50),
            base_seq=st.integers(0, 50),
            full=st.booleans(),
            block_size=st.integers(0, 64),
            added=st.lists(_U64, max_size=20).map(tuple),
            removed=st.lists(_U64, max_size=20).map(tuple),
        ).map(PrefixDigest.encode),
        st.binary(max_size=30),
    )
)
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_the_header_check_gives_the_full_decoders_verdict(body: bytes) -> None:
    """The control plane checks publishes with decode_prefix_digest_header: it must accept
    exactly what the subscribers' decoder accepts, with the same error, and count the
    hashes the decoder unpacks."""
    full_kind, full = _verdict(decode_prefix_digest, body)
    head_kind, head = _verdict(decode_prefix_digest_header, body)
    assert head_kind == full_kind
    if full_kind == "error":
        assert head == full
        return
    assert (head.engine, head.epoch, head.seq, head.base_seq, head.full, head.block_size) == (
        full.engine,
        full.epoch,
        full.seq,
        full.base_seq,
        full.full,
        full.block_size,
    )
    assert (head.added, head.removed) == (len(full.added), len(full.removed))
