"""The response cache measured (issue #24, "avoid"): a real meshd sidecar in front of
simulated engines, once with `response_cache.enabled: false` and once with it on (memory
store), each on a fresh fleet, on a workload of repeated deterministic requests.

    python -m loadtest.cache_bench [--cap 1000] [--repeat-share 0.3] [--out DIR]

Workload: the Mooncake synthetic trace (../shared/data/traces/synthetic_trace.jsonl,
loadtest/workloads/traces.py): equal hash_ids give identical prompt text, so a row whose
hash_ids, input length and output length equal an earlier row's is the same request asked
again (193 of the trace's 3,993 rows; 213 repeat the prompt alone). Every request is a
streamed completion with `temperature: 0` (cacheable under the pools' default
`deterministic` rule), `ignore_eos` and `stream_options.include_usage`. The first `--cap`
rows, arrivals divided by `--time-scale`, prompt and output lengths times `--token-scale`.
`--repeat-share X` derives a heavier workload: each request after the first, with
probability X, asks again exactly what a uniformly drawn earlier request asked (its prompt
and max_tokens) at its own arrival time; the default is the trace as it is.

Fleet: `--engines` simulated H100s (loadtest/engine), every engine with the same seed, so
that, like replicas of one model answering greedily, the same request gets the same text
on any of them (the simulator's text is a pure function of prompt and seed); their context
window holds the longest request (the trace's 191k-token prompts are 9.6k tokens at 0.05).

Measured: the client (its own, open loop at the arrival times, `--concurrency` in flight
at most) records per request its success, TTFT, E2E and the sha256 of the answer text (the
concatenated text of the stream's events); the sidecar's access log gives the cache's
verdict per request (`response_cache`) and, through the cost ledger (filters/cost_ledger.py,
as `meshd cost` reads it), the GPU-seconds and $ per successful task (elastic view: busy
GPU-seconds at the GPU's price; each request is a task). Wrong answers: request i's text
with the cache on against request i's text with the cache off (the engine's answer for the
same key); must be 0. Ratios are cache / no cache, both measured in the same run.

Writes results.json, requests.jsonl (every request of both passes) and ttft_cdf.png (the TTFT
CDF of both passes) into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from filters.cost_ledger import CostLedger, LedgerSummary
from loadtest.bench.fleet import EngineInfo, FleetProcess, engine_infos, read_ready_line
from loadtest.bench.policies import MESHD_BEST_POLICY, ProcessRouter, start_sidecar_process
from loadtest.bench.stream import StreamMeter
from loadtest.engine.config import EngineSpec, spec_from_dict
from loadtest.procstats import cpu_seconds
from loadtest.workloads import MOONCAKE_SYNTHETIC, PlannedRequest, read_mooncake, traces_dir
from meshd.access_log import AccessRecord, read_access_log

__all__ = [
    "CacheBenchSettings",
    "Outcome",
    "Send",
    "build_workload",
    "main",
    "percentile",
    "run_bench",
    "send_all",
    "start_engines",
]

READY_TIMEOUT_S = 60.0
# Bytes of an error body kept (enough for an OpenAI error message).
_ERROR_BYTES = 512


# ---- the engine fleet child ----------------------------------------------------------
# loadtest.bench.fleet gives each engine seed + i; here each spec is given whole (the
# cache bench needs one seed for all, the fallback bench a model per pool).


async def start_engines(specs: Sequence[EngineSpec], log_path: Path) -> FleetProcess:
    """The engines of `specs` in a child process (`--serve-engines`); ready when it says."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    doc = json.dumps([_spec_json(s) for s in specs])
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loadtest.cache_bench",
            "--serve-engines",
            doc,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
    ready = await read_ready_line(proc, READY_TIMEOUT_S, "the engine fleet", log_path)
    return FleetProcess(proc, tuple(EngineInfo(**e) for e in ready["engines"]), log_path)


def _spec_json(spec: EngineSpec) -> dict[str, Any]:
    out = {k: v for k, v in asdict(spec).items() if k != "faults"}
    out["faults"] = [f.to_json() for f in spec.faults]
    return out


