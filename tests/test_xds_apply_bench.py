"""loadtest/xds_apply_bench.py in miniature: the path before and the current one leave the
routers with the same reported state, and a tiny run with real processes (control plane,
publishers, a `meshd sidecar`) measures the sidecar following every engine."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from filters.pool_router import PickerRouter
from loadtest.xds_apply_bench import before_apply, feed_apply, main, responses


def reported(routers: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for router in routers.values():
        assert isinstance(router, PickerRouter)
        for s in router.states:
            out[s.url] = s.reported
    return out


def test_both_paths_report_the_same_states() -> None:
    sync, run = responses(30, 200, 7)
    before, now = before_apply(30), feed_apply(30)
    acks = [[path.apply(raw) for raw in sync + run] for path in (before, now)]
    assert acks[0] == acks[1]
    assert before.followed() == now.followed() == 30
    got, want = reported(now.routers), reported(before.routers)
    assert got == want and all(v is not None for v in got.values())


def test_a_tiny_run_measures_the_sidecar(tmp_path: Path) -> None:
    out = tmp_path / "apply.json"
    args = ["--engines", "20", "--updates", "200", "--per-response", "1,10", "--rounds", "1"]
    # Enough updates that the sidecar's CPU spans several clock ticks (/proc counts 10 ms
    # ticks: at 200 updates in 1 s it read 0 once, on a machine busy with other work).
    args += ["--rate", "600", "--duration", "1.5", "--batch", "5", "--json", str(out)]
    # The control plane pacing its pushes (push_interval_s): the sidecar still follows.
    args += ["--transports", "frames,grpc", "--push-interval-ms", "20"]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert set(r["apply"]) == {"1", "10"}
    assert all(v["now_us"] > 0 and v["before_us"] > 0 for v in r["apply"].values())
    # A run over each transport (the sidecar seen following over it), `process` the first's.
    runs = r["process_runs"]
    assert {t: [x["transport"] for x in v] for t, v in runs.items()} == {
        "frames": ["frames"],
        "grpc": ["grpc"],
    }
    p = r["process"]
    assert p == runs["frames"][0] and p["engines_followed"] == 20
    assert p["push_interval_ms"] == 20
    assert 300 <= p["applied_per_s"] <= 900 and p["sidecar_cpu_share"] > 0
    # The sidecar's own account of applying them: part of what its process spent.
    assert 0 < p["sidecar_apply_us_per_update"] < p["sidecar_us_per_update"]
    assert 0 < p["sidecar_read_us_per_update"] < p["sidecar_apply_us_per_update"]
