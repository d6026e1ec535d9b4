"""filters/endpoint_state.py: EndpointState.report compiled (filters/_endpoint_state_c.pyx)
against the reference (`report_reference`): after any sequence of reports (epochs unset,
equal, the same object, another; restarts with calibrations learnt; the picker's view
cached or not), every field of the endpoint is the same object or value; instances and
reports of other classes take the reference."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import filters.endpoint_state as endpoint_state
from filters.endpoint_state import EndpointState, ReportedState, report_reference

compiled = pytest.mark.skipif(
    endpoint_state.IMPLEMENTATION != "cython", reason=endpoint_state.IMPLEMENTATION
)
FIELDS = [f.name for f in dataclasses.fields(EndpointState)]
EPOCHS = ["", 0, "a", "b", 1, 2, 2**70, True, False, 0.0, "é"]


class _SubState(EndpointState):
    __slots__ = ()


@dataclasses.dataclass(frozen=True, slots=True)
class _SubReported(ReportedState):
    pass


def _fields(s: EndpointState, view: object) -> list[tuple[str, Any, Any]]:
    # The views by identity (the picker compares them so): the run's own view object, None,
    # or another (each run makes its own view, so an id would differ between the runs);
    # everything else by type and value.
    out = []
    for k in FIELDS:
        v = getattr(s, k)
        t = type(v)
        if k.startswith("_pick"):
            v = "view" if v is view else "none" if v is None else "other"
        out.append((k, t, v))
    return out


def _endpoint(cls: type[EndpointState] = EndpointState) -> EndpointState:
    s = cls("e", url="http://e:8000")
    s.start("r1", 0.0, prompt_tokens=100, max_tokens=20, nominal_s=0.01, step_s=0.01)
    s.first_token("r1", 0.05)
    return s


step = st.tuples(
    st.sampled_from(EPOCHS),
    st.integers(0, 3),  # a new ReportedState (0: the previous one again) or a subclass (3)
    st.booleans(),  # a picker view cached before the report
    st.booleans(),  # a request started before the report (local load, calibration)
)


def _run(report: Any, steps: list[tuple[Any, int, bool, bool]]) -> list[Any]:
    s = _endpoint()
    state: ReportedState | None = None
    view = object()
    trace = []
    for n, (epoch, kind, viewed, busy) in enumerate(steps):
        if busy:
            s.start(f"q{n}", float(n), prompt_tokens=10 + n, max_tokens=n)
            s.first_token(f"q{n}", float(n) + 0.5)
        if viewed:
            s._pick_view = view
        if state is None or kind:
            cls = _SubReported if kind == 3 else ReportedState
            state = cls(epoch=epoch, requests_running=n, kv_block_size=16)
        report(s, state, float(n) + 0.25)
        trace.append(_fields(s, view))
    return trace


@compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=12))
def test_the_compiled_report_leaves_every_field_as_the_reference(
    steps: list[tuple[Any, int, bool, bool]],
) -> None:
    assert _run(EndpointState.report, steps) == _run(report_reference, steps)


@compiled
def test_the_method_is_the_compiled_twin_and_a_restart_resets_the_calibration() -> None:
    assert EndpointState.report is not report_reference
    s = _endpoint()
    s.report(ReportedState(epoch="a"), 1.0)
    s.ttft_ratio = s.decode_ratio = 2.0
    s.ttft_sampled = (2.0, 1.0, 0.0)
    v0, sv0 = s.version, s.static_version
    s.report(ReportedState(epoch="a"), 2.0)  # the same epoch: what was learnt stays
    assert (s.ttft_ratio, s.version, s.static_version) == (2.0, v0 + 1, sv0 + 1)
    view = s._pick_view = object()
    state = ReportedState(epoch="b")
    s.report(state, 3.0)
    assert (s.ttft_ratio, s.decode_ratio, s.ttft_sampled, s.decode_sampled) == (
        1.0,
        1.0,
        None,
        None,
    )
    assert s.reported is state and s.reported_at == 3.0
    assert s._pick_view is None and s._pick_stale is view
    assert s.tokens_at_report == s.tokens_in_flight == 120


@compiled
def test_other_classes_take_the_reference() -> None:
    # A subclass of EndpointState, a report of another class: the same answers, through
    # the reference (the compiled one reads exact classes' slots only).
    for cls in (EndpointState, _SubState):
        s = _endpoint(cls)
        s.report(_SubReported(epoch="a"), 1.0)
        s.ttft_ratio = 3.0
        s.report(ReportedState(epoch="b"), 2.0)
        assert s.ttft_ratio == 1.0 and type(s.reported) is ReportedState
    with pytest.raises(AttributeError):
        EndpointState.report(object(), ReportedState(), 1.0)  # type: ignore[arg-type]
