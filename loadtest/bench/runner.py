"""The benchmark runner: every policy in turn, each on a fresh fleet, the same workload.

One pass = start the fleet (cold caches), start the router under test in front of it,
scrape the engines, send the workload through the router, scrape again, stop both. The
run ends with results.json, requests.jsonl and report.md (plus plots) in the output dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench.client import DEFAULT_MODEL, ClientSettings, LoadClient
from loadtest.bench.fleet import FleetProcess, FleetSpec, start_fleet
from loadtest.bench.floor import ttft_floor
from loadtest.bench.policies import (
    BASELINE_POLICY,
    DEFAULT_POLICIES,
    FleetPolicySpec,
    PolicySpec,
    resolve_policies,
)
from loadtest.bench.report import BenchReport, write_report
from loadtest.bench.results import PolicyResult, engine_results, skipped, summarize
from loadtest.bench.scrape import EngineScraper, busy_seconds, sampling
from loadtest.workloads import WORKLOADS, PlannedRequest, describe, upper_bound_hit_rate

DEFAULT_RESULTS_DIR = Path("results")
SAMPLE_PERIOD_S = 1.0
_STATE_TIMEOUT_S = 5.0

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One `meshd bench` run."""

    fleet: FleetSpec
    workload: str = "demo"
    workload_args: dict[str, Any] = field(default_factory=dict)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    client: ClientSettings = field(default_factory=ClientSettings)
    out_dir: Path | None = None
    plots: bool = True
    sample_period_s: float = SAMPLE_PERIOD_S
    baseline: str = BASELINE_POLICY
    title: str = "meshd bench"
    command: str = ""
    notes: tuple[str, ...] = ()


def workload_parameters(name: str) -> tuple[str, ...]:
    """Keyword arguments the named workload accepts."""
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    return tuple(inspect.signature(fn).parameters)


def build_workload(name: str, args: Mapping[str, Any]) -> list[PlannedRequest]:
    """The planned requests of a named workload; an argument it does not take is an error."""
    accepted = workload_parameters(name)
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise ValueError(
            f"workload {name!r} takes no {', '.join(unknown)}; it takes: {', '.join(accepted)}"
        )
    return WORKLOADS[name](**args)


def default_out_dir(base: Path = DEFAULT_RESULTS_DIR) -> Path:
    return base / time.strftime("bench-%Y%m%d-%H%M%S")


async def discover_model(session: aiohttp.ClientSession, url: str) -> str | None:
    """The first model id an engine's /v1/models lists, None if it lists none."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        async with asyncio.timeout(_STATE_TIMEOUT_S):
            async with session.get(url.rstrip("/") + "/v1/models") as resp:
                if resp.status == 200:
                    data = (await resp.json(content_type=None)).get("data") or []
                    if data and isinstance(data[0].get("id"), str):
                        return str(data[0]["id"])
    return None


async def _busy(
    session: aiohttp.ClientSession, url: str, metrics: Mapping[str, float]
) -> float | None:
    """GPU-busy seconds: the simulator's /admin/state busy_time, else a busy counter."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with asyncio.timeout(_STATE_TIMEOUT_S):
            async with session.get(url.rstrip("/") + "/admin/state") as resp:
                if resp.status == 200:
                    value = (await resp.json(content_type=None)).get("busy_time")
                    if isinstance(value, int | float):
                        return float(value)
    return busy_seconds(metrics)


async def run_policy(
    spec: PolicySpec,
    fleet_spec: FleetSpec,
    requests: Sequence[PlannedRequest],
    settings: ClientSettings,
    workdir: Path,
    *,
    sample_period_s: float = SAMPLE_PERIOD_S,
    log: Log = _stderr,
) -> PolicyResult:
    """One pass of one policy on a fresh fleet; a start-up failure is a "failed" result."""
    reason = spec.unavailable()
    if reason is not None:
        log(f"{spec.name}: skipped: {reason}")
        return skipped(spec.name, spec.summary, reason)
    fleet: FleetProcess | None = None
    router = None
    try:
        log(f"{spec.name}: starting {len(fleet_spec.gpus)} {fleet_spec.kind} engines")
        fleet = await start_fleet(fleet_spec, workdir / "fleet.log")
        if isinstance(spec, FleetPolicySpec) and spec.start_on_fleet is not None:
            router = await spec.start_on_fleet(fleet.engines, workdir)
        else:
            router = await spec.start(fleet.urls, workdir)
        log(f"{spec.name}: {spec.summary} at {router.url}")
        return await _measure(
            spec, fleet, router.url, requests, settings, sample_period_s, fleet_spec.time_scale
        )
    except (RuntimeError, OSError, ValueError, aiohttp.ClientError) as exc:
        log(f"{spec.name}: failed: {exc}")
        return skipped(spec.name, spec.summary, str(exc).splitlines()[0], status="failed")
    finally:
        if router is not None:
            await router.stop()
        if fleet is not None:
            await fleet.stop()


