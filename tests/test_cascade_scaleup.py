"""The cascade bench's scaleup scenario (loadtest/bench/cascade.py, issue #24): what it plans
and injects. The measured run is `python -m loadtest.bench.cascade --scenarios scaleup`."""

from __future__ import annotations

from loadtest.bench.cascade import (
    SCALEUP_POLICIES,
    CascadeSettings,
    cold_at_start,
    parse_args,
    plan,
)
from loadtest.bench.policies import POLICIES


def test_scaleup_prompts_share_long_prefixes_and_the_others_do_not() -> None:
    s = CascadeSettings(duration_s=5.0, rate_rps=20.0, prefix_groups=3, prefix_words=50)
    shared = plan(s, shared=True)
    plain = plan(s)
    assert len(shared) == len(plain) > 50  # the same arrivals
    heads = {" ".join(p.prompt.split()[:50]) for p in shared}
    assert len(heads) == 3
    assert all(p.prompt.startswith("request ") for p in plain)
    assert [p.at_s for p in shared] == [p.at_s for p in plain]


def test_the_last_engines_load_until_the_scale_up_in_simulated_seconds() -> None:
    s = CascadeSettings(engines=8, cold_engines=3, duration_s=60.0, time_scale=0.25)
    faults = cold_at_start("scaleup", s)
    assert [i for i, _ in faults] == [5, 6, 7]
    assert all(f == {"kind": "cold_start", "seconds": 6.0, "mode": "refuse"} for _, f in faults)
    assert s.scaleup_at_s == 24.0
    assert cold_at_start("degraded", s) == []


def test_scaleup_runs_meshd_with_and_without_slow_start() -> None:
    s, _ = parse_args(["--scenarios", "scaleup", "--quick"])
    assert s.scenarios == ("scaleup",)
    assert SCALEUP_POLICIES == ("meshd", "meshd-no-slow-start")
    spec = POLICIES["meshd-no-slow-start"]
    assert "slow_start.enabled=false" in spec.summary
    assert getattr(spec, "start_on_fleet", None) is not None  # GPUs in its config, as meshd
