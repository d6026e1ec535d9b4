"""PoolGuard (filters/guard.py): the order in which throttle, admission, breaker and outlier
detector speak, and what each attempt outcome means to them."""

from __future__ import annotations

from dataclasses import dataclass

from filters.admission import AdmissionConfig, AdmissionItem, Admit, Queue
from filters.guard import GuardConfig, PoolGuard, Throttled
from filters.outlier import OutlierConfig
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
