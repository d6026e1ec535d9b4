"""Bench results: task success, cost per successful task, engine deltas, metric parsing,
and the report files (JSON, Markdown with the comparison table, plots)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.bench.client import RequestOutcome
from loadtest.bench.report import BenchReport, comparison_table, write_report
from loadtest.bench.results import (
    count_tasks,
    engine_results,
    skipped,
    summarize,
    throughput_series,
)
from loadtest.bench.scrape import QueueSample, parse_metrics
from loadtest.workloads import PlannedRequest


def planned(
    rid: str, task: str | None = None, step: int | None = None, n: int | None = None
) -> PlannedRequest:
    return PlannedRequest(
        request_id=rid,
        workload="w",
        at_s=0.0,
        kind="completion",
        prompt="p",
        messages=None,
        max_tokens=4,
        prompt_tokens=1,
        task_id=task,
        step=step,
        steps_in_task=n,
        depends_on_previous=bool(step),
    )


def outcome(rid: str, task: str, ok: bool = True, sent: float = 0.0, **kw: Any) -> RequestOutcome:
    fields: dict[str, Any] = dict(
        request_id=rid,
        workload="w",
        tenant="default",
        task_key=task,
        step=None,
        planned_at_s=0.0,
        sent_at_s=sent,
        queued_s=0.0,
        ok=ok,
        error=None if ok else "http_503",
        status=200 if ok else 503,
        ttft_s=0.1 if ok else None,
        e2e_s=1.0,
        output_tokens=4 if ok else 0,
        prompt_tokens=1,
        cached_tokens=None,
        itl_s=(0.3, 0.3, 0.3) if ok else (),
    )
    fields.update(kw)
    return RequestOutcome(**fields)


# A: 3 steps, all ok. B: 2 steps, step 1 failed. C: 3 steps, only 2 sent (cut off).
# D and E: lone requests, D ok, E failed.
PLAN = [
    *(planned(f"a{i}", "A", i, 3) for i in range(3)),
    *(planned(f"b{i}", "B", i, 2) for i in range(2)),
    *(planned(f"c{i}", "C", i, 3) for i in range(3)),
    planned("d"),
    planned("e"),
]
OUTCOMES = [
    outcome("a0", "A"),
    outcome("a1", "A"),
    outcome("a2", "A"),
    outcome("b0", "B"),
    outcome("b1", "B", ok=False),
    outcome("c0", "C"),
    outcome("c1", "C"),
    outcome("d", "d"),
    outcome("e", "e", ok=False),
]
ENGINES = [("e0", "http://a", "H100", 3.0), ("e1", "http://b", "A100", 1.3)]


def test_tasks_succeed_only_when_every_planned_step_did() -> None:
    counts = count_tasks(PLAN, OUTCOMES)
    assert counts.planned == 5
    assert counts.succeeded == 2  # A and d
    assert counts.failed == 2  # B and e
    assert counts.unfinished == 1  # C


def test_engine_results_use_busy_seconds_when_every_engine_reports_them() -> None:
    before = [{"vllm:prefix_cache_queries": 100.0, "vllm:prefix_cache_hits": 10.0}, {}]
    after = [{"vllm:prefix_cache_queries": 300.0, "vllm:prefix_cache_hits": 110.0}, {}]
    engines, basis = engine_results(ENGINES, before, after, [1.0, 2.0], [361.0, 722.0], 1000.0)
    assert basis == "busy"
    e0, e1 = engines
    assert e0.hit_rate == pytest.approx(0.5)  # (110-10) / (300-100)
    assert e1.hit_rate is None
    assert e0.gpu_seconds == 360.0 and e0.cost_usd == pytest.approx(0.30)  # 360 s at $3/h
    assert e1.gpu_seconds == 720.0 and e1.cost_usd == pytest.approx(0.26)

    engines, basis = engine_results(ENGINES, [{}, {}], [{}, {}], [1.0, None], [2.0, None], 3600.0)
    assert basis == "provisioned"
    assert [e.cost_usd for e in engines] == [pytest.approx(3.0), pytest.approx(1.3)]


def test_cost_per_successful_task_counts_all_spend() -> None:
    engines, basis = engine_results(ENGINES, [{}, {}], [{}, {}], [0.0, 0.0], [360.0, 720.0], 9.0)
    samples = [
        QueueSample(0.0, (1.0, 3.0), (2.0, 2.0), (0.1, 0.2)),
        QueueSample(1.0, (0.0, 0.0), (1.0, 1.0), (0.0, 0.0)),
    ]
    r = summarize("p", "policy p", PLAN, OUTCOMES, 1, 10.0, engines, basis, samples)
    assert r.cost_usd == pytest.approx(0.56)
    # Failed work (b1, e) and the unfinished chain C are paid for; 2 tasks succeeded.
    assert r.cost_per_successful_task == pytest.approx(0.28)
    assert r.successful_tasks_per_dollar == pytest.approx(2 / 0.56)
    assert (r.succeeded, r.failed, r.not_sent) == (7, 2, 1)
    assert r.failures == {"http_503": 2}
    assert r.output_tokens == 28
    assert r.output_tok_s == pytest.approx(28 / 1.0)  # every request ran from t=0 to t=1
    assert r.itl.p50 == pytest.approx(0.3)
    assert r.queue_waiting_mean == pytest.approx(2.0) and r.queue_waiting_max == 4.0

    nothing = summarize("p", "", PLAN, [outcome("e", "e", ok=False)], 0, 1.0, engines, basis)
    assert nothing.cost_per_successful_task is None


def test_throughput_series_spreads_tokens_over_each_stream() -> None:
    o = outcome("x", "x", sent=0.5, ttft_s=0.5, e2e_s=2.5, output_tokens=20)  # tokens 1.0 to 3.0
    xs, ys = throughput_series([o], bin_s=1.0)
    assert xs == [0.0, 1.0, 2.0, 3.0]
    assert ys == pytest.approx([0.0, 10.0, 10.0, 0.0])
    assert sum(ys) == pytest.approx(20)


def test_parse_metrics_sums_label_sets_and_ignores_created() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries.",
            "# TYPE vllm:prefix_cache_queries counter",
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 120.0',
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 30',
            'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="a,b}"} 0.25',
            "vllm:other_total 9",
            "garbage line",
        ]
    )
    m = parse_metrics(text)
    assert m == {
        "vllm:prefix_cache_queries": 150.0,
        "vllm:num_requests_waiting": 4.0,
        "vllm:kv_cache_usage_perc": 0.25,
    }


def _report() -> BenchReport:
    engines, basis = engine_results(
        ENGINES,
        [{"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0}] * 2,
        [{"vllm:prefix_cache_queries": 100.0, "vllm:prefix_cache_hits": 40.0}] * 2,
        [0.0, 0.0],
        [10.0, 20.0],
        5.0,
    )
    samples = [QueueSample(t, (float(t), 0.0), (1.0, 1.0), (0.0, 0.0)) for t in range(3)]
    rr = summarize("round-robin", "meshd rr", PLAN, OUTCOMES, 1, 3.0, engines, basis, samples)
    fast = summarize(
        "meshd", "meshd best", PLAN, [outcome(o.request_id, o.task_key) for o in OUTCOMES],
        0, 3.0, engines, basis, samples,
    )  # fmt: skip
    return BenchReport(
        title="test bench",
        command="meshd bench --quick",
        started_at="now",
        workload_name="w",
        workload_args={"seed": 1},
        workload={
            "requests": len(PLAN),
            "upper_bound_hit_rate": 0.5,
            "round_robin_bound": {"2": 0.25},
        },
        fleet={"engines": 2, "kind": "sim", "gpu_summary": "1 x H100, 1 x A100"},
        client={"timeout_s": 10, "max_concurrency": 8},
        results=(rr, fast, skipped("sglang-router", "sglang", "sglang-router is not installed")),
        notes=("a note",),
    )


def test_comparison_table_rows_ratios_and_skips() -> None:
    text = comparison_table(_report())
    lines = text.splitlines()
    assert lines[0].startswith("| policy | ok / failed | TTFT p50")
    rr_row = next(line for line in lines if line.startswith("| round-robin |"))
    assert "| 7 / 2 |" in rr_row and "| 2 / 5 |" in rr_row
    assert "Ratios vs round-robin" in text
    ratio_row = [line for line in lines if line.startswith("| meshd |")][1]  # (2: targets)
    # meshd: 4 tasks ok (C is still cut off) for the same spend as round robin's 2.
    assert ratio_row.endswith("| 2.00x | 0.50x | 2.00x |")
    assert "- sglang-router: skipped: sglang-router is not installed" in text


def test_write_report_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = write_report(_report(), tmp_path)
    assert path == tmp_path / "report.md"
    md = path.read_text()
    assert "## Comparison" in md and "| round-robin |" in md and "## Engines" in md
    assert "hit-rate upper bound" in md and "50.0%" in md
    doc = json.loads((tmp_path / "results.json").read_text())
    assert [p["policy"] for p in doc["policies"]] == ["round-robin", "meshd", "sglang-router"]
    assert doc["policies"][0]["tasks"] == {
        "planned": 5,
        "succeeded": 2,
        "failed": 2,
        "unfinished": 1,
    }
    assert doc["policies"][2]["status"] == "skipped"
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2 * len(OUTCOMES)
    for name in ("ttft_cdf", "throughput", "queue_depth", "hit_rate_per_engine", "cost_per_task"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name}.png)" in md


def test_write_report_without_plots(tmp_path: Path) -> None:
    write_report(_report(), tmp_path, plots=False)
    assert not list(tmp_path.glob("*.png"))
    assert "## Plots" not in (tmp_path / "report.md").read_text()