async def _serve_engines(doc: str) -> int:
    import signal

    from loadtest.engine import EngineFleet

    specs = [spec_from_dict(d) for d in json.loads(doc)]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    fleet = EngineFleet(specs)
    await fleet.start()
    infos = engine_infos(fleet)
    print(json.dumps({"event": "ready", "engines": [asdict(i) for i in infos]}), flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    watcher = asyncio.create_task(reader.read())  # stdin closes when the parent dies
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({watcher, waiter}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    waiter.cancel()
    await fleet.stop()
    return 0


def endpoint_entry(e: EngineInfo) -> dict[str, object]:
    """A sidecar pool endpoint for engine `e` (its GPU and KV capacity told)."""
    entry: dict[str, object] = {"url": e.url, "gpu": e.gpu}
    if e.kv_capacity_tokens is not None:
        entry["kv_capacity_tokens"] = e.kv_capacity_tokens
    return entry


def bench_sidecar_config(
    pools: Sequence[Mapping[str, object]], access_log: Path, **sections: object
) -> dict[str, object]:
    """The sidecar of a pass: loopback listeners on port 0, meshd's best routing policy,
    an access log, `pools`, and `sections` as given."""
    return {
        "listeners": {
            "outbound": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
        },
        "pools": [dict(p) for p in pools],
        "routing": {"policy": MESHD_BEST_POLICY},
        "drain": {"grace_period_s": 1},
        "log_level": "warning",
        "telemetry": {"access_log": {"path": str(access_log)}},
        **sections,
    }


async def admin_metrics(router: ProcessRouter) -> str:
    """The sidecar's Prometheus text ("" when it cannot be read)."""
    if router.admin_url is None:
        return ""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
        async with (
            aiohttp.ClientSession() as http,
            asyncio.timeout(5.0),
            http.get(router.admin_url + "/metrics") as resp,
        ):
            return await resp.text()
    return ""


# ---- the client ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """One request to send: at `at_s` after the start, POST `path` with `body`."""

    index: int
    request_id: str
    at_s: float
    path: str
    body: bytes


@dataclass(frozen=True, slots=True)
class Outcome:
    """What came back for one Send. ok: HTTP 200 and a stream that ended with [DONE] and
    carried text, no error event. Times in seconds; sent_at_s from the start."""

    index: int
    request_id: str
    sent_at_s: float
    ok: bool
    status: int
    error: str | None
    ttft_s: float | None
    e2e_s: float
    text_sha256: str | None
    completion_tokens: int
    headers: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def send_all(
    base_url: str,
    sends: Sequence[Send],
    *,
    concurrency: int = 64,
    timeout_s: float = 60.0,
    keep_headers: Sequence[str] = (),
    timed: Sequence[tuple[float, Callable[[], Awaitable[object]]]] = (),
    progress: str | None = None,
) -> tuple[list[Outcome], float]:
    """Send every request at its time (open loop; at most `concurrency` in flight, a
    request over it waits and its latency counts from its planned time), run each `timed`
    action at its time, and return the outcomes in `sends` order and the wall time."""
    bar = _progress(len(sends), progress)
    sem = asyncio.Semaphore(concurrency)
    keep = tuple(h.lower() for h in keep_headers)
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
        auto_decompress=False,
    )
    t0 = time.monotonic()
    results: dict[int, Outcome] = {}

    async def one(s: Send) -> None:
        delay = t0 + s.at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        planned = t0 + s.at_s
        async with sem:
            results[s.index] = await _request(session, base_url, s, planned, t0, timeout_s, keep)
        if bar is not None:
            bar.update(1)

    async def action(at_s: float, act: Callable[[], Awaitable[object]]) -> None:
        delay = t0 + at_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await act()

    try:
        await asyncio.gather(*(one(s) for s in sends), *(action(a, f) for a, f in timed))
    finally:
        await session.close()
        if bar is not None:
            bar.close()
    return [results[s.index] for s in sends], time.monotonic() - t0


async def _request(
    session: aiohttp.ClientSession,
    base_url: str,
    s: Send,
    planned: float,
    t0: float,
    timeout_s: float,
    keep: tuple[str, ...],
) -> Outcome:
    meter = StreamMeter(keep_text=True)
    status, error, headers = 0, None, {}
    headers_out = {"Content-Type": "application/json", "x-request-id": s.request_id}
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(base_url + s.path, data=s.body, headers=headers_out) as resp:
                status = resp.status
                headers = {k: resp.headers[k] for k in keep if k in resp.headers}
                if status != 200:
                    body = await resp.content.read(_ERROR_BYTES)
                    error = f"http_{status}: {body.decode(errors='replace')[:200]}"
                else:
                    async for chunk in resp.content.iter_any():
                        meter.feed(chunk, time.monotonic())
    except TimeoutError:
        error = "timeout"
    except (aiohttp.ClientError, OSError) as exc:
        error = f"connection: {type(exc).__name__}"
    end = time.monotonic()
    summary = meter.summary()
    if error is None:
        if summary.error is not None:
            error = f"sse_error: {summary.error}"
        elif not summary.done:
            error = "truncated"
        elif summary.token_events == 0:
            error = "empty"
    ok = error is None
    return Outcome(
        index=s.index,
        request_id=s.request_id,
        sent_at_s=planned - t0,
        ok=ok,
        status=status,
        error=error,
        ttft_s=None if summary.first_token_at is None else summary.first_token_at - planned,
        e2e_s=end - planned,
        text_sha256=hashlib.sha256(summary.text.encode()).hexdigest() if ok else None,
        completion_tokens=summary.output_tokens,
        headers=headers,
    )


def _progress(total: int, desc: str | None) -> Any:
    if desc is None:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5, leave=False)


