"""OutlierDetector (filters/outlier.py) on a virtual clock, against Envoy's semantics."""

from __future__ import annotations

import pytest

from filters.outlier import OutlierConfig, OutlierDetector


def _pool(n: int, config: OutlierConfig | None = None) -> OutlierDetector:
    d = OutlierDetector(config)
    for i in range(n):
        d.add(f"e{i}")
    return d


def _fail(d: OutlierDetector, ep: str, now: float, times: int) -> bool:
    return any([d.record(ep, now, status=503) for _ in range(times)])


def test_consecutive_5xx_ejects_for_the_base_time_then_returns() -> None:
    d = _pool(8)
    assert not _fail(d, "e0", 0.0, 4)
    assert d.record("e0", 0.0, local_failure=True)  # the 5th: resets count as 5xx
    assert d.ejected("e0", 0.0)
    (ev,) = d.tick(0.0)
    assert (ev.endpoint, ev.action, ev.reason, ev.until) == ("e0", "eject", "consecutive_5xx", 30.0)
    assert d.ejected("e0", 29.999)
    assert not d.ejected("e0", 30.0)
    (back,) = d.tick(30.0)
    assert (back.action, back.at) == ("uneject", 30.0)
    assert d.ejections_consecutive_5xx == 1


def test_a_success_resets_the_count() -> None:
    d = _pool(8)
    _fail(d, "e0", 0.0, 4)
    d.record("e0", 0.0, status=200)
    assert not _fail(d, "e0", 0.0, 4)
    assert d.record("e0", 0.0, status=500)


def test_ejection_time_grows_with_repeat_offences_up_to_the_cap() -> None:
    d = _pool(8)
    now, durations = 0.0, []
    for _ in range(13):
        _fail(d, "e0", now, 5)
        until = d.ejected_until("e0")
        assert until is not None
        durations.append(until - now)
        now = until  # fails again the moment it is back
    assert durations[:4] == [30.0, 60.0, 90.0, 120.0]
    assert durations[9:] == [300.0] * 4  # base x 10 = max, and no further


def test_the_multiplier_decays_while_the_endpoint_stays_healthy() -> None:
    d = _pool(8)
    _fail(d, "e0", 0.0, 5)  # 30 s
    _fail(d, "e0", 30.0, 5)  # 60 s, until 90
    t = 90.0
    d.tick(t)
    for _ in range(3):  # three sweeps at least an interval after the unejection
        t += 10.0
        d.tick(t)
    _fail(d, "e0", t, 5)
    assert d.ejected_until("e0") == t + 30.0  # back to one base time


def test_max_ejection_percent_with_always_eject_one_host() -> None:
    d = _pool(8)  # 10% of 8 is 0.8 hosts: only the always-one rule lets any go
    assert _fail(d, "e0", 0.0, 5)
    assert not _fail(d, "e1", 0.0, 5)
    assert d.ejections_overflow == 1 and d.ejected_count(0.0) == 1


def test_envoy_default_ejects_nothing_in_a_small_pool() -> None:
    d = _pool(8, OutlierConfig(always_eject_one_host=False))
    assert not _fail(d, "e0", 0.0, 5)
    assert d.ejections_overflow == 1


def test_max_ejection_percent_in_a_large_pool() -> None:
    d = _pool(20)  # 10% of 20: two
    assert _fail(d, "e0", 0.0, 5)
    assert _fail(d, "e1", 0.0, 5)
    assert not _fail(d, "e2", 0.0, 5)
    assert d.ejected_count(0.0) == 2
    assert not d.ejected("e0", 30.0)  # back: room again
    assert _fail(d, "e2", 30.0, 5)


def test_success_rate_ejection_uses_envoys_example() -> None:
    # Envoy's comment: {50, 100, 100, 100, 100}: mean 90, stdev 20, threshold 52.
    d = _pool(5, OutlierConfig(consecutive_5xx=1000))
    d.tick(0.0)
    rates = {"e0": (200, 100), **{f"e{i}": (200, 200) for i in range(1, 5)}}
    for ep, (total, ok) in rates.items():
        for i in range(total):
            d.record(ep, 1.0, status=200 if i < ok else 503)
    events = d.tick(10.0)
    assert [(e.endpoint, e.reason) for e in events] == [("e0", "success_rate")]
    snap = {s["endpoint"]: s for s in d.snapshot(10.0)}
    assert snap["e1"]["success_rate"] == 100.0
    assert d.ejections_success_rate == 1


def test_success_rate_needs_enough_hosts_with_enough_volume() -> None:
    d = _pool(5, OutlierConfig(consecutive_5xx=1000))
    d.tick(0.0)
    for i in range(5):
        volume = 99 if i == 4 else 200  # one short of success_rate_request_volume
        for j in range(volume):
            d.record(f"e{i}", 1.0, status=200 if (i != 0 or j < 100) else 503)
    assert d.tick(10.0) == []


def test_success_rate_looks_at_the_last_interval_only() -> None:
    d = _pool(5, OutlierConfig(consecutive_5xx=1000))
    d.tick(0.0)
    for i in range(5):
        for j in range(200):
            d.record(f"e{i}", 1.0, status=200 if (i != 0 or j < 100) else 503)
    d.tick(10.0)  # e0 ejected
    d.tick(40.0)  # back, and the earlier interval is long gone
    for i in range(5):
        for _ in range(200):
            d.record(f"e{i}", 41.0, status=200)
    assert [e.action for e in d.tick(50.0)] == []


def test_remove_and_bounds() -> None:
    d = _pool(2, OutlierConfig(max_hosts=2))
    with pytest.raises(ValueError):
        d.add("e9")
    _fail(d, "e0", 0.0, 5)
    d.remove("e0")
    assert d.ejected_count(0.0) == 0 and d.endpoints == 1
    # The ejection reported before removal comes out; its stale expiry does not.
    assert [e.action for e in d.tick(100.0)] == ["eject"]
    d.add("e0")
    assert not d.ejected("e0", 1.0)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        OutlierConfig(max_ejection_time_s=10.0)  # below base_ejection_time
    with pytest.raises(ValueError):
        OutlierConfig(max_ejection_percent=150)
