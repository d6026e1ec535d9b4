"""A delta xDS response as the sidecar reads it: the compiled reader
xds/_delta_response_c.pyx against its reference (xds/delta_response.py reference_read:
protobuf's parse, then the resources decoded in order).

The input's first byte says what the subscriber wants of each type (per type, two bits:
not subscribed, wildcard, or a few names); the rest is the serialized response. The two
must give the same DeltaResponse (every field's type and value, Entries and decoded values
included) or the same protobuf DecodeError. Documented error: DecodeError only (a
resource that fails to decode is the response's `error`, not an exception).
"""

from __future__ import annotations

from collections.abc import Callable

from fuzz.common import agree, outcome

INCLUDE = ["xds"]

ENDPOINT_STATE = "type.googleapis.com/meshd.v1.EndpointState"
RAW = "type.googleapis.com/meshd.v1.Raw"  # no decoder: the value as bytes
BUGGY = "type.googleapis.com/meshd.v1.Buggy"  # a decoder that fails as a bug would
TYPES = (ENDPOINT_STATE, RAW, BUGGY)
NAMES = frozenset({"e0", "e1", "engine-0", "é3"})


def _buggy(body: bytes) -> bytes:
    if body[:1] == b"\x80":
        raise KeyError("bug")
    return body


def setup() -> Callable[[bytes], None]:
    from google.protobuf.message import DecodeError

    from xds import _delta_response_c as compiled  # type: ignore[attr-defined]
    from xds import delta_response, engine_report

    compiled.bind(delta_response.Entry, delta_response.DeltaResponse, delta_response.reference_read)
    # The reference decoder: what is fuzzed is the reader (fuzz/targets/endpoint_state.py
    # holds the compiled decoder to it).
    decoders = {ENDPOINT_STATE: engine_report.reference_decode, BUGGY: _buggy}
    documented = (DecodeError,)
    Interest = delta_response.Interest

    def one_input(data: bytes) -> None:
        if not data:
            return
        wanted = {}
        for i, type_url in enumerate(TYPES):
            how = data[0] >> (2 * i) & 3
            if how:
                wanted[type_url] = Interest(how == 1, set() if how == 1 else set(NAMES))
        raw = data[1:]
        agree(
            "delta response",
            outcome(documented, compiled.read_response, raw, wanted, decoders, 5.0),
            outcome(documented, delta_response.reference_read, raw, wanted, decoders, 5.0),
        )

    return one_input
