"""EndpointState bodies on the control channel (msgpack): the compiled decoder
xds/_engine_report_c.pyx against its reference (xds/engine_report.py reference_decode),
and xds/resources.py's one-pass decode_endpoint_state against its field-by-field decoder.

The input is a resource body. Each pair must give the same value (every field's type and
value) or a ResourceError with the same message; a decoded state must encode and decode
back to itself. Documented error: ResourceError only.
"""

from __future__ import annotations

from collections.abc import Callable

from fuzz.common import agree, outcome

INCLUDE = ["xds"]


def setup() -> Callable[[bytes], None]:
    from filters.endpoint_state import ReportedState
    from xds import _engine_report_c as compiled  # type: ignore[attr-defined]
    from xds import engine_report, resources
    from xds.resources import ResourceError

    compiled.bind(engine_report.EngineReport, ReportedState, engine_report.reference_decode)
    documented = (ResourceError,)

    def one_input(data: bytes) -> None:
        agree(
            "engine report",
            outcome(documented, compiled.decode_engine_report, data),
            outcome(documented, engine_report.reference_decode, data),
        )
        fast = outcome(documented, resources.decode_endpoint_state, data)
        agree(
            "endpoint state",
            fast,
            outcome(documented, resources._decode_endpoint_state_checked, data),
            ("one-pass", "field-by-field"),
        )
        if fast[0] == "ok":
            state = resources.decode_endpoint_state(data)
            again = outcome(documented, resources.decode_endpoint_state, state.encode())
            agree("endpoint state round trip", again, fast, ("re-decoded", "decoded"))

    return one_input
