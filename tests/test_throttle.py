"""AdaptiveThrottle (filters/throttle.py): the SRE formula, injected randomness, decay; one
window for both counts, and allow's calm shortcut decides as the window does."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.retry_budget import RandomSource
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


def test_a_window_of_accepts_alone_never_rejects() -> None:
    # The accepts and the requests were two rings, each begun at its first use: here the
    # requests' at 0 s (the first allow), the accepts' at 3 s (the first accept), so the
    # 100 accepts of 6 s left the window at 123 s and their requests at 125 s: in between
    # the window read 100 requests, 0 accepts, p = 100/101.
    t = AdaptiveThrottle()  # two minutes, 5 s buckets
    assert t.allow(0.0, FixedRng(0.0))
    t.accepted(3.0)
    for _ in range(100):
        t.accepted(6.0)
    for now in (60.0, 119.0, 121.0, 123.0, 123.5, 124.0, 124.9, 126.0):
        assert t.p_reject(now) == 0.0
        assert t.allow(now, FixedRng(0.0))
    assert t.throttled == 0


class _GeneralPath(AdaptiveThrottle):
    """allow without the calm shortcut: always the window's p (the reference)."""

    __slots__ = ()

    def allow(self, now: float, rng: RandomSource) -> bool:
        p = self.p_reject(now)
        if p > 0 and rng.random() < p:
            self.refused(now)
            self.throttled += 1
            return False
        return True


_configs = st.builds(
    AdaptiveThrottleConfig,
    k=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
    window_s=st.sampled_from([10.0, 120.0, 7.3]),
    slots=st.sampled_from([1, 3, 24]),
    min_requests=st.sampled_from([0, 1, 5, 20]),
)
_steps = st.one_of(
    st.sampled_from([0.0, 0.0, 0.1, 1.0, 2.5, 4.99, 5.0, 30.0, 115.0, 120.0, 300.0]),
    st.floats(0.0, 150.0, allow_nan=False),
)
_ops = st.lists(
    st.tuples(st.sampled_from(["allow", "allow", "accepted", "accepted", "refused", "p"]), _steps),
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(cfg=_configs, ops=_ops, seed=st.integers(0, 2**32 - 1), start=_steps)
def test_the_calm_shortcut_decides_as_the_window(
    cfg: AdaptiveThrottleConfig, ops: list[tuple[str, float]], seed: int, start: float
) -> None:
    fast, general = AdaptiveThrottle(cfg), _GeneralPath(cfg)
    rng_fast, rng_general = random.Random(seed), random.Random(seed)
    now = start
    for op, step in ops:
        now += step  # the sidecar's clock is monotonic
        if op == "allow":
            assert fast.allow(now, rng_fast) == general.allow(now, rng_general)
        elif op == "p":
            assert fast.p_reject(now) == general.p_reject(now)
        else:
            getattr(fast, op)(now)
            getattr(general, op)(now)
        counts = (fast.requests, fast.accepts, fast.throttled)
        assert counts == (general.requests, general.accepts, general.throttled)
        if now >= fast.calm_from:
            assert general.p_reject(now) == 0.0
    assert rng_fast.random() == rng_general.random()  # the same draws were made


@settings(max_examples=400, deadline=None)
@given(
    cfg=_configs,
    ops=st.lists(
        st.tuples(
            st.sampled_from(["allow", "accepted", "accepted", "refused", "p"]),
            st.one_of(_steps, st.sampled_from([-1.0, -5.0, -60.0])),
        ),
        max_size=120,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_window_holds_what_came_in_its_buckets(
    cfg: AdaptiveThrottleConfig, ops: list[tuple[str, float]], seed: int
) -> None:
    # Reference: every request with its bucket (now // slot; a clock that went back
    # counts in the latest bucket), the window the last `slots` buckets.
    t = _GeneralPath(cfg)
    rng = random.Random(seed)
    slot = cfg.window_s / cfg.slots
    events: list[tuple[float, bool]] = []  # (bucket, accepted)
    latest = -math.inf
    now = 0.0
    for op, step in ops:
        now += step
        latest = max(latest, now // slot)
        if op == "allow":
            if not t.allow(now, rng):
                events.append((latest, False))
        elif op == "accepted":
            t.accepted(now)
            events.append((latest, True))
        elif op == "refused":
            t.refused(now)
            events.append((latest, False))
        held = [ok for b, ok in events if b > latest - cfg.slots]
        requests, accepts = len(held), sum(held)
        want = (
            0.0
            if requests < cfg.min_requests
            else max(0.0, (requests - cfg.k * accepts) / (requests + 1))
        )
        assert t.p_reject(now) == want
        if cfg.k >= 1 and accepts == requests:
            assert want == 0.0  # accepts alone never reject