# ---- figures ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-quantile (0 < q <= 1); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def ledger_of(records: Sequence[AccessRecord]) -> LedgerSummary:
    """The cost ledger over a pass's access log (each request a task, as `meshd cost`)."""
    ledger = CostLedger()
    for r in sorted(records, key=lambda r: r.ts):
        ledger.record(r)
    ledger.close_all()
    return ledger.summary()


def read_records(path: Path) -> list[AccessRecord]:
    return list(read_access_log(path)) if path.exists() else []


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def fmt(v: float | None, spec: str = "{:.3f}") -> str:
    return "n/a" if v is None else spec.format(v)


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f} ms"


def usd(v: float | None) -> str:
    return "n/a" if v is None else f"${v:.3g}"


# ---- the workload ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheBenchSettings:
    cap: int = 1000
    time_scale: float = 8.0
    token_scale: float = 0.05
    repeat_share: float = 0.0
    seed: int = 0
    engines: int = 4
    gpu: str = "H100"
    engine_time_scale: float = 1.0
    concurrency: int = 64
    timeout_s: float = 60.0
    traces: str | None = None
    progress: bool = True
    cache_first: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.repeat_share < 1.0:
            raise ValueError(f"repeat_share must be in [0, 1), got {self.repeat_share}")
        if self.cap < 1 or self.engines < 1 or self.concurrency < 1:
            raise ValueError("cap, engines and concurrency must be >= 1")


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[PlannedRequest, ...]
    source: str
    span_s: float
    prompt_repeats: int  # requests whose prompt an earlier request had
    body_repeats: int  # ... and max_tokens too: the same cache key, the bound on hits
    derived: int  # requests --repeat-share turned into repeats

    def describe(self) -> str:
        n = len(self.requests)
        return (
            f"{n} requests over {self.span_s:.1f} s ({n / max(self.span_s, 1e-9):.1f}/s); "
            f"{self.body_repeats} ask again what an earlier one asked "
            f"({self.body_repeats / n:.1%}: the bound on the hit rate), "
            f"{self.prompt_repeats} repeat an earlier prompt"
            + (f"; {self.derived} of them made so by --repeat-share" if self.derived else "")
        )


def build_workload(s: CacheBenchSettings) -> Workload:
    """The first `s.cap` Mooncake rows, scaled; with `s.repeat_share`, each request after
    the first asks again, with that probability, what a uniformly drawn earlier one asked."""
    path = traces_dir(s.traces) / MOONCAKE_SYNTHETIC
    rows = read_mooncake(path, cap=s.cap, time_scale=s.time_scale, token_scale=s.token_scale)
    rng = random.Random(s.seed)
    derived = 0
    if s.repeat_share > 0:
        for i in range(1, len(rows)):
            if rng.random() < s.repeat_share:
                j = rng.randrange(i)
                rows[i] = replace(
                    rows[i],
                    prompt=rows[j].prompt,
                    max_tokens=rows[j].max_tokens,
                    prompt_tokens=rows[j].prompt_tokens,
                    block_ids=rows[j].block_ids,
                )
                derived += 1
    prompts: set[str] = set()
    bodies: set[tuple[str, int]] = set()
    prompt_repeats = body_repeats = 0
    for r in rows:
        assert r.prompt is not None
        prompt_repeats += r.prompt in prompts
        body_repeats += (r.prompt, r.max_tokens) in bodies
        prompts.add(r.prompt)
        bodies.add((r.prompt, r.max_tokens))
    span = rows[-1].at_s if rows else 0.0
    return Workload(tuple(rows), str(path), span, prompt_repeats, body_repeats, derived)


