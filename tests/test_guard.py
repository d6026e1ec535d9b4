"""PoolGuard (filters/guard.py): the order in which throttle, admission, breaker and outlier
detector speak, and what each attempt outcome means to them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from filters.admission import AdmissionConfig, AdmissionItem, Admit, Queue
from filters.guard import RAMP_STEP, EndpointFlags, GuardConfig, GuardEvents, PoolGuard, Throttled
from filters.outlier import OutlierConfig
from filters.slow_start import SlowStartConfig
from filters.throttle import AdaptiveThrottleConfig
from filters.token_breaker import Limits, TokenBreakerConfig


@dataclass(frozen=True)
class R:
    url: str


class Rng:
    def __init__(self, v: float) -> None:
        self.v = v

    def random(self) -> float:
        return self.v


def guard(**kw: object) -> PoolGuard:
    cfg = GuardConfig(**kw)  # type: ignore[arg-type]
    return PoolGuard(cfg, ["a", "b"])


def test_consecutive_failures_open_the_breaker_and_screen_skips_it() -> None:
    g = guard(breaker=TokenBreakerConfig(consecutive_failures=2), outlier=None)
    for i in range(2):
        g.started("a", i, 10, 0.0)
        g.finished("a", i, 0.1, local_failure=True)
    s = g.screen([R("a"), R("b")], 10, None, 0.2)
    assert [r.url for r in s.routes] == ["b"]
    assert s.skipped == [("a", "breaker-open")]
    assert g.tick(0.2).breaker[-1].new == "open"


def test_overload_statuses_are_not_failures() -> None:
    g = guard(
        breaker=TokenBreakerConfig(consecutive_failures=1), outlier=OutlierConfig(consecutive_5xx=1)
    )
    g.started("a", 1, 10, 0.0)
    g.finished("a", 1, 0.1, status=429)
    g.started("a", 2, 10, 0.2)
    g.finished("a", 2, 0.3, status=503)
    assert [r.url for r in g.screen([R("a")], 10, None, 0.4).routes] == ["a"]
    g.started("a", 3, 10, 0.5)
    g.finished("a", 3, 0.6, status=500)
    s = g.screen([R("a")], 10, None, 0.7)
    assert s.routes == [] and not s.full


def test_an_endpoint_that_only_says_503_is_ejected_and_429_never() -> None:
    # Issue #21, found as a new user: an engine answering 503 to everything stayed the
    # first pick for 87 of 87 requests. A moment's 503 is overload; a streak is a failure.
    from filters.guard import REFUSALS_AS_FAILURE

    g = guard(breaker=None, outlier=OutlierConfig(consecutive_5xx=2))
    t = 0.0
    for i in range(REFUSALS_AS_FAILURE - 1):  # a short streak, then an answer: overload
        g.finished("a", i, t, status=503)
        t += 0.1
    g.finished("a", "ok", t, status=200)
    for i in range(50):  # a busy engine saying 429 is never ejected
        g.finished("b", ("b", i), t, status=429)
    assert [r.url for r in g.screen([R("a"), R("b")], 1, None, t).routes] == ["a", "b"]
    for i in range(REFUSALS_AS_FAILURE + 1):  # only ever 503: from the 5th on, failures
        g.finished("a", ("s", i), t, status=503)
        t += 0.1
    s = g.screen([R("a"), R("b")], 1, None, t)
    assert [r.url for r in s.routes] == ["b"] and s.skipped == [("a", "ejected")]


def test_outlier_ejection_removes_the_route() -> None:
    g = guard(breaker=None, outlier=OutlierConfig(consecutive_5xx=2))
    for i in range(2):
        g.finished("a", i, 0.0, status=502)
    s = g.screen([R("a"), R("b")], 1, None, 1.0)
    assert [r.url for r in s.routes] == ["b"] and s.skipped == [("a", "ejected")]
    assert g.tick(1.0).outlier[0].action == "eject"


def test_busy_endpoints_say_full_not_broken() -> None:
    g = guard(breaker=TokenBreakerConfig(endpoint_limits=Limits(max_requests=1)), outlier=None)
    g.started("a", 1, 10, 0.0)
    g.started("b", 2, 10, 0.0)
    s = g.screen([R("a"), R("b")], 10, None, 0.1)
    assert s.routes == [] and s.full
    g.finished("a", 1, 0.2, status=200)
    assert [r.url for r in g.screen([R("a"), R("b")], 10, None, 0.3).routes] == ["a"]


def test_admission_queues_beyond_capacity_and_pump_wakes_in_order() -> None:
    g = guard(admission=AdmissionConfig(max_in_flight=1), breaker=None, outlier=None)
    assert isinstance(g.gate(AdmissionItem(1), 0.0, Rng(1.0)), Admit)
    assert isinstance(g.gate(AdmissionItem(2, priority=1), 0.0, Rng(1.0)), Queue)
    assert isinstance(g.gate(AdmissionItem(3, priority=8), 0.0, Rng(1.0)), Queue)
    assert g.pump(0.1).dispatch == []
    g.release(1, 0.2)
    assert [i.id for i in g.pump(0.2).dispatch] == [3]  # the higher priority first


def test_throttle_refuses_locally_once_the_pool_refuses_most() -> None:
    g = guard(
        throttle=AdaptiveThrottleConfig(min_requests=10), admission=None, breaker=None, outlier=None
    )
    for i in range(30):
        assert not isinstance(g.gate(AdmissionItem(i), 0.0, Rng(1.0)), Throttled)
        g.finished("a", i, 0.0, status=429)  # never accepted
    d = g.gate(AdmissionItem(99), 0.0, Rng(0.0))
    assert isinstance(d, Throttled) and d.p_reject > 0.9
    assert "throttling" in d.message


# -- flags for the router, and slow start ------------------------------------------------


def flagged(ev: GuardEvents) -> dict[str, EndpointFlags]:
    return {f.url: f for f in ev.flags}


def test_an_open_breaker_is_published_at_once_then_half_open_then_a_ramp() -> None:
    g = guard(
        breaker=TokenBreakerConfig(consecutive_failures=2, open_base_s=5.0, half_open_successes=1),
        outlier=None,
        slow_start=SlowStartConfig(window_s=10.0, min_weight_percent=10.0),
    )
    assert g.tick(0.0).flags == []  # the pool's first endpoints do not ramp
    for i in range(2):
        g.started("a", i, 10, 0.0)
        g.finished("a", i, 0.1, local_failure=True)
    # The next pump (every request's end calls one) says so, before any tick.
    assert flagged(g.pump(0.1)) == {"a": EndpointFlags("a", breaker_open=True, ramp=0.1)}
    assert g.pump(0.2).flags == [] and g.tick(1.0).flags == []  # nothing new
    half = flagged(g.tick(5.1))["a"]
    assert not half.breaker_open and half.ramp == pytest.approx(0.1)  # the probe may go
    assert [r.url for r in g.screen([R("a")], 10, None, 5.2).routes] == ["a"]
    g.started("a", 9, 10, 5.2)
    g.finished("a", 9, 5.5, status=200)  # the probe succeeds: closed
    # Closed, and ramping from the minimum: the router's view is what half-open gave it.
    assert g.pump(5.5).flags == []
    closed = g.flags("a", 5.5)
    assert not closed.breaker_open and closed.ramp == pytest.approx(0.1)
    # Linear from the close at 5.5 over the 10 s window (Envoy's formula, aggression 1).
    assert g.flags("a", 10.5).ramp == pytest.approx(0.5)
    ramps = []
    t = 5.5
    while t < 17.0:
        t += 0.25
        ramps += [f.ramp for f in g.tick(t).flags]
    assert ramps == sorted(ramps) and ramps[-1] == 1.0 and ramps.count(1.0) == 1
    assert all(b - a >= RAMP_STEP - 1e-9 for a, b in itertools.pairwise(ramps))
    assert g.tick(20.0).flags == []


def test_ramp_values_follow_the_slow_start_window() -> None:
    g = guard(breaker=None, outlier=None, slow_start=SlowStartConfig(window_s=10.0))
    g.add("c", now=100.0)  # joined a running pool
    assert flagged(g.pump(100.0))["c"].ramp == pytest.approx(0.1)
    assert g.flags("c", 105.0).ramp == pytest.approx(0.5)
    assert g.flags("c", 107.5).ramp == pytest.approx(0.75)
    assert flagged(g.tick(110.0))["c"].ramp == 1.0
    g.restarted("c", 200.0)  # a new epoch: an empty cache ramps again
    assert flagged(g.tick(201.0))["c"].ramp == pytest.approx(0.1)


def test_ejection_is_published_and_its_end_starts_a_ramp() -> None:
    g = guard(
        breaker=None,
        outlier=OutlierConfig(consecutive_5xx=2, base_ejection_time_s=30.0),
        slow_start=SlowStartConfig(window_s=60.0, min_weight_percent=10.0),
    )
    for i in range(2):
        g.finished("a", i, 1.0, status=502)
    f = flagged(g.pump(1.0))["a"]
    assert f.ejected_until == pytest.approx(31.0) and not f.breaker_open
    assert f.ramp == pytest.approx(0.1)  # what it comes back at, when the clock says so
    assert g.tick(10.0).flags == []
    back = flagged(g.tick(31.0))["a"]
    assert back.ejected_until is None and back.ramp == pytest.approx(0.1)
    assert g.flags("a", 61.0).ramp == pytest.approx(0.5)


def test_without_slow_start_recovery_is_at_full_weight() -> None:
    g = guard(
        breaker=TokenBreakerConfig(consecutive_failures=1, open_base_s=1.0),
        outlier=None,
        slow_start=None,
    )
    g.started("a", 1, 10, 0.0)
    g.finished("a", 1, 0.0, local_failure=True)
    assert flagged(g.pump(0.0))["a"].breaker_open
    assert flagged(g.tick(1.5)) == {"a": EndpointFlags("a")}  # half-open, weight 1
    g.add("c", now=2.0)
    assert g.tick(2.0).flags == []


def test_screen_shrinks_a_ramping_endpoints_limits() -> None:
    g = guard(
        breaker=TokenBreakerConfig(endpoint_limits=Limits(max_requests=10)),
        outlier=None,
        slow_start=SlowStartConfig(window_s=10.0, min_weight_percent=20.0),
    )
    g.add("c", now=0.0)
    g.started("c", 1, 10, 0.0)
    g.started("c", 2, 10, 0.0)  # 2 of 10 * 0.2 (x 0.9, the default priority's share)
    s = g.screen([R("c"), R("a")], 10, None, 0.0)
    assert [r.url for r in s.routes] == ["a"] and s.skipped[0][0] == "c"
    assert [r.url for r in g.screen([R("c")], 10, None, 10.0).routes] == ["c"]  # full weight


def test_streams_in_flight_and_client_timeouts_are_not_refusals_to_the_throttle() -> None:
    g = guard(
        throttle=AdaptiveThrottleConfig(min_requests=10), admission=None, breaker=None, outlier=None
    )
    for i in range(40):  # long streams: started, streaming, none finished yet
        assert not isinstance(g.gate(AdmissionItem(i), 0.0, Rng(0.0)), Throttled)
        g.started("a", i, 10, 0.0)
        g.first_token(i, 0.1)
    for i in range(40):  # then every client gives up mid-stream
        g.finished("a", i, 5.0, status=200, cancelled=True)
    for i in range(40, 60):  # headers came, the client left before the first token
        assert not isinstance(g.gate(AdmissionItem(i), 5.0, Rng(0.0)), Throttled)
        g.finished("a", i, 5.5, status=200, cancelled=True)
    assert g.throttle is not None and g.throttle.p_reject(6.0) == 0.0
    assert g.throttle.accepts == 60


def test_a_burst_of_whole_requests_in_flight_is_not_throttled() -> None:
    # Found with the fallback tests: 24 requests moved at once onto a fresh pool, non-
    # streamed, none answered yet, read as 24 refusals (p = 24/25) and 4 were throttled.
    g = guard(
        throttle=AdaptiveThrottleConfig(min_requests=10), admission=None, breaker=None, outlier=None
    )
    for i in range(40):
        assert not isinstance(g.gate(AdmissionItem(i), 0.0, Rng(0.0)), Throttled)
        g.started("a", i, 10, 0.0)
    for i in range(40):
        g.finished("a", i, 20.0, status=200)
    assert g.throttle is not None and g.throttle.p_reject(20.0) == 0.0
    for i in range(40, 140):  # then the pool sheds everything: the throttle sees it
        g.gate(AdmissionItem(i), 21.0, Rng(1.0))
        g.finished("a", i, 21.0, status=503)
    assert g.throttle.p_reject(22.0) > 0


def test_an_endpoint_whose_streams_clients_abandon_far_too_slow_is_ejected() -> None:
    g = PoolGuard(
        GuardConfig(
            throttle=None,
            admission=None,
            breaker=None,
            outlier=OutlierConfig(consecutive_5xx=3, max_ejection_percent=50.0),
            slow_abandon_factor=3.0,
        ),
        ["a", "b", "c"],
    )
    t, rid = 0.0, 0
    for _ in range(10):  # the pool's pace: 1 s for 100 expected tokens
        for url in ("a", "b"):
            g.started(url, rid, 100, t)
            g.finished(url, rid, t + 1.0, status=200)
            rid += 1
        t += 1.0
    # Abandoned at 2 s (twice the pace): a client's own hurry, not the endpoint's fault.
    for _ in range(5):
        g.started("c", rid, 100, t)
        g.finished("c", rid, t + 2.0, status=200, cancelled=True)
        rid += 1
    assert not g.outlier.ejected("c", t + 2.0)  # type: ignore[union-attr]
    for _ in range(3):  # abandoned at 4 s: ejected after three in a row
        g.started("c", rid, 100, t)
        g.finished("c", rid, t + 4.0, status=200, cancelled=True)
        rid += 1
    assert g.slow_abandons == 3
    assert flagged(g.pump(t + 4.0))["c"].ejected_until is not None


def test_slow_abandon_tracking_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import filters.guard

    monkeypatch.setattr(filters.guard, "MAX_TRACKED_FLIGHTS", 2)
    g = PoolGuard(GuardConfig(throttle=None, admission=None, breaker=None), ["a", "b"])
    for rid in range(10):  # the pool's pace
        g.started("a", rid, 100, 0.0)
        g.finished("a", rid, 1.0, status=200)
    for rid in (10, 11, 12):  # three in flight at once: the third is not tracked
        g.started("b", rid, 100, 0.0)
    for rid in (10, 11, 12):
        g.finished("b", rid, 10.0, status=200, cancelled=True)
    assert g.slow_abandons == 2


def test_a_continuation_is_not_held_back_by_in_flight_limits() -> None:
    g = guard(
        breaker=TokenBreakerConfig(
            endpoint_limits=Limits(max_requests=1), consecutive_failures=1, open_base_s=60.0
        ),
        outlier=None,
    )
    g.started("a", 1, 10, 0.0)  # a at its limit
    g.started("b", 2, 10, 0.0)
    g.finished("b", 2, 0.1, local_failure=True)  # b open
    assert g.screen([R("a"), R("b")], 10, None, 0.2).full
    s = g.screen([R("a"), R("b")], 10, None, 0.2, continuation=True)
    assert [r.url for r in s.routes] == ["a"] and s.skipped == [("b", "breaker-open")]


def test_a_restart_ends_an_ejection_and_an_open_breaker_and_ramps_it_in() -> None:
    # Issue #21's campaign: a killed engine, restarted at once, stayed out for the
    # ejection's 30 s. A restart (a new epoch) means what failed is gone.
    g = guard(
        breaker=TokenBreakerConfig(consecutive_failures=2, open_base_s=60.0),
        outlier=OutlierConfig(consecutive_5xx=2, base_ejection_time_s=30.0),
        slow_start=SlowStartConfig(window_s=10.0, min_weight_percent=10.0),
    )
    for i in range(2):
        g.started("a", i, 10, 1.0)
        g.finished("a", i, 1.0, local_failure=True)
    f = flagged(g.pump(1.0))["a"]
    assert f.breaker_open and f.ejected_until == pytest.approx(31.0)
    assert g.screen([R("a"), R("b")], 10, None, 2.0).skipped[0][0] == "a"
    g.restarted("a", 3.0)
    back = flagged(g.pump(3.0))["a"]
    assert not back.breaker_open and back.ejected_until is None
    # Half-open: its probe goes; the ramp starts once the probes close it.
    assert [r.url for r in g.screen([R("a")], 10, None, 3.0).routes] == ["a"]
    assert g.breaker is not None and g.breaker.state("a", 3.0) == "half-open"
    events = g.tick(3.1)
    assert [(o.action, o.reason) for o in events.outlier] == [
        ("eject", "consecutive_5xx"),
        ("uneject", "restarted"),
    ]
    # Ejected again, it is out longer (the ejection count stayed).
    for i in range(2):
        g.finished("a", ("x", i), 4.0, status=502)
    assert g.flags("a", 4.0).ejected_until == pytest.approx(64.0)
