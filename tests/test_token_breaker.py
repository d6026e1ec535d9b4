"""TokenBreaker (filters/token_breaker.py) on a virtual clock: token estimates, limits and
headroom, breaker transitions, TTFT degradation, bookkeeping."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.token_breaker import BreakerTransition, Limits, TokenBreaker, TokenBreakerConfig

_ids = itertools.count()


def _run(b: TokenBreaker, ep: str, now: float, *, ok: bool | None, ttft: float = 0.1) -> None:
    rid = next(_ids)
    b.start(ep, rid, 100, now)
    b.first_token(rid, now + ttft)
    b.finish(rid, now + ttft, ok=ok)


def test_expected_output_is_max_tokens_capped_by_history() -> None:
    b = TokenBreaker()
    assert b.expected_output("m", 4000) == 4000  # no history yet
    assert b.expected_output("m", None) == 512
    for _ in range(100):
        b.observe_output("m", 100)
    assert b.expected_output("m", 32_000) == 200  # 2 x EWMA, not 32k
    assert b.expected_output("m", 150) == 150
    assert b.expected_output("m", None) == 200
    assert b.expected_output("other", 300) == 300  # per model
    assert b.expected_tokens("m", 1000, 32_000) == 1200


def test_finish_feeds_the_output_history_and_models_are_bounded() -> None:
    b = TokenBreaker(TokenBreakerConfig(max_models=2))
    b.start("e", "r", 10, 0.0, model="m1")
    b.finish("r", 1.0, ok=True, completion_tokens=40)
    assert b.expected_output("m1", 1000) == 80
    b.observe_output("m2", 1)
    b.observe_output("m3", 1)
    assert b.expected_output("m1", 1000) == 1000  # evicted: back to max_tokens


def test_endpoint_limits_send_elsewhere_and_pool_limits_queue() -> None:
    cfg = TokenBreakerConfig(
        endpoint_limits=Limits(max_tokens=1000, max_requests=3, max_pending=2),
        pool_limits=Limits(max_tokens=1500),
    )
    b = TokenBreaker(cfg)
    assert b.admit("a", 5000, 9, 0.0).ok  # an idle endpoint takes even an oversized one
    b.start("a", 1, 600, 0.0)
    d = b.admit("a", 600, 9, 0.0)
    assert (d.verdict, d.reason) == ("elsewhere", "endpoint-tokens")
    b.start("a", 2, 100, 0.0)
    assert b.admit("a", 10, 9, 0.0).reason == "endpoint-pending"
    b.first_token(1, 0.1)
    b.first_token(2, 0.1)
    b.start("a", 3, 100, 0.1)
    assert b.admit("a", 10, 9, 0.1).reason == "endpoint-requests"
    d = b.admit("b", 800, 9, 0.1)  # pool: 800 + 800 in flight > 1500
    assert (d.verdict, d.reason) == ("queue", "pool-tokens")
    assert b.admit("b", 600, 9, 0.1).ok
    assert b.rejected_queue == 1 and b.rejected_elsewhere == 3


def test_priority_headroom_keeps_the_last_tenth_for_high_priority() -> None:
    b = TokenBreaker(TokenBreakerConfig(endpoint_limits=Limits(max_requests=10)))
    for i in range(8):
        b.start("e", i, 1, 0.0)
    assert not b.admit("e", 1, 0, 0.0).ok  # sheddable: 80%
    assert b.admit("e", 1, 5, 0.0).ok
    b.start("e", 8, 1, 0.0)
    assert not b.admit("e", 1, 5, 0.0).ok  # standard: 90%
    assert not b.admit("e", 1, None, 0.0).ok  # no priority header means standard
    assert b.admit("e", 1, 7, 0.0).ok  # high: all of it


def test_scale_shrinks_an_endpoints_limits() -> None:
    b = TokenBreaker(TokenBreakerConfig(endpoint_limits=Limits(max_requests=10)))
    for i in range(3):
        b.start("e", i, 1, 0.0)
    assert b.admit("e", 1, 9, 0.0, scale=0.4).ok
    assert not b.admit("e", 1, 9, 0.0, scale=0.3).ok


def test_consecutive_failures_open_then_half_open_probes_close() -> None:
    seen: list[BreakerTransition] = []
    b = TokenBreaker(on_transition=seen.append)
    for _ in range(4):
        _run(b, "e", 0.0, ok=False)
    assert b.state("e", 0.0) == "closed"
    _run(b, "e", 0.0, ok=False)
    assert b.state("e", 0.2) == "open"
    assert b.admit("e", 1, 9, 1.0).reason == "breaker-open"
    assert [(t.old, t.new) for t in b.tick(5.0)] == [("closed", "open")]
    assert [(t.old, t.new, t.at) for t in b.tick(5.1)] == [("open", "half-open", 5.1)]
    assert b.admit("e", 1, 0, 5.2).ok
    b.start("e", "p1", 1, 5.2)
    assert b.admit("e", 1, 9, 5.2).reason == "breaker-half-open"  # one probe at a time
    b.finish("p1", 5.3, ok=True)
    assert b.state("e", 5.3) == "half-open"
    b.start("e", "p2", 1, 5.3)
    b.finish("p2", 5.4, ok=True)
    assert b.state("e", 5.4) == "closed"
    assert [t.new for t in seen] == ["open", "half-open", "closed"]
    assert b.trips == 1


def test_a_failed_probe_reopens_for_twice_as_long_up_to_the_cap() -> None:
    b = TokenBreaker(TokenBreakerConfig(open_base_s=5.0, open_max_s=30.0))
    for _ in range(5):
        _run(b, "e", 0.0, ok=False)
    durations = []
    now = 0.1
    for _ in range(5):
        snap = b.snapshot(now)[0]
        assert snap["state"] == "open"
        until = snap["open_until"]
        assert isinstance(until, float)
        durations.append(round(until - now, 6))
        now = until
        assert b.state("e", now) == "half-open"
        _run(b, "e", now, ok=False)
        now += 0.1
    assert durations == [5.0, 10.0, 20.0, 30.0, 30.0]


def test_backoff_resets_after_staying_closed() -> None:
    b = TokenBreaker(TokenBreakerConfig(backoff_reset_s=100.0, half_open_successes=1))
    for _ in range(5):
        _run(b, "e", 0.0, ok=False)
    assert b.state("e", 5.0) == "open"  # tripped at 0.1 (the fifth finish)
    assert b.state("e", 5.1) == "half-open"
    _run(b, "e", 5.1, ok=False)  # the probe fails at 5.2: reopens for 10 s
    assert b.state("e", 15.2) == "half-open"
    _run(b, "e", 15.2, ok=True)
    assert b.state("e", 15.4) == "closed"
    for _ in range(5):
        _run(b, "e", 200.0, ok=False)
    assert b.snapshot(200.1)[0]["open_until"] == pytest.approx(205.1)  # base time again


def test_error_rate_over_the_window_opens() -> None:
    b = TokenBreaker(TokenBreakerConfig(error_min_requests=20, error_rate=0.5))
    for i in range(19):
        _run(b, "e", i * 0.1, ok=i % 2 == 0)  # alternating: never 5 in a row
    assert b.state("e", 2.0) == "closed"
    _run(b, "e", 2.0, ok=False)  # 10 of 20 failed
    assert b.state("e", 2.2) == "open"


def test_old_failures_leave_the_window() -> None:
    b = TokenBreaker(TokenBreakerConfig(error_min_requests=4, error_rate=0.5))
    _run(b, "e", 0.0, ok=False)
    _run(b, "e", 0.0, ok=False)
    _run(b, "e", 0.0, ok=True)
    _run(b, "e", 20.0, ok=True)
    _run(b, "e", 20.0, ok=False)  # 1 of 2 in the window: under the minimum volume
    assert b.state("e", 20.5) == "closed"


def test_slow_first_tokens_count_as_degradation() -> None:
    b = TokenBreaker()
    for i in range(200):
        _run(b, "good", i * 0.01, ok=True, ttft=0.2)
    for i in range(4):
        _run(b, "slow", 10.0 + i, ok=True, ttft=3.0)  # 15x the median, and over 1 s
    assert b.degraded == 4 and b.state("slow", 14.0) == "closed"
    _run(b, "slow", 14.0, ok=True, ttft=3.0)
    assert b.state("slow", 17.5) == "open"
    # Fast in relative terms: an absolute floor keeps sub-second TTFTs from counting.
    _run(b, "good", 20.0, ok=True, ttft=0.9)
    assert b.degraded == 5


def test_prediction_normalises_long_prompts() -> None:
    b = TokenBreaker()
    for i in range(100):
        rid = next(_ids)
        b.start("e", rid, 100, float(i))
        b.first_token(rid, i + 0.2, predicted_ttft_s=0.2)
        b.finish(rid, i + 1.0, ok=True)
    rid = next(_ids)
    b.start("e", rid, 100_000, 200.0)
    b.first_token(rid, 208.0, predicted_ttft_s=8.0)  # slow in seconds, as predicted
    b.finish(rid, 209.0, ok=True)
    assert b.degraded == 0


def test_cancelled_and_pre_trip_requests_do_not_move_the_breaker() -> None:
    b = TokenBreaker(TokenBreakerConfig(half_open_successes=1))
    for _ in range(10):
        _run(b, "e", 0.0, ok=None)  # client went away: no verdict
    assert b.state("e", 0.0) == "closed"
    b.start("e", "old", 1, 0.0)  # in flight across the trip
    for _ in range(5):
        _run(b, "e", 0.0, ok=False)
    assert b.state("e", 6.0) == "half-open"
    b.finish("old", 6.0, ok=True)  # not a probe: says nothing about recovery
    assert b.state("e", 6.0) == "half-open"


def test_bookkeeping() -> None:
    b = TokenBreaker(TokenBreakerConfig(max_in_flight=2, max_endpoints=2))
    b.start("a", 1, 10, 0.0)
    with pytest.raises(ValueError):
        b.start("a", 1, 10, 0.0)
    b.start("b", 2, 10, 0.0)
    with pytest.raises(ValueError):
        b.start("a", 3, 10, 0.0)  # max_in_flight
    with pytest.raises(ValueError):
        b.admit("c", 1, 5, 0.0)  # both endpoints busy: none can be evicted
    b.finish(1, 1.0, ok=True)
    assert b.admit("c", 1, 5, 1.0).ok  # "a" was idle: evicted
    b.finish(99, 1.0, ok=True)  # unknown: ignored
    assert b.first_token(99, 1.0) is None
    assert b.pool_usage == (10, 1, 1)
    with pytest.raises(ValueError):
        TokenBreakerConfig(priority_shares=((3, 0.9), (7, 1.0)))


@settings(max_examples=50, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["start", "first", "finish"]), st.integers(0, 15), st.integers(0, 2)
        ),
        min_size=20,
        max_size=200,
    )
)
def test_counters_never_go_negative_and_return_to_zero(ops: list[tuple[str, int, int]]) -> None:
    b = TokenBreaker()
    live: set[int] = set()
    now = 0.0
    for op, rid, ep in ops:
        now += 0.05
        if op == "start" and rid not in live:
            b.start(f"e{ep}", rid, 10 + rid, now)
            live.add(rid)
        elif op == "first":
            b.first_token(rid, now)
        elif op == "finish":
            b.finish(rid, now, ok=rid % 3 != 0)
            live.discard(rid)
        assert all(x >= 0 for x in b.pool_usage)
        for s in b.snapshot(now):
            assert s["tokens_in_flight"] >= 0 and s["pending"] >= 0  # type: ignore[operator]
    for rid in list(live):
        b.finish(rid, now, ok=True)
    assert b.pool_usage == (0, 0, 0)
    assert all(s["requests_in_flight"] == 0 for s in b.snapshot(now))


def test_kv_capacity_sets_the_token_limit_by_its_factor_and_only_on_change() -> None:
    b = TokenBreaker(TokenBreakerConfig(kv_tokens_factor=1.5))
    assert b.kv_capacity("e", 100_000)
    assert b._endpoint("e").limits.max_tokens == 150_000
    assert b._endpoint("e").limits.max_requests == 256  # the rest as configured
    assert not b.kv_capacity("e", 100_000)  # unchanged
    assert not b.kv_capacity("e", 0)  # nothing known
    fixed = TokenBreaker(TokenBreakerConfig(kv_tokens_factor=None))
    assert not fixed.kv_capacity("e", 100_000)
    assert fixed._endpoint("e").limits.max_tokens == 262_144