async def _measure(
    spec: PolicySpec,
    fleet: FleetProcess,
    router_url: str,
    requests: Sequence[PlannedRequest],
    settings: ClientSettings,
    sample_period_s: float,
    time_scale: float,
) -> PolicyResult:
    urls = fleet.urls
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        model = await discover_model(session, urls[0])
        if model is not None and settings.model == DEFAULT_MODEL:
            settings = replace(settings, model=model)
        settings = replace(settings, progress_desc=settings.progress_desc or spec.name)
        scraper = EngineScraper(urls, session)
        before = await scraper.snapshot()
        busy_before = await asyncio.gather(
            *(_busy(session, u, m) for u, m in zip(urls, before, strict=True))
        )
        loop = asyncio.get_running_loop()
        async with sampling(scraper, sample_period_s, loop.time()):
            run = await LoadClient(router_url, settings).run(requests)
        after = await scraper.snapshot()
        busy_after = await asyncio.gather(
            *(_busy(session, u, m) for u, m in zip(urls, after, strict=True))
        )
    engines, basis = engine_results(
        [(e.name, e.url, e.gpu, e.price_per_gpu_hour) for e in fleet.engines],
        before,
        after,
        busy_before,
        busy_after,
        # Busy seconds are simulated seconds; provisioned time must be too.
        provisioned_s=run.wall_s * time_scale,
    )
    return summarize(
        spec.name,
        spec.summary,
        requests,
        run.outcomes,
        len(run.not_sent),
        run.wall_s,
        engines,
        basis,
        scraper.samples,
    )


def sent_hit_bound(requests: Sequence[PlannedRequest], result: PolicyResult) -> float:
    """The one-infinite-cache hit-rate bound over the requests `result` sent, in plan
    order (a run cut short sends a prefix of the workload, whose bound is its own)."""
    sent = {o.request_id for o in result.outcomes}
    return upper_bound_hit_rate([r for r in requests if r.request_id in sent])


def gpu_summary(gpus: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g] = counts.get(g, 0) + 1
    return ", ".join(f"{n} x {g}" for g, n in counts.items())


async def run_bench(
    config: BenchConfig,
    requests: Sequence[PlannedRequest] | None = None,
    *,
    log: Log = _stderr,
) -> tuple[BenchReport, Path]:
    """Run every policy of `config` on its workload; returns the report and report.md's path."""
    specs = resolve_policies(config.policies)
    if requests is None:
        requests = build_workload(config.workload, config.workload_args)
    out_dir = config.out_dir or default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    names = ", ".join(s.name for s in specs)
    log(f"workload {config.workload}: {len(requests)} requests; policies: {names}")
    results = []
    for spec in specs:
        results.append(
            await run_policy(
                spec,
                config.fleet,
                requests,
                config.client,
                out_dir / "logs" / spec.name,
                sample_period_s=config.sample_period_s,
                log=log,
            )
        )
    floor = ttft_floor(requests, config.fleet)
    if floor is not None:
        log(f"TTFT floor: p90 {floor.ttft.p90 * 1000:.1f} ms, computed in {floor.wall_s:.1f} s")
    n = len(config.fleet.gpus)
    replicas = tuple(sorted({n, 4, 8, 16}))
    fleet_doc = {
        **config.fleet.to_json(),
        "engines": n,
        "gpu_summary": gpu_summary(config.fleet.gpus),
    }
    client_doc = asdict(config.client)
    client_doc.pop("progress", None)
    client_doc.pop("progress_desc", None)
    report = BenchReport(
        title=config.title,
        command=config.command,
        started_at=started,
        workload_name=config.workload,
        workload_args=dict(config.workload_args),
        workload=describe(requests, replicas=replicas),
        fleet=fleet_doc,
        client=client_doc,
        results=tuple(results),
        baseline=config.baseline,
        notes=config.notes,
        hit_bounds={r.policy: sent_hit_bound(requests, r) for r in results if r.ok},
        ttft_floor=floor,
    )
    path = write_report(report, out_dir, plots=config.plots)
    return report, path
