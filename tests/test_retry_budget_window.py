"""RetryBudget (filters/retry_budget.py): the counts the storm test compares (requests,
retry asks, failed retries, granted retries) and the balance leave the window together
(one ring on a fixed grid); WindowedSum's sums against a reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from filters.retry_budget import STORM_SHARE, RetryBudget, RetryBudgetConfig, WindowedSum


def test_retry_asks_leave_the_window_with_their_requests() -> None:
    # The requests and the asks were two rings, each begun at its first use: here the
    # requests' at 0.0 s (the first deposit), the asks' at 0.9 s (the first withdraw), so
    # the 3 asks of 0.9 s left the requests' window at 10.0 s but their own at 10.9 s. At
    # 10.5 s the window (buckets 1..10 s) held 1 request and no ask, and read 3 asks of 1
    # request: a storm, so no floor (balance 0.2, the ratio's alone), and the one
    # request's one failure was refused its retry.
    b = RetryBudget()  # 20%, 10/s, 10 s (1 s buckets), 3 attempts
    b.deposit(0.0)
    for _ in range(3):
        b.deposit(0.9)
        assert b.withdraw(0.9, 1)  # a third of the requests asked: rare, the floor funds
    b.deposit(10.5)
    assert b.balance(10.5) == 100.2  # the floor (10/s x 10 s) and the request's 0.2
    assert b.withdraw(10.5, 1)
    assert b.exhausted == 0


_REQUESTS, _ASKS, _FAILED, _GRANTED, _BALANCE = range(5)

_configs = st.builds(
    RetryBudgetConfig,
    window_s=st.sampled_from([10.0, 1.0, 7.3, 60.0]),
    slots=st.sampled_from([1, 3, 10]),
    retry_ratio=st.sampled_from([0.0, 0.2, 1.0]),
    min_retries_per_s=st.sampled_from([0.0, 0.1, 1.0, 10.0]),
    max_attempts=st.sampled_from([1, 2, 3, 5]),
)
_steps = st.one_of(
    st.sampled_from([0.0, 0.0, 0.1, 0.5, 0.73, 1.0, 2.43, 9.99, 10.0, 30.0]),
    st.floats(0.0, 12.0, allow_nan=False),
)


@settings(max_examples=400, deadline=None)
@given(
    cfg=_configs,
    ops=st.lists(
        st.tuples(
            st.sampled_from(["deposit", "deposit", 1, 1, 2, 3, 4, "balance"]),
            st.one_of(_steps, st.sampled_from([-0.5, -3.0])),  # a clock going back too
        ),
        max_size=150,
    ),
    start=_steps,
)
def test_the_budget_decides_on_what_came_in_the_windows_buckets(
    cfg: RetryBudgetConfig, ops: list[tuple[str | int, float]], start: float
) -> None:
    # Reference: every request, ask, failed retry, grant and balance amount (thousandths)
    # with its bucket (now // slot; a clock that went back counts in the latest bucket),
    # the window the last `slots` buckets, and the module's rules on those sums.
    b = RetryBudget(cfg)
    slot = cfg.window_s / cfg.slots
    deposit = round(cfg.retry_ratio * 1000)
    reserve = round(cfg.min_retries_per_s * cfg.window_s * 1000)
    events: list[tuple[float, int, int]] = []  # (bucket, which, amount)
    latest = -float("inf")

    def sums() -> list[int]:
        out = [0] * 5
        for bucket, which, amount in events:
            if bucket > latest - cfg.slots:
                out[which] += amount
        return out

    def floor(s: list[int]) -> int:
        if s[_ASKS] < cfg.max_attempts:
            return reserve
        if s[_ASKS] >= s[_REQUESTS] or s[_FAILED] > STORM_SHARE * s[_GRANTED]:
            return 0
        return reserve

    now = start
    for op, step in ops:
        now += step
        if not (isinstance(op, int) and op >= cfg.max_attempts):  # a capped ask reads none
            latest = max(latest, now // slot)
        if op == "deposit":
            b.deposit(now)
            events += [(latest, _REQUESTS, 1), (latest, _BALANCE, deposit)]
        elif op == "balance":
            s = sums()
            assert b.balance(now) == (s[_BALANCE] + floor(s)) / 1000
        else:
            assert isinstance(op, int)
            granted = b.withdraw(now, op)
            if op >= cfg.max_attempts:
                assert not granted
                continue
            events.append((latest, _ASKS, 1))
            if op > 1:
                events.append((latest, _FAILED, 1))
            s = sums()
            want = s[_BALANCE] + floor(s) >= 1000
            assert granted == want
            if granted:
                events += [(latest, _BALANCE, -1000), (latest, _GRANTED, 1)]


@settings(max_examples=300, deadline=None)
@given(
    window_s=st.sampled_from([10.0, 1.0, 7.3]),
    slots=st.sampled_from([1, 3, 10]),
    ops=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(-5, 5),
            st.one_of(_steps, st.sampled_from([-0.5, -3.0, -30.0])),
        ),
        max_size=150,
    ),
)
def test_windowed_sums_hold_what_came_in_their_buckets(
    window_s: float, slots: int, ops: list[tuple[int, int, float]]
) -> None:
    w = WindowedSum(window_s, slots, counts=3)
    slot = window_s / slots
    events: list[tuple[float, int, int]] = []
    latest = -float("inf")
    now = 0.0
    for which, amount, step in ops:
        now += step
        latest = max(latest, now // slot)
        w.add(now, amount, which)
        events.append((latest, which, amount))
        want = [0, 0, 0]
        for bucket, k, a in events:
            if bucket > latest - slots:
                want[k] += a
        assert list(w.totals(now)) == want
        assert [w.total(now, k) for k in range(3)] == want
