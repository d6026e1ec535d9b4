"""The bench's TTFT floor (loadtest/bench/floor.py): a request's first token on an idle
engine of the fleet's fastest GPU holding every earlier prompt's blocks, by hand from the
GPU profile; and how the report prints it beside the TTFT target."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import bench_builders
import pytest
from bench_builders import outcome

from loadtest.bench.fleet import FleetSpec, engine_specs, fleet_gpus
from loadtest.bench.floor import TtftFloor, fastest_specs, ttft_floor
from loadtest.bench.report import BenchReport, comparison_table, targets, write_report
from loadtest.bench.results import Distribution, PolicyResult, TaskCounts
from loadtest.bench.runner import build_workload
from loadtest.engine.config import EngineSpec
from loadtest.engine.profiles import EngineProfile, get_profile
from loadtest.engine.tokenizer import load_tokenizer
from loadtest.workloads import WORKLOADS, PlannedRequest, traces_dir
from loadtest.workloads.traces import AZURE_CODE, AZURE_CONV, MOONCAKE_SYNTHETIC

H100 = get_profile("H100")
BS = H100.block_size
TRACE_FILES = {"mooncake": MOONCAKE_SYNTHETIC, "azure-code": AZURE_CODE, "azure-conv": AZURE_CONV}


def words(start: int, n: int) -> str:
    """n distinct one-token words (the simulator's word tokenizer: one piece a word)."""
    return " ".join(f"w{i}" for i in range(start, start + n))


def completion(rid: str, prompt: str, max_tokens: int = 8) -> PlannedRequest:
    return PlannedRequest(
        request_id=rid,
        workload="w",
        at_s=0.0,
        kind="completion",
        prompt=prompt,
        messages=None,
        max_tokens=max_tokens,
        prompt_tokens=len(prompt.split()),
    )


def step(p: EngineProfile, tokens: int, cached: int) -> float:
    """One prefill step of `tokens` new tokens after `cached` ones, from the profile's
    formula (profiles.py's module docstring), one sequence in the batch."""
    compute = (
        tokens / p.prefill_tokens_per_s
        + (tokens * cached + tokens * (tokens + 1) / 2) * p.attn_s_per_pair
    )
    memory = p.weight_read_s + (cached + tokens) * p.kv_read_s_per_token
    return p.step_overhead_s + p.per_seq_overhead_s + max(compute, memory)


def test_the_prompts_are_one_token_a_word() -> None:
    assert len(load_tokenizer(None).encode(words(0, 2000))) == 2000


def test_a_lone_request_takes_one_prefill_step_of_the_fastest_gpu() -> None:
    fleet = FleetSpec(gpus=fleet_gpus(4, ["H100", "A100"]))
    floor = ttft_floor([completion("a", words(0, 2000))], fleet)
    assert floor is not None and floor.gpu == "H100"
    assert floor.per_request["a"] == pytest.approx(step(H100, 2000, 0), rel=1e-12)
    # Compute bound: 2,000 tokens at ~27.7k tokens/s, ~72 ms.
    assert 0.06 < floor.per_request["a"] < 0.09
    a100 = ttft_floor([completion("a", words(0, 2000))], FleetSpec(gpus=("A100",)))
    assert a100 is not None and a100.gpu == "A100"
    assert a100.per_request["a"] > 2.5 * floor.per_request["a"]


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    fleet = FleetSpec(gpus=("H100",), extra={"max_num_batched_tokens": 512})
    floor = ttft_floor([completion("a", words(0, 1200))], fleet)
    assert floor is not None
    by_hand = step(H100, 512, 0) + step(H100, 512, 512) + step(H100, 176, 1024)
    assert floor.per_request["a"] == pytest.approx(by_hand, rel=1e-12)


def test_a_repeated_prompt_drops_by_its_cached_blocks() -> None:
    prompt = words(0, 2000)
    shared = words(0, 1600) + " " + words(5000, 400)
    plan = [completion("a", prompt), completion("b", prompt), completion("c", shared)]
    floor = ttft_floor(plan, FleetSpec(gpus=("H100",)))
    assert floor is not None
    f = floor.per_request
    # b: every full block but the last token's is cached, 1,984 tokens; 16 are computed.
    cached = (2000 - 1) // BS * BS
    assert f["b"] == pytest.approx(step(H100, 2000 - cached, cached), rel=1e-12)
    # c: a's first 1,600 tokens (100 blocks) are cached, its own 400 are not.
    assert f["c"] == pytest.approx(step(H100, 400, 1600), rel=1e-12)
    assert f["b"] < f["c"] < f["a"]
    # In a fleet's order alone: b without a before it is a cold prompt.
    cold = ttft_floor([plan[1]], FleetSpec(gpus=("H100",)))
    assert cold is not None and cold.per_request["b"] == pytest.approx(f["a"], rel=1e-12)


def test_a_refused_request_has_no_floor_and_caches_nothing() -> None:
    too_long = completion("x", words(0, 9000))  # over max_model_len 8192
    plan = [too_long, completion("y", words(0, 2000))]
    floor = ttft_floor(plan, FleetSpec(gpus=("H100",)))
    assert floor is not None
    assert floor.unserved == ("x",)
    assert floor.per_request["y"] == pytest.approx(step(H100, 2000, 0), rel=1e-12)


def test_the_floor_is_in_client_seconds_and_absent_for_stub_fleets() -> None:
    plan = [completion("a", words(0, 2000))]
    fast = ttft_floor(plan, FleetSpec(gpus=("H100",), time_scale=10.0))
    assert fast is not None
    assert fast.per_request["a"] == pytest.approx(step(H100, 2000, 0) / 10, rel=1e-12)
    virtual = ttft_floor(plan, FleetSpec(gpus=("H100",), time_scale=10.0), time_scale=1.0)
    assert virtual is not None
    assert virtual.per_request["a"] == pytest.approx(step(H100, 2000, 0), rel=1e-12)
    assert ttft_floor(plan, FleetSpec(gpus=("H100",), kind="stub")) is None


def test_the_fastest_gpu_is_the_one_no_other_beats() -> None:
    def fastest(gpus: tuple[str, ...], **kw: Any) -> list[str]:
        return [s.gpu for s in fastest_specs(engine_specs(FleetSpec(gpus=gpus, **kw)))]

    assert fastest(fleet_gpus(16, ["H100", "A100"])) == ["H100"]
    assert fastest(("A100", "H100", "H200")) == ["H200"]
    assert fastest(("H100", "B200", "H200")) == ["B200"]
    assert fastest(("A100", "A100")) == ["A100"]
    # A token budget on the faster GPU that is no multiple of the other's: its chunks are
    # no merger of the other's, so both run (each request takes the faster).
    specs = [EngineSpec(gpu="H100", max_num_batched_tokens=3000), EngineSpec(gpu="A100")]
    assert [s.gpu for s in fastest_specs(specs)] == ["H100", "A100"]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_has_a_floor_cheaply(name: str) -> None:
    args: dict[str, Any] = {"cap": 300} if name in TRACE_FILES else {}
    if name in TRACE_FILES and not (traces_dir() / TRACE_FILES[name]).exists():
        pytest.skip(f"no {TRACE_FILES[name]} in {traces_dir()}")
    plan = build_workload(name, args)
    t0 = time.perf_counter()
    floor = ttft_floor(plan, FleetSpec(gpus=fleet_gpus(16, ["H100", "A100"])))
    assert time.perf_counter() - t0 < 10.0
    assert floor is not None and floor.gpu == "H100"
    assert floor.ttft.n + len(floor.unserved) == len(plan)
    # Nothing is faster than an idle H100's one-step floor for a one-block prompt.
    assert floor.ttft.n > 0 and floor.ttft.p50 >= step(H100, 1, 0) - 1e-12


# ---- the report ---------------------------------------------------------------------


def result(name: str, p90: float, ids: list[str]) -> PolicyResult:
    """Every request of `ids` served with its first token after `p90`."""
    n = len(ids)
    return bench_builders.result(
        name,
        requests_sent=n,
        succeeded=n,
        ttft=Distribution(n, p90, p90, p90, p90, p90),
        tasks=TaskCounts(n, n, 0, 0),
        outcomes=tuple(outcome(r, p90) for r in ids),
    )


def report(*results: PolicyResult, floor: TtftFloor | None) -> BenchReport:
    return bench_builders.report(
        *results, hit_bounds={r.policy: 0.6 for r in results}, ttft_floor=floor
    )


IDS = [f"r{i}" for i in range(10)]
# Floors of 10, 20, ... 100 ms: p90 over all ten is 91 ms (linear interpolation).
FLOOR = TtftFloor("H100", {r: (i + 1) / 100 for i, r in enumerate(IDS)}, ("r10",), 1.25)


def test_the_report_prints_the_floor_and_says_when_no_router_can_meet_the_target(
    tmp_path: Path,
) -> None:
    peer = result("sglang-router", 0.155, IDS)
    meshd = result("meshd", 0.120, IDS)
    r = report(result("round-robin", 0.300, IDS), peer, meshd, floor=FLOOR)
    text = comparison_table(r)
    assert (
        "TTFT floor (H100: idle engine of the fastest GPU, one infinite cache holding every "
        "earlier prompt's blocks, no queue, no network; 10 requests, 1 the engines refuse, "
        "computed in 1.2 s): p50 / p90 / p99 = 55.0 / 91.0 / 99.1 ms" in text
    )
    # 91 / 155 = 0.587: even the floor misses <= 0.50 against this peer.
    assert (
        "- meshd: TTFT p90 / peer = 0.77 (goal <= 0.50): MISSED; floor p90 / peer = 0.59: "
        "no router can meet <= 0.50 here" in text
    )
    assert "| TTFT p90 / floor |" in text
    assert "| meshd | 50.0% / 60.0% = 0.83 | 0.77 | 1.00 | 1.00 | 1.00 | 1.32 |" in text
    (ttft,) = [t for t in targets(r) if t.name == "TTFT p90 / peer"]
    assert ttft.floor_ratio == pytest.approx(0.091 / 0.155)
    assert ttft.reachable is False
    write_report(r, tmp_path, plots=False)
    doc = json.loads((tmp_path / "results.json").read_text())
    floor = doc["ttft_floor"]
    assert floor["gpu"] == "H100" and floor["requests"] == 10 and floor["unserved"] == 1
    assert floor["ttft_s"]["p90"] == pytest.approx(0.091)
    assert floor["floor_p90_over_peer_p90"] == pytest.approx(0.091 / 0.155)
    assert floor["policies"]["meshd"]["ttft_p90_over_floor_p90"] == pytest.approx(0.12 / 0.091)
    target = next(t for t in doc["targets"] if t["target"] == "TTFT p90 / peer")
    assert target["floor_ratio"] == pytest.approx(0.091 / 0.155)
    assert target["reachable"] is False
    md = (tmp_path / "report.md").read_text()
    assert "TTFT floor p50 / p90 / p99 ms (H100, no queue, one infinite cache) | 55.0 / 91.0" in md


def test_the_floor_is_taken_over_the_requests_a_policy_served() -> None:
    # The peer served only the five fastest-floored requests: p90 of 10..50 ms is 46 ms.
    peer = result("sglang-router", 0.200, IDS[:5])
    text = comparison_table(report(peer, result("meshd", 0.08, IDS), floor=FLOOR))
    assert "floor p90 / peer = 0.23\n" in text + "\n"
    assert "no router can" not in text


def test_without_a_peer_the_report_says_what_the_target_needs() -> None:
    text = comparison_table(report(result("meshd", 0.08, IDS), floor=FLOOR))
    assert (
        "- meshd: TTFT p90 / peer = n/a (goal <= 0.50): n/a; floor p90 = 91.0 ms: <= 0.50 "
        "needs a peer p90 of at least 182 ms" in text
    )


def test_without_a_floor_the_report_is_as_before(tmp_path: Path) -> None:
    r = report(result("sglang-router", 0.2, IDS), result("meshd", 0.08, IDS), floor=None)
    text = comparison_table(r)
    assert "floor" not in text
    write_report(r, tmp_path, plots=False)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["ttft_floor"] is None
    assert "floor_ratio" not in next(t for t in doc["targets"] if t["target"].startswith("TTFT"))


def test_the_virtual_bench_reports_the_floor(tmp_path: Path) -> None:
    from loadtest.bench.client import ClientSettings
    from loadtest.bench.runner import BenchConfig
    from loadtest.bench.virtual import run_virtual_bench

    plan = [completion(f"q{i}", words(0, 600) + " " + words(1000 + 50 * i, 50)) for i in range(6)]
    plan = [replace(p, at_s=0.5 * i) for i, p in enumerate(plan)]
    config = BenchConfig(
        fleet=FleetSpec(gpus=("H100", "A100")),
        policies=("round-robin", "meshd"),
        client=ClientSettings(progress=False),
        out_dir=tmp_path,
        plots=False,
    )
    rep, _ = run_virtual_bench(config, plan, log=lambda _: None)
    floor = rep.ttft_floor
    assert floor is not None and floor.ttft.n == 6
    # The first question is cold; the rest find the shared 600 tokens cached.
    assert floor.per_request["q0"] > 3 * floor.per_request["q1"]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["ttft_floor"]["requests"] == 6
    # Spaced 0.5 s apart on idle engines, a policy can't beat the floor, only meet it.
    for r in rep.ran:
        assert r.ttft.p50 >= floor.over(o.request_id for o in r.outcomes).p50 - 1e-9
