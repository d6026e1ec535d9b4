"""Model fallback measured (issue #24, "move"): one pool's engines killed mid-run, with and
without the fallback chain (meshd/fallback.py, `pools[].fallbacks`).

    python -m loadtest.fallback_bench [--requests 300] [--rate 10] [--out DIR]

Fleet: two pools of simulated engines (loadtest/engine) in one child process: `big`
(`--big` H100s serving model-a) and `small` (`--small` A100s serving model-b; an engine
answers 404 to a model it does not serve, so a request that reaches `small` unrewritten
fails). A real meshd sidecar routes model-a to `big`; with the chain, `big` has
`fallbacks: [{pool: small, model: model-b}]`, without it none. Each pass on a fresh fleet
and sidecar.

Workload: `--requests` rows of Azure's conversation trace (../shared/data/traces; prompt
and output lengths x `--token-scale`, unique prompts), sent as streamed completions of
model-a (`ignore_eos`, `include_usage`) at Poisson arrivals of `--rate` per second (seeded):
a steady stream the fleet serves. At `--kill-at` of the arrival window every `big` engine
dies as a pod does: the simulator's restart fault with a cold start longer than the run,
mode refuse (POST /admin/fault): streams in flight are reset, new connections refused.

Measured: success rate (a streamed answer ending in [DONE]) over all requests and over
those sent after the kill; TTFT p50/p99 of the successful ones (the client's clock, from
the planned send time); $ per successful task through the cost ledger from the sidecar's
access log (as `meshd cost`: elastic view, busy GPU-seconds at each GPU's price, a request
is a task); the fallbacks and their reasons (access log `fallback_from`/`fallback_reason`,
and meshd_fallbacks_total from the sidecar's /metrics); amplification: upstream attempts
(the access log's, connection refusals included) per client request, and those that
reached an engine. Ratios are with chain / without, measured in the same run.

Writes results.json, requests.jsonl and fallback.png (each pass's share of requests that
succeeded by send time, beside each successful request's TTFT) into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench.fleet import EngineInfo
from loadtest.bench.policies import start_sidecar_process
from loadtest.cache_bench import (
    Outcome,
    Send,
    admin_metrics,
    bench_sidecar_config,
    endpoint_entry,
    fmt,
    ledger_of,
    ms,
    percentile,
    ratio,
    read_records,
    render_table,
    run_loop,
    send_all,
    start_engines,
    usd,
    write_outputs,
)
from loadtest.engine.config import EngineSpec
from loadtest.workloads import AZURE_CONV, PlannedRequest, read_azure, traces_dir
from meshd.access_log import AccessRecord

__all__ = ["FallbackBenchSettings", "main", "run_bench"]

MODEL_A = "model-a"
MODEL_B = "model-b"
# The restart fault with a cold start longer than any run: a dead pod (resets, refusals).
KILL = {"kind": "restart", "cold_start_seconds": 1e9, "mode": "refuse"}


@dataclass(frozen=True, slots=True)
class FallbackBenchSettings:
    requests: int = 300
    rate: float = 10.0
    kill_at: float = 0.5
    token_scale: float = 0.1
    big: int = 3
    big_gpu: str = "H100"
    small: int = 2
    small_gpu: str = "A100"
    engine_time_scale: float = 1.0
    concurrency: int = 128
    timeout_s: float = 60.0
    seed: int = 0
    traces: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.requests < 2 or self.big < 1 or self.small < 1:
            raise ValueError("need requests >= 2 and at least one engine per pool")
        if not 0 < self.kill_at < 1:
            raise ValueError(f"kill_at must be in (0, 1), got {self.kill_at}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")


def build_workload(s: FallbackBenchSettings) -> list[PlannedRequest]:
    """Azure conversation rows with Poisson arrivals at s.rate."""
    rows = read_azure(traces_dir(s.traces) / AZURE_CONV, cap=s.requests, token_scale=s.token_scale)
    rng = random.Random(s.seed)
    t = 0.0
    out = []
    for r in rows:
        out.append(replace(r, at_s=t))
        t += rng.expovariate(s.rate)
    return out


def body_of(r: PlannedRequest) -> bytes:
    body = {
        "model": MODEL_A,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def pools_config(
    big: Sequence[EngineInfo], small: Sequence[EngineInfo], chain: bool
) -> list[dict[str, object]]:
    big_pool: dict[str, object] = {
        "name": "big",
        "models": [MODEL_A],
        "endpoints": [endpoint_entry(e) for e in big],
    }
    if chain:
        big_pool["fallbacks"] = [{"pool": "small", "model": MODEL_B}]
    small_pool: dict[str, object] = {
        "name": "small",
        "models": [MODEL_B],
        "endpoints": [endpoint_entry(e) for e in small],
    }
    return [big_pool, small_pool]


def fallback_metrics(text: str) -> dict[str, float]:
    """meshd_fallbacks_total by `reason` (from=big), from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshd_fallbacks_total":
                reason = sample.labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


