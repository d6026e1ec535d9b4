"""SlowStart (filters/slow_start.py) against Envoy's documented formula at sample points."""

from __future__ import annotations

import pytest

from filters.slow_start import SlowStart, SlowStartConfig


def envoy_factor(t: float, window: float, aggression: float, min_pct: float) -> float:
    """Envoy's docs: max(MinWeightPercent, TimeFactor^(1/Aggression)),
    TimeFactor = max(TimeSinceStart, 1 ms) / Window, within the window."""
    if t >= window:
        return 1.0
    return max(min_pct / 100, (max(t, 0.001) / window) ** (1 / aggression))


@pytest.mark.parametrize("aggression", [0.5, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("t", [0.0, 0.5, 1.0, 5.0, 12.5, 30.0, 45.0, 59.999])
def test_ramp_matches_envoys_formula(aggression: float, t: float) -> None:
    s = SlowStart(SlowStartConfig(window_s=60.0, aggression=aggression, min_weight_percent=10))
    s.became_healthy("e", 100.0)
    assert s.weight("e", 100.0 + t) == pytest.approx(envoy_factor(t, 60.0, aggression, 10))


def test_hand_computed_points() -> None:
    s = SlowStart(SlowStartConfig(window_s=10.0, aggression=2.0, min_weight_percent=0))
    s.became_healthy("e", 0.0)
    assert s.weight("e", 2.5) == pytest.approx(0.5)  # sqrt(0.25)
    lin = SlowStart(SlowStartConfig(window_s=10.0, min_weight_percent=10))
    lin.became_healthy("e", 0.0)
    assert lin.weight("e", 0.5) == pytest.approx(0.1)  # the floor: 5% < 10%
    assert lin.weight("e", 7.0) == pytest.approx(0.7)


def test_weight_is_within_bounds_and_grows() -> None:
    s = SlowStart()
    s.became_healthy("e", 0.0)
    ws = [s.weight("e", t / 10) for t in range(0, 600)]
    assert all(0.1 <= w <= 1.0 for w in ws)
    assert ws == sorted(ws)


def test_ramp_ends_and_is_forgotten() -> None:
    s = SlowStart(SlowStartConfig(window_s=30.0))
    s.became_healthy("e", 0.0)
    assert s.in_slow_start("e", 29.9)
    assert s.weight("e", 30.0) == 1.0
    assert not s.in_slow_start("e", 0.0)  # forgotten: no memory for finished ramps
    assert s.weight("unknown", 0.0) == 1.0


def test_becoming_healthy_again_restarts_the_ramp() -> None:
    s = SlowStart(SlowStartConfig(window_s=10.0, min_weight_percent=0))
    s.became_healthy("e", 0.0)
    assert s.weight("e", 8.0) == pytest.approx(0.8)
    s.became_healthy("e", 8.0)  # e.g. its engine restarted: the cache is cold again
    assert s.weight("e", 9.0) == pytest.approx(0.1)
    s.forget("e")
    assert s.weight("e", 9.0) == 1.0


def test_tracked_ramps_are_bounded() -> None:
    s = SlowStart(SlowStartConfig(max_endpoints=3, window_s=100.0))
    for i in range(5):
        s.became_healthy(f"e{i}", float(i))
    assert [s.in_slow_start(f"e{i}", 5.0) for i in range(5)] == [False, False, True, True, True]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        SlowStartConfig(aggression=0)
    with pytest.raises(ValueError):
        SlowStartConfig(window_s=0)
    with pytest.raises(ValueError):
        SlowStartConfig(min_weight_percent=101)
