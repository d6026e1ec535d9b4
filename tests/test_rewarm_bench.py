"""loadtest/rewarm_bench.py: engines that join mid-run on the virtual clock, with and
without the rewarm (a tiny fleet; the measured run is `python -m loadtest.rewarm_bench`)."""

from __future__ import annotations

import pytest

from filters.slow_start import SlowStartConfig
from loadtest.rewarm_bench import VARIANTS, run_variant, table

TINY = {
    "engines": 2,
    "cold": 1,
    # Enough for the joiner to be needed: at 20/s the one engine holding both groups'
    # prompts answers everything within a step, and the picker rightly keeps them there.
    "rate": 80.0,
    "duration_s": 8.0,
    "scale_up_at": 3.0,
    "groups": 2,
    "system_tokens": 512,
    "question_tokens": 64,
}


@pytest.mark.parametrize("variant", ["rewarm", "neither"])
def test_the_new_engine_joins_at_the_scale_up(variant: str) -> None:
    r = run_variant(variant, slow_start=SlowStartConfig(window_s=2.0), **TINY)  # type: ignore[arg-type]
    assert (r.slow_start, r.replication) == VARIANTS[variant]
    assert r.ok == r.requests > 100
    assert r.new_before == 0  # not in the pool before it joined
    assert r.new_engine_share > 0  # and served after
    assert r.usd > 0 and r.usd_per_1k_tasks > 0
    assert variant in table([r])