@dataclass(slots=True)
class PassResult:
    name: str
    outcomes: list[Outcome]
    records: list[AccessRecord]
    kill_at_s: float
    wall_s: float
    metrics_fallbacks: dict[str, float]

    def figures(self) -> dict[str, Any]:
        n = len(self.outcomes)
        ok = [o for o in self.outcomes if o.ok]
        after = [o for o in self.outcomes if o.sent_at_s >= self.kill_at_s]
        before = [o for o in self.outcomes if o.sent_at_s < self.kill_at_s]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        summary = ledger_of(self.records)
        attempts = reached = 0
        for r in self.records:
            tries = r.attempts
            if tries:
                attempts += len(tries)
                reached += sum(1 for a in tries if a.outcome != "connect_error")
            elif r.endpoint is not None:
                attempts += 1
                reached += 1
        fallbacks = Counter(r.fallback_reason or "?" for r in self.records if r.fallback_from)
        served = Counter(r.pool or "-" for r in self.records if r.outcome == "ok")
        errors = Counter((o.error or "").split(":")[0] for o in self.outcomes if not o.ok)
        outcomes = Counter(r.outcome for r in self.records if r.outcome != "ok")
        return {
            "requests": n,
            "ok": len(ok),
            "success_rate": len(ok) / n if n else 0.0,
            "success_rate_before_kill": _rate(before),
            "success_rate_after_kill": _rate(after),
            "sent_after_kill": len(after),
            "client_errors": dict(errors),
            "failed_outcomes": dict(outcomes),
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99),
            "e2e_p50_s": percentile([o.e2e_s for o in ok], 0.5),
            "cost_usd": summary.total.cost_usd,
            "gpu_seconds": summary.total.gpu_seconds,
            "tasks_ok": summary.total.tasks_succeeded,
            "usd_per_ok_task": summary.total.cost_per_successful_task,
            "waste_usd": summary.total.waste.total,
            "served_by_pool": dict(served),
            "fallbacks": sum(fallbacks.values()),
            "fallback_reasons": dict(fallbacks),
            "metrics_fallbacks": self.metrics_fallbacks,
            "upstream_attempts": attempts,
            "reached_engines": reached,
            "amplification": attempts / n if n else 0.0,
            "engine_amplification": reached / n if n else 0.0,
            "logged": len(self.records),
            "wall_s": self.wall_s,
        }


def _rate(outcomes: Sequence[Outcome]) -> float | None:
    return sum(o.ok for o in outcomes) / len(outcomes) if outcomes else None


async def _kill(urls: Sequence[str]) -> None:
    async with aiohttp.ClientSession() as http:

        async def one(url: str) -> None:
            async with http.post(url + "/admin/fault", json=KILL) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url} refused the kill: HTTP {resp.status}")

        await asyncio.gather(*(one(u) for u in urls))


async def run_pass(
    name: str,
    s: FallbackBenchSettings,
    workload: Sequence[PlannedRequest],
    workdir: Path,
    chain: bool,
) -> PassResult:
    workdir.mkdir(parents=True, exist_ok=True)
    big = [
        EngineSpec(gpu=s.big_gpu, model=MODEL_A, time_scale=s.engine_time_scale, seed=s.seed,
                   name=f"big-{s.big_gpu.lower()}-{i}")
        for i in range(s.big)
    ]  # fmt: skip
    small = [
        EngineSpec(gpu=s.small_gpu, model=MODEL_B, time_scale=s.engine_time_scale, seed=s.seed,
                   name=f"small-{s.small_gpu.lower()}-{i}")
        for i in range(s.small)
    ]  # fmt: skip
    fleet = await start_engines(big + small, workdir / "engines.log")
    access = workdir / "access.jsonl"
    access.unlink(missing_ok=True)
    kill_at = workload[-1].at_s * s.kill_at
    try:
        bigs, smalls = fleet.engines[: s.big], fleet.engines[s.big :]
        config = bench_sidecar_config(pools_config(bigs, smalls, chain), access)
        router = await start_sidecar_process(config, workdir)
        try:
            sends = [
                Send(i, f"{name}-{i}", r.at_s, "/v1/completions", body_of(r))
                for i, r in enumerate(workload)
            ]
            outcomes, wall = await send_all(
                router.url,
                sends,
                concurrency=s.concurrency,
                timeout_s=s.timeout_s,
                keep_headers=("x-meshd-fallback",),
                timed=[(kill_at, lambda: _kill([e.url for e in bigs]))],
                progress=name if s.progress else None,
            )
            metrics = fallback_metrics(await admin_metrics(router))
        finally:
            await router.stop()
    finally:
        await fleet.stop()
    return PassResult(name, outcomes, read_records(access), kill_at, wall, metrics)


