"""loadtest/xds_scale_bench.py in miniature: one scenario with real processes (control
plane, publisher, subscribers) measures what it says, and the report prints ratios."""

from __future__ import annotations

from loadtest.xds_scale_bench import Scenario, report, run_scenario


def test_a_tiny_run_measures_every_update() -> None:
    delta = run_scenario(
        Scenario("delta x2", "delta", 2),
        engines=20,
        rate=5.0,
        duration_s=1.0,
        streams=2,
        per_process=1,
    )
    sotw = run_scenario(
        Scenario("sotw x1", "sotw", 1),
        engines=20,
        rate=5.0,
        duration_s=1.0,
        streams=2,
        per_process=1,
    )
    for r in (delta, sotw):
        assert 50 <= r.published <= 150  # 20 engines x 5/s for a second
        assert r.seen_share > 0.9 and 0 < r.p50_ms <= r.p99_ms <= r.max_ms < 1000
        assert r.cp_rss_mib > 10 and r.cp_cpu_us_per_update > 0
    # Every SotW response carries all 20 engines; delta only the one that changed.
    assert sotw.bytes_per_s > 5 * delta.bytes_per_s
    text = report([delta, sotw], engines=20, rate=5.0)
    assert "ratios against delta x2" in text and "fewer bytes than state-of-the-world" in text
