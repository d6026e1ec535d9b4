"""loadtest/pd_bench.py: a tiny run of the disaggregation bench (aggregated and split fleets,
meshd and round robin, each through a real sidecar on a fresh simulated fleet): every run
completes, the split fleet splits its requests (access log `pd`, meshd_pd_requests_total,
both legs in the access log), and the results carry their fields (the real run is
`python -m loadtest.pd_bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.pd_bench import PDBenchSettings, build_workload, main, run_bench


async def test_a_tiny_run_splits_on_the_pd_fleet_and_writes_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = PDBenchSettings(
        requests=6,
        rate=20.0,
        prompt_scale=0.05,
        min_input=8000,  # 400+ tokens after the scale: over min_prefill_tokens (256)
        engines=3,
        splits=(1,),
        engine_time_scale=4.0,
        faster_whole_margin_s=None,  # one prefill engine queues: every request split here
        progress=False,
    )
    w = build_workload(s)
    assert len(w.requests) == 6 and all(r.max_tokens >= 100 for r in w.requests)
    assert min(r.prompt_tokens or 0 for r in w.requests) >= 256
    doc = await run_bench(s, tmp_path)
    runs = doc["runs"]
    assert set(runs) == {"agg-meshd", "agg-rr", "pd1-meshd", "pd1-rr"}
    for name, f in runs.items():
        assert f["ok"] == f["requests"] == f["logged"] == 6, (name, f["client_errors"])
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"):
            assert f[key] is not None and f[key] >= 0, (name, key)
        assert f["usd_per_ok_task"] > 0 and f["busy_usd_per_ok_task"] > 0
        # The ledger's figure and its timing model's alone, and how much engines measured.
        assert f["modelled_usd_per_ok_task"] > 0 and 0 <= f["measured_share"] <= 1
        assert set(f["readings"]) <= {"estimated", "measured", "reported"}
        assert f["itl_gaps"] > 0
    for name in ("pd1-meshd", "pd1-rr"):
        f = runs[name]
        assert f["split_share"] == 1.0 and f["pd"] == {"split": 6}
        assert f["pd_metric"] == {"split:split": 6.0}
        assert f["attempts"] == {"main:ok": 6, "prefill:ok": 6}  # both legs, each ok
        assert f["kv_transfer_s"] > 0 and not f["kv_fetch_refused"]
        for leg in ("prefill_leg_p90_s", "decode_leg_p90_s"):
            assert f[leg] is not None and 0 < f[leg] <= f["ttft_p99_s"], (name, leg)
    for name in ("agg-meshd", "agg-rr"):
        assert runs[name]["split_share"] == 0.0 and runs[name]["pd_metric"] == {}
    t = doc["targets"]["splits"]["pd1"]
    for key in ("itl_p99_ratio", "usd_per_ok_task_ratio", "ttft_p90_ratio_vs_rr"):
        assert t[key] is not None and t[key] > 0
    for key in ("itl_target_pass", "itl_target_pass_busy_usd", "ttft_target_pass"):
        assert isinstance(t[key], bool), key
    floor = doc["ttft_floor"]
    assert 0 < floor["aggregated"]["p90_s"] < floor["split"]["p90_s"]  # + the KV transfer
    assert 0 < t["ttft_ratio_bound"] <= t["ttft_p90_ratio_vs_rr"] * 1.5
    assert doc["targets"]["best"] == "pd1"
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"]["pd1-meshd"]["split_share"] == 1.0
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 4 * 6
    assert (tmp_path / "pd_cdf.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "ITL p99 pd/agg" in printed and "TTFT p90 meshd/rr" in printed
    assert "model $ pd/agg" in printed
    assert t["modelled_usd_per_ok_task_ratio"] > 0


def test_the_help_says_how_the_workload_is_made(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--splits" in text and "Mooncake" in text and "--min-prefill-tokens" in text


def test_a_split_must_leave_both_pools_engines() -> None:
    with pytest.raises(ValueError, match="both pools"):
        PDBenchSettings(engines=4, splits=(4,))


def test_rule_4_reaches_the_sidecar_on_its_wall_clock() -> None:
    from loadtest.bench.fleet import EngineInfo
    from loadtest.pd_bench import RunSpec, pools_config

    engines = [EngineInfo(f"e{i}", f"http://127.0.0.1:{9000 + i}", "H100", 3.0) for i in range(3)]
    run = RunSpec("pd1-meshd", "meshd", 1)

    def dis(**kw: object) -> dict[str, object]:
        s = PDBenchSettings(engines=3, splits=(1,), engine_time_scale=0.5, **kw)  # type: ignore[arg-type]
        pool = pools_config(s, run, engines)[1]
        return pool["disaggregation"]  # type: ignore[return-value]

    from filters.disagg import FASTER_WHOLE_MARGIN_S

    # The margin is simulated seconds: on the sidecar's clock, where the engines run at
    # half speed, twice as long; the stall weight is a ratio of seconds, as given.
    assert dis()["faster_whole_margin_s"] == FASTER_WHOLE_MARGIN_S / 0.5
    got = dis(faster_whole_margin_s=0.3, faster_whole_stall_weight=0.2)
    assert got["faster_whole_margin_s"] == 0.6 and got["faster_whole_stall_weight"] == 0.2
    assert dis(faster_whole_margin_s=None)["faster_whole_margin_s"] is None
    with pytest.raises(ValueError, match="faster_whole_margin_s"):
        PDBenchSettings(faster_whole_margin_s=-1.0)
