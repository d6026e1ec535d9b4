"""A delta xDS response as the sidecar reads it: the compiled reader
xds/_delta_response_c.pyx against its reference (xds/delta_response.py reference_read:
protobuf's parse, then the resources decoded in order).

The input's first byte says what the subscriber wants of each type (per type, two bits:
not subscribed, wildcard, or a few names), and in its top bits whether EndpointState
bodies go to the compiled decoder (bit 6: the reader then decodes them in place) and
whether the response is read a second time holding what the first read gave (bit 7: the
held reports' values are reused; the answer must not change); the rest is the serialized
response. The two
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
    # The compiled decoder: the reader's in-place path (bit 6 of the first byte).
    in_place = {ENDPOINT_STATE: engine_report.decode_engine_report, BUGGY: _buggy}
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
        decs = in_place if data[0] & 0x40 else decoders
        want = outcome(documented, delta_response.reference_read, raw, wanted, decoders, 5.0)
        agree(
            "delta response",
            outcome(documented, compiled.read_response, raw, wanted, decs, 5.0),
            want,
        )
        if data[0] & 0x80 and want[0] == "ok":
            first = compiled.read_response(raw, wanted, decs, 5.0)
            held = {first.type_url: dict(first.changed or {})}
            agree(
                "delta response, read again holding the first read's",
                outcome(documented, compiled.read_response, raw, wanted, decs, 5.0, held),
                want,
            )

    return one_input
