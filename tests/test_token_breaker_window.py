"""TokenBreaker (filters/token_breaker.py): the error-rate window's two counts, every
outcome and the failed ones, leave the window together (one ring on a fixed grid)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from filters.token_breaker import TokenBreaker, TokenBreakerConfig

_ids = itertools.count()


def _outcome(b: TokenBreaker, ep: str, now: float, ok: bool | None) -> None:
    rid = next(_ids)
    b.start(ep, rid, 100, now)
    b.finish(rid, now, ok=ok)


def test_a_failure_leaves_the_window_with_its_outcome() -> None:
    # The outcomes and the failures were two rings, each begun at its first use: here the
    # outcomes' at 0.0 s (a success), the failures' at 0.9 s (the first failure), so the
    # 10 failures of 0.9 s left the outcomes at 10.0 s but the failures only at 10.9 s.
    # At 10.5 s 19 successes and 1 failure read 11 failed of 20 (55% >= 50%): the breaker
    # tripped on traffic that failed 1 in 20.
    b = TokenBreaker()  # 50% over 10 s (1 s buckets), at least 20 outcomes, 5 in a row
    _outcome(b, "e", 0.0, True)
    for i in range(20):
        _outcome(b, "e", 0.9, i % 2 == 0)  # ok, failed, ok, ...: 10 of 21 failed
    assert b.state("e", 1.0) == "closed"
    for _ in range(19):
        _outcome(b, "e", 10.5, True)
    _outcome(b, "e", 10.5, False)  # the window (buckets 1..10 s): 1 failed of 20
    assert b.state("e", 10.6) == "closed"
    assert b.trips == 0


_configs = st.builds(
    TokenBreakerConfig,
    error_rate=st.sampled_from([0.1, 0.5, 0.9, 1.0]),
    error_window_s=st.sampled_from([10.0, 1.0, 7.3, 60.0]),
    error_min_requests=st.sampled_from([0, 1, 4, 20]),
    consecutive_failures=st.just(10_000),  # only the error rate trips
)
_steps = st.one_of(
    st.sampled_from([0.0, 0.0, 0.1, 0.5, 0.73, 1.0, 5.0, 9.99, 10.0, 30.0]),
    st.floats(0.0, 12.0, allow_nan=False),
)


@settings(max_examples=400, deadline=None)
@given(
    cfg=_configs,
    ops=st.lists(
        st.tuples(
            st.sampled_from([True, True, False, None]),
            st.one_of(_steps, st.sampled_from([-0.5, -3.0])),  # a clock going back too
        ),
        max_size=150,
    ),
    start=_steps,
)
def test_the_window_holds_what_came_in_its_buckets(
    cfg: TokenBreakerConfig, ops: list[tuple[bool | None, float]], start: float
) -> None:
    # Reference: every outcome with its bucket (now // slot; a clock that went back
    # counts in the latest bucket), the window the last 10 buckets; the breaker trips at
    # the first failure that brings the window's failed share to error_rate.
    b = TokenBreaker(cfg)
    slot = cfg.error_window_s / 10
    events: list[tuple[float, bool]] = []  # (bucket, ok)
    latest = -float("inf")
    now = start
    for ok, step in ops:
        now += step
        _outcome(b, "e", now, ok)
        if ok is None:
            continue  # no verdict: not counted
        latest = max(latest, now // slot)
        events.append((latest, ok))
        held = [o for bucket, o in events if bucket > latest - 10]
        total, failed = len(held), held.count(False)
        trips = not ok and total >= cfg.error_min_requests and failed >= cfg.error_rate * total
        assert b.state("e", now) == ("open" if trips else "closed")
        if trips:
            assert b.snapshot(now)[0]["trips"] == 1
            return
