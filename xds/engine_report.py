"""An EndpointState resource decoded straight into what a sidecar's routers take: the
engine's address (to find its endpoints) and its ReportedState (the picker's view), with
no EndpointState in between. The sidecar's control feed (meshd/control_feed.py) subscribes
with this decoder; it accepts and refuses exactly the bodies decode_endpoint_state does,
with the same ResourceError message.

`decode_engine_report` is the compiled twin (xds/_engine_report_c.pyx) when built, else
the reference below; MESHD_PURE_PYTHON=1 forces the reference. tests/test_engine_report.py
checks that the two agree on arbitrary bodies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from filters.endpoint_state import ReportedState
from xds.resources import decode_endpoint_state

__all__ = [
    "IMPLEMENTATION",
    "EngineReport",
    "ReportDecoder",
    "decode_engine_report",
    "reference_decode",
]


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One engine's EndpointState as a router takes it."""

    address: str  # as published: "host:port", maybe with a scheme
    state: ReportedState


def reference_decode(body: bytes, previous: EngineReport | None = None) -> EngineReport:
    """The reference: decode_endpoint_state, then EndpointState.to_reported. `previous`
    (the report this one replaces) changes no answer: the compiled decoder takes the
    values equal to its from it instead of building them again."""
    s = decode_endpoint_state(body)
    return EngineReport(s.address, s.to_reported())


class ReportDecoder(Protocol):
    """reference_decode's signature (the compiled twin's too)."""

    def __call__(self, body: bytes, previous: EngineReport | None = None, /) -> EngineReport: ...


decode_engine_report: ReportDecoder = reference_decode
IMPLEMENTATION = "python (forced by MESHD_PURE_PYTHON)"
if not os.environ.get("MESHD_PURE_PYTHON"):
    try:
        from xds import _engine_report_c  # type: ignore[attr-defined]
    except ImportError:
        IMPLEMENTATION = "python (compiled extension not built)"
    else:
        _engine_report_c.bind(EngineReport, ReportedState, reference_decode)
        decode_engine_report = _engine_report_c.decode_engine_report
        IMPLEMENTATION = "cython"
