"""loadtest/gc_pause_bench.py in miniature: a tiny run with real processes (control plane,
publishers, a stub engine, the sidecar with its recorders) for each arm, the shipped one
having frozen what its start built and the one before it nothing."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.gc_pause_bench import main


def test_a_tiny_run_records_collections_and_the_loops_lag(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    args = ["--engines", "20", "--rate", "200", "--batch", "5", "--duration", "1.5"]
    args += ["--requests", "20", "--rounds", "1", "--arms", "head,freeze", "--json", str(out)]
    assert main(args) == 0
    runs = {r["arm"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"head", "freeze"}
    assert runs["head"]["frozen"] == 0 and runs["freeze"]["frozen"] > 10_000
    for r in runs.values():
        assert 100 <= r["updates_applied_per_s"] <= 300
        assert r["requests"] > 0 and r["ttfb_ms"]["p50"] > 0
        # Sampled every 5 ms over the window: a lag for each wake.
        assert 0 <= r["lag_ms"]["p50"] <= r["lag_ms"]["max"]
        assert set(r["gc"]) == {"0", "1", "2"}