def completion_body(r: PlannedRequest, model: str) -> bytes:
    body = {
        "model": model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


# ---- one pass ----------------------------------------------------------------------------


@dataclass(slots=True)
class PassResult:
    name: str
    outcomes: list[Outcome]
    records: list[AccessRecord]
    wall_s: float
    summary: LedgerSummary
    sidecar_cpu_s: float = math.nan

    def figures(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.ok]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        verdicts = Counter(r.response_cache or "uncacheable" for r in self.records)
        replayed = verdicts["hit"] + verdicts["coalesced"]
        total = self.summary.total
        reached = [r for r in self.records if r.endpoint is not None]
        engine_requests = len(reached)
        prompt = sum(r.prompt_tokens or 0 for r in reached)
        cached = sum(r.cached_tokens or 0 for r in reached)
        return {
            "requests": len(self.outcomes),
            "ok": len(ok),
            "errors": dict(
                Counter((o.error or "").split(":")[0] for o in self.outcomes if not o.ok)
            ),
            "logged": len(self.records),
            "cache_verdicts": dict(verdicts),
            "hit_rate": replayed / len(self.records) if self.records else 0.0,
            "engine_requests": engine_requests,
            "engine_prefix_hit_rate": cached / prompt if prompt else None,
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p90_s": percentile(ttft, 0.9),
            "ttft_p99_s": percentile(ttft, 0.99),
            "e2e_p50_s": percentile([o.e2e_s for o in ok], 0.5),
            "gpu_seconds": total.gpu_seconds,
            "cost_usd": total.cost_usd,
            "tasks_ok": total.tasks_succeeded,
            "usd_per_ok_task": total.cost_per_successful_task,
            "avoided_gpu_seconds": sum(r.avoided_gpu_seconds or 0.0 for r in self.records),
            "sidecar_cpu_ms_per_request": self.sidecar_cpu_s * 1000 / max(1, len(self.outcomes))
            if math.isfinite(self.sidecar_cpu_s)
            else None,
            "wall_s": self.wall_s,
        }


async def run_pass(
    name: str,
    s: CacheBenchSettings,
    workload: Workload,
    workdir: Path,
    cache: bool,
) -> PassResult:
    """A fresh fleet and sidecar (cold caches), the workload, then the access log."""
    workdir.mkdir(parents=True, exist_ok=True)
    # A context window that holds the longest request (the trace's 191k-token prompts are
    # 9.6k at token scale 0.05; the simulator's default window is 8,192).
    longest = max(r.prompt_tokens + r.max_tokens for r in workload.requests)
    window = max(EngineSpec().max_model_len, math.ceil(longest * 1.25))
    base = EngineSpec(gpu=s.gpu, time_scale=s.engine_time_scale, seed=s.seed, max_model_len=window)
    specs = [replace(base, name=f"{s.gpu.lower()}-{i}") for i in range(s.engines)]
    fleet = await start_engines(specs, workdir / "engines.log")
    access = workdir / "access.jsonl"
    access.unlink(missing_ok=True)
    try:
        pool = {"name": "default", "endpoints": [endpoint_entry(e) for e in fleet.engines]}
        config = bench_sidecar_config(
            [pool], access, response_cache={"enabled": cache, "store": "memory"}
        )
        router = await start_sidecar_process(config, workdir)
        try:
            sends = [
                Send(i, f"{name}-{i}", r.at_s, "/v1/completions", completion_body(r, base.model))
                for i, r in enumerate(workload.requests)
            ]
            cpu0 = _cpu(router)
            outcomes, wall = await send_all(
                router.url,
                sends,
                concurrency=s.concurrency,
                timeout_s=s.timeout_s,
                keep_headers=("cache-status",),
                progress=name if s.progress else None,
            )
            cpu = _cpu(router) - cpu0
        finally:
            await router.stop()  # drains: the access log is flushed
    finally:
        await fleet.stop()
    records = read_records(access)
    return PassResult(name, outcomes, records, wall, ledger_of(records), cpu)


def _cpu(router: ProcessRouter) -> float:
    """The sidecar process's CPU-seconds so far (nan where /proc cannot tell)."""
    try:
        return cpu_seconds(router.proc.pid)
    except (OSError, ValueError, IndexError):
        return math.nan


def by_verdict(off: PassResult, on: PassResult) -> dict[str, dict[str, Any]]:
    """Per cache verdict of the cache pass: how many, and the TTFT p50 of those requests
    with the cache on and of the same requests (same index) with it off."""
    verdict = {r.request_id: r.response_cache or "uncacheable" for r in on.records}
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for a, b in zip(off.outcomes, on.outcomes, strict=True):
        if a.ok and b.ok and a.ttft_s is not None and b.ttft_s is not None:
            ons, offs = groups.setdefault(verdict.get(b.request_id, "unlogged"), ([], []))
            ons.append(b.ttft_s)
            offs.append(a.ttft_s)
    return {
        k: {
            "requests": len(ons),
            "ttft_p50_s": percentile(ons, 0.5),
            "ttft_p50_s_no_cache": percentile(offs, 0.5),
            "ttft_max_s": max(ons),
            "ttft_max_s_no_cache": max(offs),
        }
        for k, (ons, offs) in sorted(groups.items())
    }


def verdict_table(groups: Mapping[str, Mapping[str, Any]]) -> str:
    rows = [
        [
            k,
            str(g["requests"]),
            ms(g["ttft_p50_s_no_cache"]),
            ms(g["ttft_p50_s"]),
            fmt(ratio(g["ttft_p50_s"], g["ttft_p50_s_no_cache"]), "{:.3f}x"),
            f"{ms(g['ttft_max_s_no_cache'])} / {ms(g['ttft_max_s'])}",
        ]
        for k, g in groups.items()
    ]
    head = ("cache verdict", "requests", "TTFT p50 no cache", "cache", "ratio", "TTFT max no/with")
    return render_table(head, rows)


def spent_on(off: PassResult, on: PassResult) -> float:
    """GPU-seconds the no-cache pass spent on the requests the cache pass replayed."""
    replayed = {
        r.request_id.rsplit("-", 1)[1]
        for r in on.records
        if r.response_cache in ("hit", "coalesced")
    }
    return sum(
        r.gpu_seconds or 0.0 for r in off.records if r.request_id.rsplit("-", 1)[1] in replayed
    )


def wrong_answers(off: PassResult, on: PassResult) -> tuple[int, int, list[dict[str, Any]]]:
    """(pairs compared, of them answered from the cache, mismatches): request i's text
    with the cache on against request i's with it off, where both succeeded."""
    verdict = {r.request_id: r.response_cache for r in on.records}
    compared = replayed = 0
    bad: list[dict[str, Any]] = []
    for a, b in zip(off.outcomes, on.outcomes, strict=True):
        if not (a.ok and b.ok):
            continue
        compared += 1
        how = verdict.get(b.request_id)
        replayed += how in ("hit", "coalesced")
        if a.text_sha256 != b.text_sha256:
            bad.append(
                {
                    "index": a.index,
                    "cache": how,
                    "no_cache_sha256": a.text_sha256,
                    "cache_sha256": b.text_sha256,
                }
            )
    return compared, replayed, bad


# ---- the report ----------------------------------------------------------------------


def header_lines(s: CacheBenchSettings, w: Workload) -> list[str]:
    how = (
        f"each request after the first re-asks, with probability {s.repeat_share:g}, what a "
        f"uniformly drawn earlier request asked (prompt and max_tokens; seed {s.seed})"
        if s.repeat_share
        else "the trace as it is (no derived repeats)"
    )
    return [
        "response cache bench (issue #24): meshd sidecar, cache off vs on (memory store)",
        f"workload: {w.source}, first {s.cap} rows; arrivals / {s.time_scale:g}, "
        f"token scale {s.token_scale:g}; {how}",
        f"  {w.describe()}",
        "  every request: streamed /v1/completions, temperature 0, ignore_eos, include_usage",
        f"fleet: {s.engines} x simulated {s.gpu} (one seed), engine time scale "
        f"{s.engine_time_scale:g}; routing.policy {MESHD_BEST_POLICY}; client concurrency "
        f"<= {s.concurrency}; each pass on a fresh fleet and sidecar (cold caches), "
        + ("the cache pass first" if s.cache_first else "the no-cache pass first"),
    ]


def report_table(off: dict[str, Any], on: dict[str, Any]) -> str:
    def r(key: str) -> str:
        return fmt(ratio(on[key], off[key]), "{:.3f}x")

    rows = [
        ["requests ok", f"{off['ok']}/{off['requests']}", f"{on['ok']}/{on['requests']}",
         fmt(ratio(on["ok"], off["ok"]), "{:.3f}x")],
        ["hit rate (hit+coalesced)", f"{off['hit_rate']:.1%}", f"{on['hit_rate']:.1%}", "-"],
        ["engine requests", str(off["engine_requests"]), str(on["engine_requests"]),
         r("engine_requests")],
        ["  their prefix-cache hits", fmt(off["engine_prefix_hit_rate"], "{:.1%}"),
         fmt(on["engine_prefix_hit_rate"], "{:.1%}"), r("engine_prefix_hit_rate")],
        ["TTFT p50", ms(off["ttft_p50_s"]), ms(on["ttft_p50_s"]), r("ttft_p50_s")],
        ["TTFT p90", ms(off["ttft_p90_s"]), ms(on["ttft_p90_s"]), r("ttft_p90_s")],
        ["E2E p50", ms(off["e2e_p50_s"]), ms(on["e2e_p50_s"]), r("e2e_p50_s")],
        ["GPU-seconds", fmt(off["gpu_seconds"]), fmt(on["gpu_seconds"]), r("gpu_seconds")],
        ["$ per successful task", usd(off["usd_per_ok_task"]), usd(on["usd_per_ok_task"]),
         r("usd_per_ok_task")],
        ["sidecar CPU per request", fmt(off["sidecar_cpu_ms_per_request"], "{:.2f} ms"),
         fmt(on["sidecar_cpu_ms_per_request"], "{:.2f} ms"), r("sidecar_cpu_ms_per_request")],
    ]  # fmt: skip
    return render_table(("", "no cache", "cache", "cache/no cache"), rows)


def write_plot(path: Path, passes: Mapping[str, Sequence[Outcome]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, outcomes in passes.items():
        xs = sorted(o.ttft_s * 1000 for o in outcomes if o.ok and o.ttft_s is not None)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, client-measured)")
    ax.set_ylabel("share of successful requests")
    ax.set_title("Response cache: TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


async def run_bench(s: CacheBenchSettings, out: Path) -> dict[str, Any]:
    """Both passes; prints the report and writes results.json and ttft_cdf.png."""
    workload = build_workload(s)
    for line in header_lines(s, workload):
        print(line, flush=True)
    t0 = time.monotonic()
    if s.cache_first:
        on = await run_pass("cache", s, workload, out / "cache", cache=True)
        off = await run_pass("no-cache", s, workload, out / "no-cache", cache=False)
    else:
        off = await run_pass("no-cache", s, workload, out / "no-cache", cache=False)
        on = await run_pass("cache", s, workload, out / "cache", cache=True)
    compared, replayed, bad = wrong_answers(off, on)
    f_off, f_on = off.figures(), on.figures()
    print()
    print(report_table(f_off, f_on))
    groups = by_verdict(off, on)
    print("\nthe same requests by the cache pass's verdict (access log `response_cache`):")
    print(verdict_table(groups))
    spent = spent_on(off, on)
    print(
        f"avoided GPU-seconds: the access log says {f_on['avoided_gpu_seconds']:.3f} "
        f"(what the stored answers cost when first generated); the same requests cost "
        f"{spent:.3f} in the no-cache pass (an exact repeat hits the engine's prefix cache)"
    )
    print(
        f"wrong answers: {len(bad)} of {compared} requests compared ({replayed} of them "
        f"answered from the cache): text with the cache on vs the engine's with it off"
    )
    for b in bad[:10]:
        print(f"  MISMATCH request {b['index']} ({b['cache']}): {b}")
    for name, f in (("no-cache", f_off), ("cache", f_on)):
        if f["errors"]:
            print(f"failed requests, {name}: {f['errors']}")
    doc = {
        "bench": "cache_bench",
        "settings": asdict(s),
        "workload": {
            "source": workload.source,
            "requests": len(workload.requests),
            "span_s": workload.span_s,
            "prompt_repeats": workload.prompt_repeats,
            "body_repeats": workload.body_repeats,
            "derived_repeats": workload.derived,
            "hit_rate_bound": workload.body_repeats / max(1, len(workload.requests)),
        },
        "passes": {"no_cache": f_off, "cache": f_on},
        "ratios": {
            k: ratio(f_on[k], f_off[k])
            for k in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "gpu_seconds", "usd_per_ok_task")
        },
        "by_verdict": groups,
        "avoided_gpu_seconds_logged": f_on["avoided_gpu_seconds"],
        "replayed_gpu_seconds_no_cache": spent,
        "wrong_answers": len(bad),
        "compared": compared,
        "compared_replayed": replayed,
        "mismatches": bad,
        "wall_s": time.monotonic() - t0,
    }
    rows = [("pass", name, o) for name, p in (("no-cache", off), ("cache", on)) for o in p.outcomes]
    write_outputs(
        out,
        doc,
        rows,
        "ttft_cdf.png",
        lambda path: write_plot(path, {"no cache": off.outcomes, "cache": on.outcomes}),
    )
    return doc


def write_outputs(
    out: Path,
    doc: dict[str, Any],
    rows: Iterable[tuple[str, str, Any]],
    plot_name: str,
    plot: Callable[[Path], None],
) -> None:
    """A bench's files: results.json (`doc`, with its wall_s), requests.jsonl (one line per
    (key, label, outcome): the outcome's JSON under `key: label`) and the plot `plot_name`
    (skipped, saying so, without matplotlib); then where they are."""
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    with (out / "requests.jsonl").open("w") as fh:
        for key, label, o in rows:
            fh.write(json.dumps({key: label, **o.to_json()}) + "\n")
    try:
        plot(out / plot_name)
        where = f", {out / plot_name}"
    except ImportError:
        where = " (no matplotlib: no plot)"
    print(f"\nwrote {out / 'results.json'}{where} ({doc['wall_s']:.0f} s)")


def parse_args(argv: Sequence[str] | None) -> tuple[CacheBenchSettings, argparse.Namespace]:
    d = CacheBenchSettings()
    p = argparse.ArgumentParser(
        prog="python -m loadtest.cache_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cap", type=int, default=d.cap, help=f"trace rows (default {d.cap})")
    p.add_argument(
        "--time-scale",
        type=float,
        default=d.time_scale,
        help=f"arrivals this many times faster than the trace (default {d.time_scale:g})",
    )
    p.add_argument(
        "--token-scale",
        type=float,
        default=d.token_scale,
        help=f"prompt and output lengths x this (default {d.token_scale:g})",
    )
    p.add_argument(
        "--repeat-share",
        type=float,
        default=d.repeat_share,
        metavar="X",
        help="also re-ask a random X share of earlier requests (default 0: the trace)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="for --repeat-share and the engines")
    p.add_argument("--engines", type=int, default=d.engines, help=f"default {d.engines}")
    p.add_argument("--gpu", default=d.gpu, help=f"simulated GPU (default {d.gpu})")
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
    p.add_argument("--traces", default=None, help="traces dir (default ../shared/data/traces)")
    p.add_argument("--out", type=Path, default=None, help="default results/cache-bench-<time>")
    p.add_argument(
        "--cache-first",
        action="store_true",
        help="run the cache pass first (the order's part in a difference: run both ways)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--serve-engines", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_engines is not None:
        return d, args
    try:
        s = CacheBenchSettings(
            cap=args.cap,
            time_scale=args.time_scale,
            token_scale=args.token_scale,
            repeat_share=args.repeat_share,
            seed=args.seed,
            engines=args.engines,
            gpu=args.gpu.upper(),
            engine_time_scale=args.engine_time_scale,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            traces=args.traces,
            progress=not args.no_progress,
            cache_first=args.cache_first,
        )
    except ValueError as exc:
        p.error(str(exc))
    return s, args


def run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    s, args = parse_args(argv)
    if args.serve_engines is not None:
        return int(run_loop(_serve_engines(args.serve_engines)))
    out = args.out or Path("results") / time.strftime("cache-bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    doc = run_loop(run_bench(s, out))
    return 1 if doc["wrong_answers"] else 0


if __name__ == "__main__":
    sys.exit(main())