def report_table(without: Mapping[str, Any], chain: Mapping[str, Any]) -> str:
    def r(key: str, spec: str = "{:.3f}x") -> str:
        return fmt(ratio(chain[key], without[key]), spec)

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1%}"

    def reasons(f: Mapping[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(f["fallback_reasons"].items())) or "-"

    rows = [
        ["success rate", pct(without["success_rate"]), pct(chain["success_rate"]),
         r("success_rate")],
        ["  sent before the kill", pct(without["success_rate_before_kill"]),
         pct(chain["success_rate_before_kill"]), r("success_rate_before_kill")],
        ["  sent after the kill", pct(without["success_rate_after_kill"]),
         pct(chain["success_rate_after_kill"]), r("success_rate_after_kill")],
        ["requests ok", f"{without['ok']}/{without['requests']}",
         f"{chain['ok']}/{chain['requests']}", r("ok")],
        ["TTFT p50", ms(without["ttft_p50_s"]), ms(chain["ttft_p50_s"]), r("ttft_p50_s")],
        ["TTFT p99", ms(without["ttft_p99_s"]), ms(chain["ttft_p99_s"]), r("ttft_p99_s")],
        ["$ per successful task", usd(without["usd_per_ok_task"]),
         usd(chain["usd_per_ok_task"]), r("usd_per_ok_task")],
        ["cost (all requests)", usd(without["cost_usd"]), usd(chain["cost_usd"]), r("cost_usd")],
        ["fallbacks (access log)", str(without["fallbacks"]), str(chain["fallbacks"]), "-"],
        ["  reasons", reasons(without), reasons(chain), "-"],
        ["meshd_fallbacks_total", fmt(sum(without["metrics_fallbacks"].values()), "{:.0f}"),
         fmt(sum(chain["metrics_fallbacks"].values()), "{:.0f}"), "-"],
        ["served by pool", _pools(without), _pools(chain), "-"],
        ["attempts / request", fmt(without["amplification"]), fmt(chain["amplification"]),
         r("amplification")],
        ["  reaching an engine", fmt(without["engine_amplification"]),
         fmt(chain["engine_amplification"]), r("engine_amplification")],
    ]  # fmt: skip
    return render_table(("", "no chain", "chain", "chain/no chain"), rows)


def _pools(f: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(f["served_by_pool"].items())) or "-"


def write_plot(path: Path, passes: Mapping[str, PassResult]) -> None:
    """Left: the share of requests that succeeded per time bin, by send time, each pass.
    Right: each successful request's TTFT by send time, moved ones marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    kill = 0.0
    for name, p in passes.items():
        kill = p.kill_at_s
        span = max((o.sent_at_s for o in p.outcomes), default=0.0)
        width = max(0.5, span / 30)
        bins = int(span / width) + 1
        sent, ok = [0] * bins, [0] * bins
        for o in p.outcomes:
            b = int(o.sent_at_s / width)
            sent[b] += 1
            ok[b] += o.ok
        xs = [i * width for i in range(bins) if sent[i]]
        ys = [ok[i] / sent[i] for i in range(bins) if sent[i]]
        left.step(xs, ys, where="post", label=name)
        for moved, marker in ((False, "."), (True, "x")):
            pts = [
                (o.sent_at_s, o.ttft_s * 1000)
                for o in p.outcomes
                if o.ok and o.ttft_s is not None and ("x-meshd-fallback" in o.headers) == moved
            ]
            if pts:
                right.scatter(*zip(*pts, strict=True), s=12, marker=marker,
                              label=f"{name}{', fallback' if moved else ''}")  # fmt: skip
    for ax in (left, right):
        ax.axvline(kill, color="red", linestyle="--", label="big pool killed")
        ax.set_xlabel("send time (s)")
        ax.legend(fontsize="small")
    left.set_ylabel("share of requests that succeeded")
    left.set_ylim(-0.05, 1.05)
    left.set_title("Success by send time")
    right.set_ylabel("TTFT (ms)")
    right.set_yscale("log")
    right.set_title("TTFT of the successful requests")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def header_lines(s: FallbackBenchSettings, workload: Sequence[PlannedRequest]) -> list[str]:
    span = workload[-1].at_s
    return [
        "fallback bench (issue #24): meshd sidecar, big pool killed mid-run, "
        "with vs without the fallback chain",
        f"fleet: big = {s.big} x simulated {s.big_gpu} serving {MODEL_A}, small = {s.small} x "
        f"simulated {s.small_gpu} serving {MODEL_B}; engine time scale {s.engine_time_scale:g}; "
        f"chain: big -> small with the model rewritten to {MODEL_B}",
        f"workload: {len(workload)} rows of {AZURE_CONV} (token scale {s.token_scale:g}, "
        f"unique prompts), Poisson arrivals at {s.rate:g}/s over {span:.1f} s (seed {s.seed}); "
        f"streamed completions of {MODEL_A}, ignore_eos, include_usage",
        f"fault: at {span * s.kill_at:.1f} s every big engine dies (restart fault, cold start "
        "longer than the run, mode refuse: streams reset, connections refused); each pass on "
        "a fresh fleet and sidecar",
    ]


async def run_bench(s: FallbackBenchSettings, out: Path) -> dict[str, Any]:
    workload = build_workload(s)
    for line in header_lines(s, workload):
        print(line, flush=True)
    t0 = time.monotonic()
    without = await run_pass("no-chain", s, workload, out / "no-chain", chain=False)
    chain = await run_pass("chain", s, workload, out / "chain", chain=True)
    f_without, f_chain = without.figures(), chain.figures()
    print()
    print(report_table(f_without, f_chain))
    for name, f in (("no chain", f_without), ("chain", f_chain)):
        if f["failed_outcomes"]:
            failed = dict(sorted(f["failed_outcomes"].items()))
            print(f"failed, {name} (access log outcomes): {failed}")
    doc = {
        "bench": "fallback_bench",
        "settings": asdict(s),
        "kill_at_s": chain.kill_at_s,
        "passes": {"no_chain": f_without, "chain": f_chain},
        "ratios": {
            k: ratio(f_chain[k], f_without[k])
            for k in (
                "success_rate",
                "success_rate_after_kill",
                "ttft_p50_s",
                "ttft_p99_s",
                "usd_per_ok_task",
                "amplification",
            )
        },
        "wall_s": time.monotonic() - t0,
    }
    rows = [("pass", p.name, o) for p in (without, chain) for o in p.outcomes]
    write_outputs(
        out,
        doc,
        rows,
        "fallback.png",
        lambda path: write_plot(path, {"no chain": without, "chain": chain}),
    )
    return doc


def parse_args(argv: Sequence[str] | None) -> tuple[FallbackBenchSettings, argparse.Namespace]:
    d = FallbackBenchSettings()
    p = argparse.ArgumentParser(
        prog="python -m loadtest.fallback_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=d.requests, help=f"default {d.requests}")
    p.add_argument("--rate", type=float, default=d.rate, help=f"requests/s (default {d.rate:g})")
    p.add_argument(
        "--kill-at",
        type=float,
        default=d.kill_at,
        help=f"share of the arrival window when big dies (default {d.kill_at:g})",
    )
    p.add_argument(
        "--token-scale",
        type=float,
        default=d.token_scale,
        help=f"prompt and output lengths x this (default {d.token_scale:g})",
    )
    p.add_argument("--big", type=int, default=d.big, help=f"big engines (default {d.big})")
    p.add_argument("--big-gpu", default=d.big_gpu, help=f"default {d.big_gpu}")
    p.add_argument("--small", type=int, default=d.small, help=f"small engines (default {d.small})")
    p.add_argument("--small-gpu", default=d.small_gpu, help=f"default {d.small_gpu}")
    p.add_argument(
        "--engine-time-scale",
        type=float,
        default=d.engine_time_scale,
        help="simulated seconds per wall second (default 1: a real GPU's speed)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help=f"client requests in flight at most (default {d.concurrency})",
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per request, s")
    p.add_argument("--seed", type=int, default=d.seed, help="arrivals and engines")
    p.add_argument("--traces", default=None, help="traces dir (default ../shared/data/traces)")
    p.add_argument("--out", type=Path, default=None, help="default results/fallback-bench-<time>")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        s = FallbackBenchSettings(
            requests=args.requests,
            rate=args.rate,
            kill_at=args.kill_at,
            token_scale=args.token_scale,
            big=args.big,
            big_gpu=args.big_gpu.upper(),
            small=args.small,
            small_gpu=args.small_gpu.upper(),
            engine_time_scale=args.engine_time_scale,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            seed=args.seed,
            traces=args.traces,
            progress=not args.no_progress,
        )
    except ValueError as exc:
        p.error(str(exc))
    return s, args


def main(argv: Sequence[str] | None = None) -> int:
    s, args = parse_args(argv)
    out = args.out or Path("results") / time.strftime("fallback-bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    run_loop(run_bench(s, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
