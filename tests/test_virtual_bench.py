"""The bench on a virtual clock (loadtest/bench/virtual.py): the client's semantics
(chains, caps, timeouts, concurrency), meshd's routers in-process, the report."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.bench.client import ClientSettings, RequestOutcome
from loadtest.bench.fleet import FleetSpec, fleet_gpus
from loadtest.bench.runner import BenchConfig
from loadtest.bench.virtual import (
    ScaleCase,
    VirtualFleet,
    VirtualPass,
    engine_specs,
    engine_url,
    kv_capacity_tokens,
    main,
    measure_scale,
    run_virtual_bench,
    run_virtual_policy,
    scale_table,
    sidecar_model,
)
from loadtest.engine.faults import parse_fault
from loadtest.workloads import agentic, demo, shared_prefix

QUIET = ClientSettings(progress=False)


def _log(_: str) -> None:
    return None


def test_same_inputs_same_outcomes() -> None:
    reqs = demo(duration_s=10)
    spec = FleetSpec(gpus=fleet_gpus(4, ["H100", "A100"]), kv_blocks=512)
    a, _ = run_virtual_policy("meshd", spec, reqs, QUIET, log=_log)
    b, _ = run_virtual_policy("meshd", spec, reqs, QUIET, log=_log)
    assert a.succeeded == len(reqs) - a.not_sent > 0
    assert [o.to_json() for o in a.outcomes] == [o.to_json() for o in b.outcomes]


def test_chains_send_each_step_after_the_previous_one_with_its_answer() -> None:
    reqs = agentic(tasks=3, steps=(3, 3), step_tokens=32, max_tokens=8, think_s=0.25, seed=1)
    result, run = run_virtual_policy(
        "round-robin", FleetSpec(gpus=("H100",)), reqs, QUIET, log=_log
    )
    assert run is not None and result.succeeded == 9
    think = {r.request_id: r.think_s for r in reqs}
    by_task: dict[str, list[RequestOutcome]] = {}
    for o in run.outcomes:
        by_task.setdefault(o.task_key, []).append(o)
    for steps in by_task.values():
        steps.sort(key=lambda o: o.step or 0)
        for prev, nxt in itertools.pairwise(steps):
            assert nxt.sent_at_s == pytest.approx(prev.end_at_s + think[nxt.request_id])
            # The next prompt carries the previous prompt and answer.
            assert nxt.prompt_tokens is not None and prev.prompt_tokens is not None
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert nxt.cached_tokens and nxt.cached_tokens >= 16


def test_duration_cap_concurrency_and_timeout() -> None:
    reqs = shared_prefix(groups=1, questions_per_group=40, max_tokens=64, rate=200.0, seed=2)
    capped = replace(QUIET, duration_s=0.1, drain_s=30.0)
    result, _ = run_virtual_policy("round-robin", FleetSpec(gpus=("A100",)), reqs, capped, log=_log)
    assert 0 < result.requests_sent < len(reqs)
    assert result.not_sent == len(reqs) - result.requests_sent

    narrow = replace(QUIET, max_concurrency=2)
    result, run = run_virtual_policy(
        "round-robin", FleetSpec(gpus=("A100",)), reqs, narrow, log=_log
    )
    assert run is not None and result.succeeded == len(reqs)
    assert max(o.queued_s for o in run.outcomes) > 0.1

    short = replace(QUIET, timeout_s=0.2)
    result, _ = run_virtual_policy("round-robin", FleetSpec(gpus=("A100",)), reqs, short, log=_log)
    assert result.failures.get("timeout", 0) > 0

    drained = replace(QUIET, duration_s=0.05, drain_s=0.1)
    result, _ = run_virtual_policy(
        "round-robin", FleetSpec(gpus=("A100",)), reqs, drained, log=_log
    )
    assert result.failures.get("cancelled", 0) > 0


def test_every_planned_request_is_accounted_for_once() -> None:
    reqs = demo(duration_s=6, load=4.0)
    cut = replace(QUIET, duration_s=3.0, drain_s=0.02)
    result, run = run_virtual_policy(
        "least-request", FleetSpec(gpus=("A100", "H100")), reqs, cut, log=_log
    )
    assert run is not None
    seen = [o.request_id for o in run.outcomes] + list(run.not_sent)
    assert sorted(seen) == sorted(r.request_id for r in reqs)
    assert result.tasks.unfinished > 0 and run.sim_s <= 3.02
    assert result.failures.get("cancelled", 0) > 0


def test_meshd_policy_finds_the_cached_prefixes() -> None:
    reqs = shared_prefix(groups=4, questions_per_group=12, rate=8.0, max_tokens=16, seed=4)
    spec = FleetSpec(gpus=fleet_gpus(4, ["H100"]), kv_blocks=256)
    rr, _ = run_virtual_policy("round-robin", spec, reqs, QUIET, log=_log)
    meshd, _ = run_virtual_policy("meshd", spec, reqs, QUIET, log=_log)
    assert rr.hit_rate is not None and meshd.hit_rate is not None
    assert meshd.hit_rate > rr.hit_rate + 0.1


def test_a_refusing_engine_is_routed_around() -> None:
    reqs = shared_prefix(groups=1, questions_per_group=12, rate=20.0, max_tokens=8, seed=5)
    specs = engine_specs(FleetSpec(gpus=("H100", "H100")))
    fleet = VirtualFleet(specs)
    fleet[0].inject(parse_fault({"kind": "cold_start", "seconds": 60}), 0.0)
    sidecar = sidecar_model([engine_url(e) for e in fleet], "round-robin")
    run = VirtualPass(fleet, sidecar, QUIET).run(reqs)
    assert all(o.ok for o in run.outcomes) and len(run.outcomes) == 12
    assert fleet[1].core.stats.prefix_cache_queries > 0
    assert fleet[0].core.stats.prefix_cache_queries == 0


def test_crashes_count_as_failed_requests_and_tasks() -> None:
    reqs = shared_prefix(groups=1, questions_per_group=6, rate=20.0, max_tokens=20, seed=6)
    fleet = VirtualFleet(engine_specs(FleetSpec(gpus=("H100",))))
    fleet[0].inject(parse_fault({"kind": "crash_after_tokens", "tokens": 5, "count": 2}), 0.0)
    sidecar = sidecar_model([engine_url(e) for e in fleet], "least-request")
    run = VirtualPass(fleet, sidecar, QUIET).run(reqs)
    bad = [o for o in run.outcomes if not o.ok]
    assert len(bad) == 2 and all(o.error == "truncated" and o.output_tokens == 5 for o in bad)


def test_bench_report_and_peers_skipped(tmp_path: Path) -> None:
    config = BenchConfig(
        fleet=FleetSpec(gpus=fleet_gpus(2, ["H100", "A100"]), kv_blocks=512),
        workload="demo",
        workload_args={"duration_s": 5.0},
        policies=("round-robin", "meshd", "envoy-rr"),
        client=QUIET,
        out_dir=tmp_path,
        plots=False,
    )
    report, path = run_virtual_bench(config, log=_log)
    assert path.exists() and "virtual clock" in path.read_text()
    doc = json.loads((tmp_path / "results.json").read_text())
    statuses = {r["policy"]: r["status"] for r in doc["policies"]}
    assert statuses == {"round-robin": "ok", "meshd": "ok", "envoy-rr": "skipped"}
    assert [r.policy for r in report.ran] == ["round-robin", "meshd"]


def test_cli_and_scale_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "--engines", "2", "--workload", "shared-prefix", "--arg", "questions_per_group=3",
            "--arg", "groups=2", "--policies", "round-robin", "--no-plots", "--no-progress",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert rc == 0 and "round-robin" in capsys.readouterr().out
    rows = measure_scale(
        [ScaleCase(3, "round-robin", "shared-prefix", {"groups": 2, "questions_per_group": 4})],
        progress=False,
        log=_log,
    )
    (row,) = rows
    assert row.requests == row.succeeded == 8 and row.sim_s > 0 and row.wall_s > 0
    table = scale_table(rows)
    assert "sim-s per wall-s" in table.splitlines()[0]
    assert table.splitlines()[2].startswith("| 3 | round-robin | shared-prefix")


def test_sidecar_model_is_the_sidecars_router_with_or_without_gpus() -> None:
    urls = ["http://h100-0:8000", "http://a100-1:8000"]
    told = sidecar_model(urls, "meshd", ["H100", "A100"])
    blind = sidecar_model(urls, "meshd")
    assert told.policy == blind.policy == "meshd" and told.trusted and told.max_attempts >= 1
    assert [s["gpu"] for s in told.router.snapshot(0.0)] == ["H100", "A100"]
    assert [s["gpu"] for s in blind.router.snapshot(0.0)] != ["H100", "A100"]
    rr = sidecar_model(urls, "round-robin")
    assert rr.router.policy == "round-robin"


def test_meshd_bench_virtual_clock_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from meshd.cli import main as meshd_main

    rc = meshd_main(
        [
            "bench", "--virtual-clock", "--engines", "2", "--workload", "shared-prefix",
            "--arg", "questions_per_group=3", "--arg", "groups=2",
            "--policies", "round-robin,meshd", "--no-plots", "--no-progress",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "meshd" in out
    report = json.loads((tmp_path / "results.json").read_text())
    assert "virtual clock" in json.dumps(report)


def test_meshd_holds_new_tasks_past_the_knee_and_never_a_started_one() -> None:
    """Overload: the sidecar's admission (modelled in the virtual pass) holds new tasks
    while every engine is past its knee and refuses those held too long (429, the knee
    named); a task's later steps are never held, and the first tokens of what it serves
    come sooner than with round robin, which piles everything onto the engines."""
    reqs = agentic(
        tasks=60,
        steps=3,
        step_tokens=2000,
        system_prompt_tokens=16,
        max_tokens=64,
        think_s=0.2,
        rate=30.0,
        deadline_ms=10**9,
        seed=1,
    )
    spec = FleetSpec(gpus=("A100",), kv_blocks=4096)
    rr, _ = run_virtual_policy("round-robin", spec, reqs, QUIET, log=_log)
    assert rr.succeeded == rr.requests_sent  # no admission there: everything served, late
    # The defaults read the knee from the prefill queue; with the memory term on
    # (kv_wait_weight 1, off by default: filters/picker.py) the 65k-token cache's turnover
    # counts too, and the gate holds new tasks sooner.
    for weight, ttft_vs_rr in ((0.0, 1.0), (1.0, 0.5)):
        mine, run = run_virtual_policy(
            "meshd",
            spec,
            reqs,
            QUIET,
            log=_log,
            overrides={"picker_config": {"kv_wait_weight": weight}},
        )
        assert run is not None
        refused = [o for o in run.outcomes if o.status == 429]
        assert refused, "the pool was never past its knee"
        assert all("knee_wait_s" in o.detail for o in refused)
        assert all(o.step == 0 for o in refused)  # new tasks only
        assert mine.succeeded + len(refused) == len(run.outcomes)
        assert mine.ttft.p90 < ttft_vs_rr * rr.ttft.p90


def test_meshd_reads_each_engines_metrics_as_a_live_sidecar_does() -> None:
    # meshd/engine_probe.py on the virtual clock: the picker learns each engine's KV capacity
    # from its /metrics page; an engine that refuses connections gives no page.
    reqs = shared_prefix(groups=2, questions_per_group=8, rate=2.0, max_tokens=8, seed=6)
    fleet = VirtualFleet(engine_specs(FleetSpec(gpus=("H100", "H100"), kv_blocks=256)))
    fleet[1].inject(parse_fault({"kind": "cold_start", "seconds": 600}), 0.0)
    urls = [engine_url(e) for e in fleet]
    sidecar = sidecar_model(urls, "meshd")
    assert sidecar.probe == (2.0, 60.0)  # routing.engine_metrics' interval and backoff
    run = VirtualPass(fleet, sidecar, QUIET).run(reqs)
    assert all(o.ok for o in run.outcomes)
    router = sidecar.router
    up, down = (router._by_url[u] for u in urls)  # type: ignore[attr-defined]
    want = kv_capacity_tokens(fleet[0])
    assert want == 256 * fleet[0].replica.profile.block_size
    assert up.reported is not None and up.reported.kv_capacity_tokens == want
    assert router.picker._cap_known[up.name] == want  # type: ignore[attr-defined]
    assert down.reported is None
    # Off in the config, or a peer's policy: nothing is read.
    off = {"routing": {"engine_metrics": {"enabled": False}}}
    assert sidecar_model(urls, "meshd", overrides=off).probe is None
    assert sidecar_model(urls, "round-robin").probe is None


@pytest.mark.parametrize("usage", ["full", "tokens", "none"])
def test_what_the_answers_tell_the_sidecar(usage: str) -> None:
    # "full": cached tokens per answer (the index learns from them); "tokens": usage without
    # them (a vLLM without --enable-prompt-tokens-details); "none": no usage at all (a
    # client that did not ask). In every mode the probe checks the index against the
    # engines' prefix-cache counters.
    reqs = shared_prefix(groups=2, questions_per_group=40, rate=8.0, max_tokens=8, seed=6)
    fleet = VirtualFleet(engine_specs(FleetSpec(gpus=("H100", "H100"), kv_blocks=256)))
    sidecar = sidecar_model([engine_url(e) for e in fleet], "meshd", overrides={"usage": usage})
    assert sidecar.usage == usage
    run = VirtualPass(fleet, sidecar, QUIET).run(reqs)
    assert all(o.ok for o in run.outcomes)
    picker = sidecar.router.picker  # type: ignore[attr-defined]
    assert bool(picker._cached_answers) == (usage == "full")
    assert picker.hit_error  # a verdict on at least one engine
    with pytest.raises(ValueError, match="usage must be one of"):
        sidecar_model([engine_url(e) for e in fleet], "meshd", overrides={"usage": "some"})
