"""End to end: a fleet child of 2 engines, `meshd sidecar` as a subprocess, a 10-request
workload with an agentic chain, and the report on disk; plus the command line's parsing."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from loadtest.bench import cli
from loadtest.bench.client import ClientSettings
from loadtest.bench.fleet import FleetSpec, sim_unavailable
from loadtest.bench.runner import BenchConfig, build_workload, run_bench
from loadtest.workloads import PlannedRequest, agentic, mix, shared_prefix


def ten_requests() -> list[PlannedRequest]:
    questions = shared_prefix(
        groups=2, questions_per_group=3, system_prompt_tokens=64, question_tokens=8,
        max_tokens=8, rate=40.0, seed=1,
    )  # fmt: skip
    tasks = agentic(
        tasks=1, steps=4, step_tokens=8, system_prompt_tokens=32, max_tokens=8, think_s=0.0,
        rate=40.0, seed=1, deadline_ms=30_000,
    )  # fmt: skip
    return mix(questions, tasks)


@pytest.mark.parametrize("kind", ["stub", "sim"])
async def test_bench_through_meshd_sidecar(tmp_path: Path, kind: str) -> None:
    if kind == "sim" and sim_unavailable():
        pytest.skip(str(sim_unavailable()))
    requests = ten_requests()
    assert len(requests) == 10
    logged: list[str] = []
    config = BenchConfig(
        fleet=FleetSpec(("H100", "A100"), kind=kind),  # type: ignore[arg-type]
        workload="test",
        policies=("round-robin",),
        client=ClientSettings(timeout_s=8.0, duration_s=5.0, drain_s=8.0),
        out_dir=tmp_path,
        plots=False,
        sample_period_s=0.2,
    )
    report, path = await run_bench(config, requests, log=logged.append)
    (result,) = report.results
    assert result.status == "ok", (result.reason, logged)
    assert (result.succeeded, result.failed, result.not_sent) == (10, 0, 0), result.failures
    assert result.tasks.planned == 7 and result.tasks.succeeded == 7
    assert result.cost_per_successful_task is not None and result.cost_usd > 0
    assert result.ttft.n == 10 and 0 < result.ttft.p50 <= result.e2e.p50
    assert {e.gpu for e in result.engines} == {"H100", "A100"}
    if kind == "sim":
        assert result.gpu_basis == "busy"
        assert result.hit_rate is not None and result.hit_rate > 0  # shared prefixes hit
        assert result.samples, "queue depth was sampled"
        # The floor: every request, on an idle H100, never above what a request measured.
        floor = report.ttft_floor
        assert floor is not None and floor.gpu == "H100" and floor.ttft.n == 10
        assert 0 < floor.ttft.p50 <= result.ttft.p50
        assert "TTFT floor (H100" in path.read_text()
    else:
        assert result.gpu_basis == "provisioned" and result.hit_rate is None
        assert report.ttft_floor is None
    md = path.read_text()
    assert "| round-robin | 10 / 0 |" in md
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["policies"][0]["requests"]["succeeded"] == 10
    assert (tmp_path / "logs" / "round-robin" / "meshd-sidecar.yaml").exists()


def test_cli_builds_the_config_and_rejects_bad_workload_args(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.register(sub)
    cli.register_demo(sub)
    argv = [
        "bench", "--workload", "shared-prefix", "--rate", "8", "--seed", "3",
        "--arg", "groups=2", "--engines", "4", "--gpus", "H100,A100", "--fleet", "stub",
        "--policies", "round-robin,meshd", "--quick", "--out", str(tmp_path), "--no-plots",
    ]  # fmt: skip
    args = parser.parse_args(argv)
    assert args.func is cli.bench
    config = cli.config_from_args(args, argv)
    assert config.workload_args == {"rate": 8.0, "seed": 3, "groups": 2}
    assert config.fleet.gpus == ("H100", "A100", "H100", "A100") and config.fleet.kind == "stub"
    assert config.policies == ("round-robin", "meshd")
    assert config.client.duration_s == cli.QUICK_DURATION_S
    assert config.out_dir == tmp_path and not config.plots
    assert config.command.startswith("meshd bench --workload shared-prefix")
    assert len(build_workload(config.workload, config.workload_args)) == 32

    bad = parser.parse_args(["bench", "--workload", "shared-prefix", "--cap", "5"])
    with pytest.raises(ValueError, match="takes no cap"):
        cli.config_from_args(bad, [])
    assert cli.bench(bad, []) == 2

    demo = parser.parse_args(["demo", "--quick"])
    assert demo.func is cli.demo_main and demo.quick


async def test_sigterm_cancels_the_run_and_its_cleanup_runs() -> None:
    cleaned = asyncio.Event()

    async def run() -> int:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.Event().wait()  # the signal's cancel ends this
            return 0
        finally:
            cleaned.set()

    with pytest.raises(cli.Interrupted):
        await cli._cancel_on_signals(run())
    assert cleaned.is_set()
