"""meshd/control_feed.py's land_reports: the compiled twin (xds/_feed_c.pyx) against the
reference, on any tables: engines followed or not, at their address or another, in the
held epoch or not (the same object, an equal one, another), values that are not
EngineReports; the same calls to the routers and to on_state in the same order, the same
held states and count, the same errors."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshd.control_feed as control_feed
from filters.endpoint_state import ReportedState
from meshd.control_feed import land_reports
from xds.delta_response import Entry, _entry
from xds.engine_report import EngineReport

compiled = pytest.mark.skipif(
    control_feed.LAND_IMPLEMENTATION != "cython", reason=control_feed.LAND_IMPLEMENTATION
)
EPOCHS = ["a", "b", "", 0, 1, 2**70, True]
ADDRESSES = ["h0:1", "h1:1", "h2:1"]


def _tables(
    log: list[Any], spec: list[tuple[int, int, int, int]], epoch_of: list[Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(changed, engines, reports, by_address) for a response of `spec`: per resource
    (engine, what it is followed as, its report's address, its epoch's index)."""

    def teller(tag: str) -> Callable[..., bool]:
        def tell(url: str, state: Any, now: float, *, ttl_s: float) -> bool:
            log.append(("tell", tag, url, state.requests_running, now, ttl_s))
            return True

        return tell

    targets = {
        a: tuple((f"pool{k}", f"http://{a}/{k}", teller(f"{a}/{k}")) for k in range(i % 3))
        for i, a in enumerate(ADDRESSES)
    }
    by_address: dict[str, Any] = {a: targets[a] for a in ADDRESSES[:2]}
    engines: dict[str, Any] = {}
    reports: dict[str, Any] = {}
    changed: dict[str, Entry] = {}
    for n, (engine, followed, addr, epoch) in enumerate(spec):
        name = f"e{engine}"
        held_epoch = epoch_of[engine % len(epoch_of)]
        if followed:
            engines[name] = targets[ADDRESSES[followed % 3]]
            if followed != 3:  # 3: followed, no state held (the reference's KeyError)
                reports[name] = ReportedState(epoch=held_epoch)
        if addr == 3:
            value: Any = "not a report"
        else:
            # epoch 0: the held epoch object itself; else one from EPOCHS (maybe equal).
            e = held_epoch if epoch == 0 else EPOCHS[epoch % len(EPOCHS)]
            value = EngineReport(ADDRESSES[addr], ReportedState(epoch=e, requests_running=n))
        changed[name] = _entry(name, str(n), value, 0.0)
    return changed, engines, reports, by_address


def _outcome(land: Any, spec: list[tuple[int, int, int, int]], proxy: bool) -> list[Any]:
    log: list[Any] = []
    epoch_of = ["a", 2**70, "", 1]
    changed, engines, reports, by_address = _tables(log, spec, epoch_of)

    def on_state(name: str, report: Any, now: float) -> None:
        log.append(("on_state", name, report.state.requests_running, now))

    try:
        mapping: Any = MappingProxyType(changed) if proxy else changed
        log.append(("applied", land(mapping, engines, reports, by_address, 5.0, 7.0, on_state)))
    except Exception as exc:
        log.append(("raised", type(exc), str(exc)))
    log.append(("reports", sorted((k, v.requests_running) for k, v in reports.items())))
    return log


spec = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 3), st.integers(0, 7)),
    max_size=12,
)


@compiled
@settings(max_examples=400, deadline=None)
@given(spec, st.booleans())
def test_the_compiled_loop_calls_and_returns_as_the_reference(
    spec: list[tuple[int, int, int, int]], proxy: bool
) -> None:
    assert _outcome(control_feed._land_reports, spec, proxy) == _outcome(land_reports, spec, proxy)


@compiled
def test_a_router_error_and_odd_targets_propagate_as_in_the_reference() -> None:
    def fails(url: str, state: Any, now: float, *, ttl_s: float) -> bool:
        raise ValueError(url)

    state = ReportedState(epoch="a")
    for targets in (
        (("p", "u", fails),),
        [("p", "u", fails)],  # not a tuple: iterated as the reference does
        (("p", "u"),),  # not three: a ValueError (unpacking's; Cython words it otherwise)
    ):
        outcomes = []
        for land in (control_feed._land_reports, land_reports):
            changed = {"e": _entry("e", "1", EngineReport("h:1", state), 0.0)}
            try:
                land(changed, {"e": targets}, {"e": state}, {"h:1": targets}, 1.0, 2.0, print)
            except Exception as exc:
                outcomes.append((type(exc), "unpack" in str(exc) or str(exc)))
        assert len(outcomes) == 2 and outcomes[0] == outcomes[1]
