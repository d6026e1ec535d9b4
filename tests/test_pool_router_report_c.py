"""PickerRouter.report's common path taken in the control feed's compiled loop
(xds/_feed_c.pyx's _picker_common, bound by meshd/control_feed.py) against the method, the
reference: over random report sequences (a new state, the same object renewed, a TTL
change, a capacity or block size change, None, an unknown url, a stale report, int and
float clocks and TTLs) both leave every router and EndpointState field the same and
return the same; the common path is taken where it applies, through land_reports too."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshd.control_feed as control_feed
from filters.endpoint_state import EndpointState, ReportedState
from filters.pool_router import EndpointSpec, PickerRouter
from meshd.control_feed import land_reports
from xds.delta_response import _entry
from xds.engine_report import EngineReport

compiled = pytest.mark.skipif(
    not control_feed.PICKER_COMMON_IN_C, reason=control_feed.LAND_IMPLEMENTATION
)
URLS = ["http://a:1", "http://b:1", "http://c:1"]
FIELDS = [f.name for f in dataclasses.fields(EndpointState)]
VIEW = object()
SIZES = [None, 16, 32, 2**70, True]
TTLS = [10.0, 10.0, 10.0, 3.0, 10, float("nan")]


def _router() -> PickerRouter:
    return PickerRouter([EndpointSpec(u, gpu="H100", kv_capacity_tokens=1000) for u in URLS])


def _state_of(router: PickerRouter) -> list[Any]:
    out: list[Any] = [router.kv_version, router._kv_cache]
    for s in router.states:
        for k in FIELDS:
            v = getattr(s, k)
            if v is VIEW:
                out.append((k, "view"))
            elif k == "_pick_view":
                out.append((k, v is None))
            else:
                out.append((k, type(v), repr(v)))
    return out


# (url index (3: unknown), the report (0 a new one, the same sizes; 1 the held object
# again; 2 another block size; 3 another capacity; 4 None; 5 sizes from SIZES), TTL index,
# clock step (3: past the TTL), an int clock, a picker view cached, kv_capacities asked)
step = st.tuples(
    st.integers(0, 3),
    st.integers(0, 5),
    st.integers(0, len(TTLS) - 1),
    st.integers(0, 3),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)


def _run(tell: Any, steps: list[tuple[int, int, int, int, bool, bool, bool]]) -> list[Any]:
    router = _router()
    held: dict[str, ReportedState | None] = {}
    now = 100.0
    trace: list[Any] = []
    for n, (u, kind, t, dt, int_clock, viewed, asked) in enumerate(steps):
        url = URLS[u] if u < 3 else "http://unknown:1"
        now += (0.0, 0.5, 2.0, 30.0)[dt]
        at: Any = int(now) if int_clock else now
        before = held.get(url)
        size, cap = (
            (16, 100) if before is None else (before.kv_block_size, before.kv_capacity_blocks)
        )
        state: ReportedState | None
        if kind == 1 and before is not None:
            state = before
        elif kind == 2:
            state = ReportedState(epoch="e", kv_block_size=SIZES[n % 5], kv_capacity_blocks=cap)
        elif kind == 3:
            state = ReportedState(epoch="e", kv_block_size=size, kv_capacity_blocks=n)
        elif kind == 4:
            state = None
        elif kind == 5:
            state = ReportedState(
                epoch="e", kv_block_size=SIZES[n % 5], kv_capacity_blocks=SIZES[n % 4]
            )
        else:
            state = ReportedState(
                epoch="e", requests_running=n, kv_block_size=size, kv_capacity_blocks=cap
            )
        held[url] = state
        if viewed:
            for s in router.states:
                s._pick_view = VIEW
        trace.append(("returned", tell(router, url, state, at, TTLS[t])))
        if asked:
            trace.append(("caps", dict(router.kv_capacities(at))))
        trace.append(_state_of(router))
    return trace


def _method(router: PickerRouter, url: str, state: Any, now: Any, ttl_s: Any) -> Any:
    return router.report(url, state, now, ttl_s=ttl_s)


def _compiled(router: PickerRouter, url: str, state: Any, now: Any, ttl_s: Any) -> Any:
    return _c().picker_report(router.report, url, state, now, ttl_s)


def _c() -> Any:
    return control_feed._feed_c


@compiled
@settings(max_examples=400, deadline=None)
@given(st.lists(step, max_size=16))
def test_the_common_path_leaves_every_field_as_the_method(
    steps: list[tuple[int, int, int, int, bool, bool, bool]],
) -> None:
    # NaN TTLs: compare the traces' reprs (nan != nan in the values).
    assert repr(_run(_compiled, steps)) == repr(_run(_method, steps))


@compiled
def test_the_common_path_is_taken_for_a_fresh_report_with_the_same_sizes() -> None:
    _feed_c = _c()
    router = _router()
    first = ReportedState(epoch="e", kv_block_size=16, kv_capacity_blocks=100)
    assert _feed_c.picker_report(router.report, URLS[0], first, 1.0, 10.0) is True
    count = _feed_c.common_path_count()
    version = router.kv_version
    second = ReportedState(epoch="e", requests_running=3, kv_block_size=16, kv_capacity_blocks=100)
    assert _feed_c.picker_report(router.report, URLS[0], second, 2.0, 10.0) is True
    assert _feed_c.common_path_count() == count + 1
    assert router.states[0].reported is second and router.states[0].reported_at == 2.0
    assert router.kv_version == version
    # Not the common path: the method (a capacity change moves kv_version).
    third = ReportedState(epoch="e", kv_block_size=16, kv_capacity_blocks=101)
    assert _feed_c.picker_report(router.report, URLS[0], third, 3.0, 10.0) is True
    assert _feed_c.common_path_count() == count + 1 and router.kv_version == version + 1
    assert _feed_c.picker_report(router.report, "http://x:1", third, 3.0, 10.0) is False


class _SubRouter(PickerRouter):
    pass


@compiled
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.booleans()), max_size=10))
def test_land_reports_into_picker_routers_as_the_reference(
    spec: list[tuple[int, int, bool]],
) -> None:
    """The feed's loop with PickerRouters (and a subclass, which takes the method) as
    targets: the same fields as the reference loop leaves."""

    def outcome(land: Any) -> list[Any]:
        routers = [_router(), _SubRouter([EndpointSpec(u) for u in URLS])]
        targets = {u: tuple((f"p{k}", u, r.report) for k, r in enumerate(routers)) for u in URLS}
        by_address = {f"h{i}": targets[u] for i, u in enumerate(URLS)}
        engines = {f"e{i}": targets[u] for i, u in enumerate(URLS)}
        reports: dict[str, Any] = {}
        for i, u in enumerate(URLS):
            reports[f"e{i}"] = ReportedState(epoch="e", kv_block_size=16, kv_capacity_blocks=9)
            for r in routers:
                r.report(u, reports[f"e{i}"], 0.0, ttl_s=10.0)
        log: list[Any] = []
        now = 0.0
        for n, (engine, cap, later) in enumerate(spec):
            now += 20.0 if later else 1.0
            state = ReportedState(
                epoch="e", requests_running=n, kv_block_size=16, kv_capacity_blocks=9 + cap
            )
            name = f"e{engine}" if engine < 3 else "other"
            changed = {name: _entry(name, str(n), EngineReport(f"h{engine}", state), 0.0)}

            def on_state(name: str, report: Any, now: float) -> None:
                log.append(("on_state", name, now))

            log.append(land(changed, engines, reports, by_address, now, 10.0, on_state))
        return [log] + [_state_of(r) for r in routers]

    before = _c().common_path_count()
    assert outcome(control_feed._land_reports) == outcome(land_reports)
    last = [0, 0, 0]  # each engine's capacity offset held
    at = [0.0, 0.0, 0.0]  # and when it came
    common, now = False, 0.0
    for engine, cap, later in spec:
        now += 20.0 if later else 1.0
        if engine < 3:
            common = common or (cap == last[engine] and now - at[engine] < 10.0)
            last[engine], at[engine] = cap, now
    assert (_c().common_path_count() > before) == common
