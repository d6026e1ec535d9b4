"""Small builders of bench results for the report tests (tests/test_bench_targets.py,
tests/test_bench_floor.py): one successful request, one policy's result, a report."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loadtest.bench.client import RequestOutcome
from loadtest.bench.report import BenchReport
from loadtest.bench.results import Distribution, PolicyResult, TaskCounts


def outcome(rid: str, ttft_s: float = 0.1) -> RequestOutcome:
    """A successful request `rid` with its first token after `ttft_s`."""
    return RequestOutcome(
        request_id=rid,
        workload="w",
        tenant="default",
        task_key=rid,
        step=None,
        planned_at_s=0.0,
        sent_at_s=0.0,
        queued_s=0.0,
        ok=True,
        error=None,
        status=200,
        ttft_s=ttft_s,
        e2e_s=1.0,
        output_tokens=4,
        prompt_tokens=1,
        cached_tokens=None,
    )


def result(name: str, **kw: Any) -> PolicyResult:
    """Policy `name`'s result: 100 requests, all served; `kw` replaces any field."""
    base = PolicyResult(
        policy=name,
        summary=name,
        status="ok",
        requests_sent=100,
        succeeded=100,
        ttft=Distribution(100, 0.1, 0.1, 0.2, 0.3, 0.4),
        output_tok_s=50.0,
        hit_rate=0.5,
        cost_usd=1.0,
        tasks=TaskCounts(100, 100, 0, 0),
        cost_per_successful_task=0.01,
    )
    return replace(base, **kw)


def report(*results: PolicyResult, **kw: Any) -> BenchReport:
    """A report of `results`; `kw` sets its other fields (hit_bounds, ttft_floor, ...)."""
    return BenchReport(
        title="t",
        command="c",
        started_at="now",
        workload_name="w",
        workload_args={},
        workload={},
        fleet={},
        client={},
        results=results,
        **kw,
    )
