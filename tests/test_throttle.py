"""AdaptiveThrottle (filters/throttle.py): the SRE formula, injected randomness, decay."""

from __future__ import annotations

import random

import pytest

from filters.throttle import AdaptiveThrottle, AdaptiveThrottleConfig


class FixedRng:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def _load(t: AdaptiveThrottle, now: float, requests: int, accepts: int) -> None:
    never = FixedRng(1.0)  # rng >= p: always allowed, so the counts are exact
    for i in range(requests):
        assert t.allow(now, never)
        if i < accepts:
            t.accepted(now)
        else:
            t.refused(now)


def test_fresh_throttle_allows() -> None:
    t = AdaptiveThrottle()
    assert t.p_reject(0.0) == 0.0
    assert t.allow(0.0, FixedRng(0.0))


def test_probability_matches_the_sre_formula() -> None:
    t = AdaptiveThrottle(AdaptiveThrottleConfig(min_requests=0))
    _load(t, 0.0, requests=10, accepts=3)
    assert t.p_reject(1.0) == pytest.approx((10 - 2 * 3) / (10 + 1))
    t2 = AdaptiveThrottle(AdaptiveThrottleConfig(k=1.5, min_requests=0))
    _load(t2, 0.0, requests=10, accepts=3)
    assert t2.p_reject(1.0) == pytest.approx((10 - 1.5 * 3) / 11)


def test_no_rejection_below_the_minimum_volume() -> None:
    t = AdaptiveThrottle(AdaptiveThrottleConfig(min_requests=20))
    _load(t, 0.0, requests=19, accepts=0)
    assert t.p_reject(1.0) == 0.0
    _load(t, 1.0, requests=1, accepts=0)
    assert t.p_reject(2.0) == pytest.approx(20 / 21)


def test_no_rejection_while_accepts_keep_up() -> None:
    t = AdaptiveThrottle()
    _load(t, 0.0, requests=100, accepts=50)
    assert t.p_reject(1.0) == 0.0


def test_the_rng_decides_against_p() -> None:
    t = AdaptiveThrottle()
    _load(t, 0.0, requests=1000, accepts=400)
    p = t.p_reject(1.0)
    assert p == pytest.approx(200 / 1001)
    assert not t.allow(1.0, FixedRng(p - 0.01))
    assert t.allow(1.0, FixedRng(p + 0.01))
    assert t.throttled == 1 and t.requests == 1001  # the one allowed awaits its verdict


def test_local_rejections_count_as_requests() -> None:
    t = AdaptiveThrottle()
    _load(t, 0.0, requests=20, accepts=0)
    before = t.p_reject(0.0)
    for _ in range(50):
        t.allow(0.0, FixedRng(0.0))  # every one rejected here
    assert t.throttled == 50
    assert t.p_reject(0.0) > before  # SRE: requests include what the client itself rejected


def test_a_dead_backend_gets_a_trickle_not_a_flood() -> None:
    t = AdaptiveThrottle()
    rng = random.Random(7)
    sent = 0
    for i in range(5000):  # 50 s, every request sent is refused
        if t.allow(i * 0.01, rng):
            sent += 1
            t.refused(i * 0.01)
    assert sent < 5000 * 0.05


def test_requests_in_flight_are_not_refusals() -> None:
    t = AdaptiveThrottle()
    rng = random.Random(3)
    assert all(t.allow(0.0, rng) for _ in range(200))  # a burst, none answered yet
    assert t.p_reject(1.0) == 0.0 and t.requests == 0
    for _ in range(200):
        t.accepted(30.0)  # they all end well, late
    assert t.p_reject(31.0) == 0.0 and t.requests == t.accepts == 200


def test_counts_expire_after_the_window() -> None:
    t = AdaptiveThrottle()  # two minutes
    _load(t, 0.0, requests=100, accepts=0)
    assert t.p_reject(60.0) > 0.9
    assert t.p_reject(121.0) == 0.0


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        AdaptiveThrottleConfig(k=0)
