"""Issue 4's targets in the bench report: hit rate over the one-infinite-cache bound of the
requests a policy sent, TTFT p90 / throughput / success against the peer, cost per
successful task against round robin; and meshd started with the fleet's GPUs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from bench_builders import outcome, report, result

from loadtest.bench.fleet import EngineInfo, FleetSpec
from loadtest.bench.policies import (
    POLICIES,
    FleetPolicySpec,
    sidecar_config_for_fleet,
)
from loadtest.bench.report import Target, comparison_table, targets, write_report
from loadtest.bench.results import Distribution
from loadtest.bench.runner import sent_hit_bound
from loadtest.workloads import PlannedRequest
from meshd.config import load_config


def planned(rid: str, blocks: tuple[int, ...]) -> PlannedRequest:
    return PlannedRequest(
        request_id=rid,
        workload="w",
        at_s=0.0,
        kind="completion",
        prompt="p",
        messages=None,
        max_tokens=4,
        prompt_tokens=1,
        block_ids=blocks,
    )


def test_the_bound_counts_only_the_requests_a_policy_sent() -> None:
    plan = [planned("a", (1, 2)), planned("b", (1, 2, 3)), planned("c", (1, 2, 3, 4))]
    sent = result("p", outcomes=(outcome("a"), outcome("b")))
    assert sent_hit_bound(plan, sent) == 2 / 5  # b repeats a's two blocks
    everything = result("p", outcomes=tuple(outcome(r.request_id) for r in plan))
    assert sent_hit_bound(plan, everything) == 5 / 9


def test_targets_are_ratios_against_the_bound_the_peer_and_the_baseline() -> None:
    rr = result("round-robin", hit_rate=0.1, cost_per_successful_task=0.010)
    sg = result("sglang-router", hit_rate=0.55, ttft=Distribution(100, 0.2, 0.2, 0.40, 0.5, 1))
    good = result(
        "meshd",
        hit_rate=0.57,
        ttft=Distribution(100, 0.1, 0.1, 0.19, 0.3, 0.4),
        output_tok_s=50.2,
        succeeded=100,
        cost_per_successful_task=0.0079,
    )
    r = report(rr, sg, good, hit_bounds={"round-robin": 0.6, "sglang-router": 0.6, "meshd": 0.6})
    got = {t.name: t for t in targets(r)}
    assert got["hit rate / bound"].ratio is not None
    assert abs(got["hit rate / bound"].ratio - 0.95) < 1e-9
    assert all(t.met for t in got.values()), got
    # One miss of each kind, by a little: the verdict says so.
    bad = replace(
        good,
        hit_rate=0.5,
        ttft=Distribution(100, 0.1, 0.1, 0.21, 0.3, 0.4),
        output_tok_s=49.0,
        succeeded=99,
        cost_per_successful_task=0.0082,
    )
    missed = targets(report(rr, sg, bad, hit_bounds={"meshd": 0.6}))
    assert [t.met for t in missed] == [False] * 5
    text = comparison_table(report(rr, sg, bad, hit_bounds={"meshd": 0.6}))
    assert "- meshd: TTFT p90 / peer = 0.52 (goal <= 0.50): MISSED" in text
    assert "- meshd: $ / ok task / baseline = 0.82 (goal <= 0.80): MISSED" in text
    assert "| meshd | 50.0% / 60.0% = 0.83 |" in text


def test_targets_without_the_peer_are_not_measurable(tmp_path: Path) -> None:
    r = report(result("round-robin"), result("meshd"), hit_bounds={"meshd": 0.5})
    got = targets(r)
    assert [t.met for t in got] == [True, None, None, None, False]
    assert isinstance(got[0], Target)
    write_report(r, tmp_path, plots=False)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["hit_rate_bounds"] == {"meshd": 0.5}
    assert doc["targets"][1] == {
        "policy": "meshd",
        "target": "TTFT p90 / peer",
        "ratio": None,
        "goal": "<= 0.50",
        "met": None,
    }


def test_meshd_is_started_with_the_fleets_gpus() -> None:
    spec = POLICIES["meshd"]
    assert isinstance(spec, FleetPolicySpec) and spec.start_on_fleet is not None
    assert not isinstance(POLICIES["meshd-no-gpu"], FleetPolicySpec)
    engines = [
        EngineInfo("h100-0", "http://127.0.0.1:1", "H100", 3.0),
        EngineInfo("a100-1", "http://127.0.0.1:2", "A100", 1.3),
    ]
    config = load_config(None, base=sidecar_config_for_fleet(engines, "meshd"), env={})
    assert [(e.url, e.gpu) for e in config.pools[0].endpoints] == [
        ("http://127.0.0.1:1", "H100"),
        ("http://127.0.0.1:2", "A100"),
    ]
    assert config.routing.policy == "meshd"
    assert [e.kv_capacity_tokens for e in config.pools[0].endpoints] == [None, None]


def test_meshd_is_told_the_fleets_kv_capacity_where_known() -> None:
    # A small --kv-blocks fleet: without its capacity the index would model the GPU's
    # datasheet cache (~440k tokens) and keep prefixes the engines evicted long ago.
    engines = [
        EngineInfo("h100-0", "http://127.0.0.1:1", "H100", 3.0, 8192),
        EngineInfo("a100-1", "http://127.0.0.1:2", "A100", 1.3),
    ]
    config = load_config(None, base=sidecar_config_for_fleet(engines, "meshd"), env={})
    assert [e.kv_capacity_tokens for e in config.pools[0].endpoints] == [8192, None]


def test_virtual_meshd_is_told_the_fleets_kv_capacity() -> None:
    from loadtest.bench.virtual import engine_specs, kv_capacity_tokens, sidecar_model
    from loadtest.engine.virtual import VirtualFleet

    fleet = VirtualFleet(engine_specs(FleetSpec(gpus=("H100", "A100"), kv_blocks=512)))
    kv = [kv_capacity_tokens(e) for e in fleet]
    assert kv == [512 * 16, 512 * 16]
    urls = [f"http://{e.name}:8000" for e in fleet]
    model = sidecar_model(urls, "meshd", ["H100", "A100"], kv)
    states = model.router.states  # type: ignore[attr-defined]
    assert [s.kv_capacity(0.0) for s in states] == kv


def test_meshd_latency_sets_the_value_of_time_in_the_config() -> None:
    engines = [EngineInfo("h100-0", "http://127.0.0.1:1", "H100", 3.0)]
    doc = sidecar_config_for_fleet(engines, "meshd", {"lambda_usd_per_s": 1e-2})
    config = load_config(None, base=doc, env={})
    assert config.routing.picker.lambda_usd_per_s == 1e-2
    assert "lambda_usd_per_s=0.001" in POLICIES["meshd-cost"].summary
    assert isinstance(POLICIES["meshd-cost"], FleetPolicySpec)
