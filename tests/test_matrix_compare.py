"""loadtest/bench/matrix.py's judgement of a cell: meshd against the best peer per figure,
the floors where no router can reach a target, both cost views."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtest.bench.matrix import MESHD, PEERS, Cell, compare, hit_bound, report, setup


def figs(policy: str, **kw: Any) -> dict[str, Any]:
    base = {
        "policy": policy,
        "ok": 100,
        "sent": 100,
        "ttft_p90": 1.0,
        "ttft_p99": 2.0,
        "e2e_p50": 3.0,
        "hit_rate": 0.5,
        "keep": None,
        "makespan_p50": None,
        "task_success": None,
        "wasted_share": None,
        "cost_per_ok_task": 1.0,
        "fixed_cost_per_ok_task": 1.0,
        "max_over_mean": 1.2,
    }
    return {**base, **kw}


def cell(mine: dict[str, Any], peers: dict[str, Any] | None = None, **extra: Any) -> dict:
    rows = [figs(p, **(peers or {})) for p in PEERS] + [figs(MESHD, **mine)]
    return {"cell": {"workload": "mooncake", "cache": "small"}, "figures": rows, **extra}


def test_ratios_and_targets():
    c = compare(cell({"ttft_p90": 0.6, "e2e_p50": 3.3, "hit_rate": 0.56}))
    assert c["ttft_p90"]["ratio"] == 0.6 and c["ttft_p90"]["pass"]
    assert not c["e2e_p50"]["pass"]  # 1.1x the best peer
    assert c["hit_rate"]["pass"]  # 1.12x


def test_the_hit_rate_is_judged_against_the_bound_where_1_1x_cannot_be_reached():
    # The peers hit 0.5 and one infinite cache 0.52: 1.1x (0.55) is out of reach, so the
    # cell is judged against the best peer itself.
    even = compare(cell({"hit_rate": 0.5}, hit_bound=0.52))
    assert even["hit_rate"]["pass"] and even["hit_rate"]["floor"]
    assert not compare(cell({"hit_rate": 0.49}, hit_bound=0.52))["hit_rate"]["pass"]
    # Without a bound (closed loop), or with room under it, 1.1x stands.
    assert not compare(cell({"hit_rate": 0.5}))["hit_rate"]["pass"]
    assert not compare(cell({"hit_rate": 0.5}, hit_bound=0.9))["hit_rate"]["pass"]
    # Large caches: also 0.9 of the bound.
    large = cell({"hit_rate": 0.5}, {"hit_rate": 0.45}, hit_bound=0.49)
    large["cell"]["cache"] = "large"
    assert compare(large)["hit_rate"]["pass"]
    large = cell({"hit_rate": 0.43}, {"hit_rate": 0.42}, hit_bound=0.6)
    large["cell"]["cache"] = "large"
    assert not compare(large)["hit_rate"]["pass"]  # 0.43 < 0.9 x 0.6 (and 1.02x)


def test_both_cost_views_against_round_robin():
    c = compare(cell({"cost_per_ok_task": 0.95, "fixed_cost_per_ok_task": 0.95}))
    assert c["cost_vs_rr"]["ratio"] == 0.95 and not c["cost_vs_rr"]["pass"]  # elastic: 0.9
    assert c["fixed_vs_rr"]["pass"]  # fixed fleet: no worse than 1.0
    text = report([{**cell({}), "label": "x", "variant": "centre"}])
    assert (
        "fixed_vs_rr"
        in text.splitlines()[
            next(i for i, ln in enumerate(text.splitlines()) if ln.startswith("| cell"))
        ]
    )


def test_the_elastic_view_judges_meshd_told_its_pool_is_elastic():
    from loadtest.bench.matrix import MESHD_ELASTIC

    c = cell({"cost_per_ok_task": 0.95, "fixed_cost_per_ok_task": 0.97})
    c["figures"].append(figs(MESHD_ELASTIC, cost_per_ok_task=0.85, fixed_cost_per_ok_task=2.0))
    got = compare(c)
    assert got["cost_vs_rr"]["ratio"] == 0.85 and got["cost_vs_rr"]["pass"]
    assert got["fixed_vs_rr"]["ratio"] == 0.97  # the fixed view stays meshd's defaults'
    # Latency figures are meshd's defaults', never the elastic row's.
    c["figures"][-1]["ttft_p90"] = 0.1
    assert compare(c)["ttft_p90"]["ratio"] == 1.0


def test_a_candidate_runs_only_the_meshd_rows_with_its_overrides_and_reuses_the_peers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json
    from types import SimpleNamespace

    from loadtest.bench import matrix, virtual
    from loadtest.bench.matrix import MESHD_ELASTIC

    seen: list[tuple[str, Any]] = []

    def fake_policy(policy: str, fleet: Any, requests: Any, settings: Any, **kw: Any) -> Any:
        seen.append((policy, kw.get("overrides")))
        return SimpleNamespace(), SimpleNamespace(outcomes=[])

    def fake_figures(policy: str, requests: Any, outcomes: Any, result: Any, fleet: Any) -> Any:
        return matrix.Figures(
            **{**figs(policy, ttft_p90=0.5), "engine_hit_rate": 0.5, "cost_usd": 1.0}
        )

    monkeypatch.setattr(virtual, "run_virtual_policy", fake_policy)
    monkeypatch.setattr(matrix, "figures", fake_figures)
    monkeypatch.setattr(matrix, "floor_p90", lambda requests, fleet: None)
    c = Cell("agentic", engines=4)
    cand = {"picker_config": {"sticky_tolerance": 0.1}}
    out = matrix.run_cell(c, quick=True, policies=[MESHD, MESHD_ELASTIC], overrides=cand)
    assert seen == [
        (MESHD, cand),
        (MESHD, {"picker_config": {"elastic": True, "sticky_tolerance": 0.1}}),
    ]
    assert [r["policy"] for r in out["figures"]] == [MESHD, MESHD_ELASTIC]
    prior = [{"label": c.label, "quick": True, "figures": [figs(p) for p in PEERS]}]
    merged = matrix.reuse(out, prior)
    assert {r["policy"] for r in merged["figures"]} == {*PEERS, MESHD, MESHD_ELASTIC}
    assert compare(merged)["ttft_p90"]["ratio"] == 0.5
    with pytest.raises(SystemExit, match="no cell"):
        matrix.reuse({**out, "label": "other"}, prior)
    # From the command line: peers measured once, a candidate against them.
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(prior))
    monkeypatch.setattr(matrix, "write", lambda cells, out_dir, plots: written.extend(cells))
    written: list[dict[str, Any]] = []
    seen.clear()
    args = ["--quick", "--jobs", "1", "--cells", c.label, "--out", str(tmp_path)]
    monkeypatch.setattr(matrix, "default_cells", lambda quick, full: [c])
    rc = matrix.main(
        [*args, "--policies", MESHD, "--reuse", str(path), "--override", json.dumps(cand)]
    )
    assert rc == 0 and seen == [(MESHD, cand)]
    assert {r["policy"] for r in written[0]["figures"]} == {*PEERS, MESHD}


def test_candidate_options_say_what_is_wrong(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from loadtest.bench import matrix

    for bad, why in (
        (["--policies", "meshd-no-gpu"], "--policies needs --reuse"),
        (["--policies", "fastest"], "--policies: unknown ['fastest']"),
        (["--override", "{nope"], "--override: not JSON"),
        (["--override", "[1]"], "--override: must be a JSON object"),
    ):
        with pytest.raises(SystemExit):
            matrix.main([*bad, "--out", str(tmp_path)])
        assert why in capsys.readouterr().err


def test_the_bound_is_known_for_open_loop_cells_only():
    c = Cell("shared-prefix", engines=4)
    b = hit_bound(c, setup(c, quick=True)[0])
    assert b is not None and 0.5 < b < 1.0  # 16 system prompts shared by every request
    s = Cell("sessions", engines=4)
    assert hit_bound(s, []) is None


def test_cells_picks_cells_by_label_and_names_an_unknown_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from loadtest.bench import matrix

    ran: list[str] = []

    def fake_run(args: tuple[matrix.Cell, bool]) -> dict[str, object]:
        ran.append(args[0].label)
        return {"label": args[0].label, "wall_s": 0.0}

    monkeypatch.setattr(matrix, "_run", fake_run)
    monkeypatch.setattr(matrix, "write", lambda cells, out_dir, plots: None)
    want = "mooncake 8xH100 small load 1;sessions 8xmixed small load 0.8"
    assert matrix.main(["--jobs", "1", "--cells", want, "--out", str(tmp_path)]) == 0
    assert sorted(ran) == sorted(want.split(";"))
    with pytest.raises(SystemExit):
        matrix.main(["--cells", "mooncake 3xH100 small load 0.8", "--out", str(tmp_path)])
    assert "no such cell: mooncake 3xH100 small load 0.8" in capsys.readouterr().err


def test_max_over_mean_passes_over_two_only_where_meshd_was_faster():
    over = compare(cell({"max_over_mean": 2.5, "ttft_p90": 1.1}))
    assert not over["max_over_mean"]["pass"]  # concentrated, and slower for it
    faster = compare(cell({"max_over_mean": 2.5, "ttft_p90": 0.9, "e2e_p50": 2.9}))
    assert faster["max_over_mean"]["pass"]
    assert compare(cell({"max_over_mean": 1.9, "ttft_p90": 1.5}))["max_over_mean"]["pass"]


def test_mixed_cells_run_both_listings_and_report_their_mean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mixed fleet is run H100-first and A100-first (a rule breaking ties by endpoint
    order wins or loses by the listing); each figure is the mean of the two."""
    from types import SimpleNamespace

    from loadtest.bench import matrix, virtual

    listings: list[tuple[str, ...]] = []

    def fake_policy(policy: str, fleet: Any, requests: Any, settings: Any, **kw: Any) -> Any:
        listings.append(tuple(fleet.gpus))
        return SimpleNamespace(), SimpleNamespace(outcomes=[])

    def fake_figures(policy: str, requests: Any, outcomes: Any, result: Any, fleet: Any) -> Any:
        first = fleet.gpus[0] == "H100"
        return matrix.Figures(
            policy=policy,
            ok=10 if first else 13,
            sent=20,
            ttft_p90=0.03 if first else 0.09,
            ttft_p99=0.1,
            e2e_p50=1.0 if first else 3.0,
            hit_rate=0.5,
            engine_hit_rate=0.5,
            keep=None if first else 0.8,
            makespan_p50=None,
            task_success=None,
            wasted_share=None,
            cost_usd=2.0,
            cost_per_ok_task=None,
            max_over_mean=8.0,
        )

    monkeypatch.setattr(virtual, "run_virtual_policy", fake_policy)
    monkeypatch.setattr(matrix, "figures", fake_figures)
    monkeypatch.setattr(matrix, "floor_p90", lambda requests, fleet: None)
    out = matrix.run_cell(Cell("agentic", engines=4, gpus="mixed"), quick=True)
    policies = len(PEERS) + 3  # meshd, meshd told it is elastic, meshd told the GPUs
    assert listings.count(("H100", "A100", "H100", "A100")) == policies
    assert listings.count(("A100", "H100", "A100", "H100")) == policies
    assert out["orders"] == 2
    row = out["figures"][0]
    assert row["ttft_p90"] == pytest.approx(0.06) and row["e2e_p50"] == pytest.approx(2.0)
    assert row["ok"] == 12 and row["keep"] == 0.8 and row["makespan_p50"] is None
    listings.clear()
    same = matrix.run_cell(Cell("agentic", engines=4), quick=True)
    assert same["orders"] == 1 and len(listings) == len(PEERS) + 2
    assert same["figures"][0]["ttft_p90"] == pytest.approx(0.03)
