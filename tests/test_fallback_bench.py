"""loadtest/fallback_bench.py: a tiny run of the fallback bench (the big pool killed
halfway, through a real sidecar, with and without the chain): the chain keeps the requests
sent after the kill succeeding, every move is counted in the access log and the metrics,
and no request costs more attempts than the chain allows (the real run is
`python -m loadtest.fallback_bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.fallback_bench import FallbackBenchSettings, main, run_bench


async def test_a_tiny_run_falls_back_once_the_big_pool_is_dead(tmp_path: Path) -> None:
    s = FallbackBenchSettings(requests=24, rate=20.0, big=1, small=1, progress=False)
    doc = await run_bench(s, tmp_path)
    without, chain = doc["passes"]["no_chain"], doc["passes"]["chain"]
    assert chain["success_rate"] > without["success_rate"]
    assert without["success_rate_after_kill"] == 0.0 and without["fallbacks"] == 0
    assert chain["success_rate_after_kill"] >= 0.9
    assert chain["fallbacks"] > 0
    assert chain["fallbacks"] == sum(chain["metrics_fallbacks"].values())
    assert chain["served_by_pool"]["small"] == chain["fallbacks"]
    assert set(chain["fallback_reasons"]) <= {"no_healthy_upstream", "upstream_unavailable"}
    # At most the pool's attempts (3 by default) plus one for the fallback pool, per request.
    assert chain["amplification"] <= 4.0 and chain["engine_amplification"] <= 2.0
    for key in ("usd_per_ok_task", "ttft_p50_s", "ttft_p99_s"):
        assert chain[key] > 0 and without[key] > 0
    assert json.loads((tmp_path / "results.json").read_text())["ratios"]["success_rate"] > 1
    assert (tmp_path / "fallback.png").stat().st_size > 0


def test_the_help_explains_the_fault(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--kill-at" in text and "fallbacks" in text
