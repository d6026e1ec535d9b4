"""The cascading-failure scenario (issue 5), as a `meshd bench` scenario script.

    python -m loadtest.bench.cascade [--quick] [--policies meshd,rr-naive-retry,...]

Eight simulated engines (loadtest/engine) behind the router under test; clients send an
open-loop Poisson stream of streamed completions and, like the OpenAI SDK, retry a request
that timed out, broke, or got 408/409/429/5xx (3 attempts, exponential backoff with
jitter, Retry-After honoured). Each policy runs on a fresh fleet, one after the other:

- healthy: no fault (meshd only): the reference goodput of the whole fleet.
- degraded: at `fault_at` one engine slows to 1/`slow_factor` of its speed (the
  simulator's `slowdown` fault, POST /admin/fault). Its queue grows; a client that
  times out retries, and a router that keeps sending it traffic feeds the spiral.
- crash: at `fault_at` one engine resets every stream after `crash_after_tokens` tokens
  (a crash loop) and another resets a few streams at another position; healthy capacity
  remains, so no stream needs to be lost.
- scaleup (not in the default set; issue #24): the fleet is short of `cold_engines`
  engines (their weights loading: connection refused) until `scaleup_at`, when they come
  up with empty caches; prompts share one of `prefix_groups` long prefixes, so a cold
  cache costs prefill. Compare meshd with its rewarm (slow start: a new engine's weight
  ramps over reliability.slow_start.window_s; hot-prefix replication spreads a hot group
  to it one engine at a time) and `meshd-no-slow-start` (it takes its full share at once);
  the picker's replication is not a config setting, so it is on in both. TTFT p99 is
  also given for the requests that arrived after the scale-up.

Per pass (definitions):
- goodput: logical requests that succeeded (some attempt streamed to [DONE]) per second
  of the arrival window; target >= 90% of the healthy goodput x remaining capacity
  ((engines - 1 + 1/slow_factor) / engines) for the degraded run.
- amplification: upstream attempts (requests that reached an engine: the sum of its
  vllm:request_success_total over every finished_reason, aborts included) / logical
  requests; target <= 1.2. `proxy amp` divides by the client's own sends instead.
- TTFT p99: what the user waited, from the first send to the first token of the attempt
  that succeeded (a client retry counts in it).
- broken: attempts whose stream started (>= 1 token) and then failed; lost tok: the
  tokens those carried, thrown away by the client; wasted tok: tokens the engines
  generated (vllm:generation_tokens) beyond those of the answers that succeeded.
- $/1k tasks: the fleet's GPU price over the pass's provisioned time (simulated seconds)
  per thousand successful requests (a task is one request here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench.fleet import FleetProcess, FleetSpec, start_fleet
from loadtest.bench.policies import POLICIES, PolicySpec, Router
from loadtest.bench.scrape import GENERATION_TOKENS, parse_metrics
from loadtest.bench.stream import StreamMeter, StreamSummary

REQUEST_SUCCESS = "vllm:request_success"
# What the OpenAI SDK retries (openai-python _base_client.py _should_retry): 408, 409,
# 429 and 5xx, plus timeouts and connection errors.
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
BASELINE = "rr-naive-retry"
DEFAULT_POLICIES: tuple[str, ...] = ("meshd", "rr-naive-retry", "envoy-lr-retry")
SCENARIOS: tuple[str, ...] = ("healthy", "degraded", "crash")
ALL_SCENARIOS: tuple[str, ...] = (*SCENARIOS, "scaleup")
SCALEUP_POLICIES: tuple[str, ...] = ("meshd", "meshd-no-slow-start")
_WORDS = tuple(f"w{i}" for i in range(512))
_IDLE_TIMEOUT_S = 20.0

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"[cascade] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class CascadeSettings:
    """One run. Times are wall seconds; `time_scale` is simulated seconds per wall second
    (0.25: an engine step of 7.5 ms takes 30 ms, so 8 engines stay within two shared
    cores). `max_num_seqs` keeps an engine's batch small, so that the slowed engine's
    queue grows at a rate the client, the router and the simulator can carry; it is the
    picker's load floor (8 requests per H100, filters/picker.py), below which the picker
    assumes an engine just batches one more."""

    engines: int = 8
    gpu: str = "H100"
    time_scale: float = 0.25
    max_num_seqs: int = 8
    rate_rps: float = 16.0
    duration_s: float = 60.0
    prompt_words: int = 96
    max_tokens: int = 32
    client_timeout_s: float = 5.0
    client_attempts: int = 3
    backoff_base_s: float = 0.1
    backoff_max_s: float = 2.0
    slow_factor: float = 10.0
    fault_at_fraction: float = 0.2
    crash_after_tokens: int = 12
    # scaleup: engines absent until scaleup_at_fraction x duration, and the shared prefixes.
    cold_engines: int = 4
    scaleup_at_fraction: float = 0.4
    # Over what the engines up before the scale-up carry (~8 req/s each at these settings),
    # within what the whole fleet carries.
    scaleup_rate_rps: float = 40.0
    prefix_groups: int = 8
    prefix_words: int = 384
    seed: int = 0
    policies: tuple[str, ...] = DEFAULT_POLICIES
    scenarios: tuple[str, ...] = SCENARIOS

    @property
    def remaining_capacity(self) -> float:
        return (self.engines - 1 + 1 / self.slow_factor) / self.engines

    @property
    def fault_at_s(self) -> float:
        return self.duration_s * self.fault_at_fraction

    @property
    def scaleup_at_s(self) -> float:
        return self.duration_s * self.scaleup_at_fraction


QUICK = CascadeSettings(duration_s=20.0)


# ---- the client ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Planned:
    at_s: float
    prompt: str
    request_id: str


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """One logical request, over all its attempts."""

    ok: bool
    attempts: int
    ttft_s: float | None
    e2e_s: float
    tokens: int
    lost_tokens: int
    broken_streams: int
    error: str | None
    planned_at_s: float = 0.0


def plan(settings: CascadeSettings, *, shared: bool = False) -> list[Planned]:
    """Poisson arrivals over the duration, each with a prompt of its own (no shared
    prefixes: prefix affinity plays no part here). `shared` (the scaleup scenario): each
    prompt starts with one of `prefix_groups` prefixes of `prefix_words` words."""
    rng = random.Random(settings.seed)
    groups = random.Random(f"{settings.seed}-groups")  # the arrivals stay plain's
    prefixes: list[str] = []
    for g in range(settings.prefix_groups if shared else 0):
        pr = random.Random(f"{settings.seed}-prefix-{g}")
        prefixes.append(" ".join(pr.choice(_WORDS) for _ in range(settings.prefix_words)))
    out: list[Planned] = []
    t = rng.expovariate(settings.rate_rps)
    while t < settings.duration_s:
        words = " ".join(rng.choice(_WORDS) for _ in range(settings.prompt_words))
        head = f"{groups.choice(prefixes)} " if prefixes else ""
        out.append(Planned(t, f"{head}request {len(out)}: {words}", f"cascade-{len(out)}"))
        t += rng.expovariate(settings.rate_rps)
    return out


class RetryingClient:
    """Open loop; per logical request up to `client_attempts` sends, each bounded by
    `client_timeout_s`, with the OpenAI SDK's backoff (scaled by `backoff_base_s`)."""

    def __init__(self, base_url: str, model: str, settings: CascadeSettings) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.s = settings
        self.sends = 0
        self.attempt_errors: dict[str, int] = {}  # failed attempts by kind
        self._rng = random.Random(settings.seed + 1)

    async def run(self, planned: Sequence[Planned], progress: Any = None) -> list[TaskOutcome]:
        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
        out: list[TaskOutcome] = []
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            t0 = loop.time()
            tasks: list[asyncio.Task[None]] = []

            async def one(p: Planned) -> None:
                out.append(replace(await self._task(session, p), planned_at_s=p.at_s))
                if progress is not None:
                    progress.update(1)

            for p in planned:
                delay = t0 + p.at_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(p)))
            await asyncio.gather(*tasks)
        return out

    def _body(self, p: Planned) -> bytes:
        doc = {
            "model": self.model,
            "prompt": p.prompt,
            "max_tokens": self.s.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return json.dumps(doc).encode()

    def _backoff(self, retry: int, retry_after: float | None) -> float:
        s = self.s
        if retry_after is not None and 0 <= retry_after <= s.backoff_max_s:
            return retry_after
        delay = min(s.backoff_base_s * 2.0 ** (retry - 1), s.backoff_max_s)
        return delay * (1 - 0.25 * self._rng.random())

    async def _task(self, session: aiohttp.ClientSession, p: Planned) -> TaskOutcome:
        loop = asyncio.get_running_loop()
        body = self._body(p)
        headers = {"Content-Type": "application/json", "x-request-id": p.request_id}
        started = loop.time()
        lost = broken = 0
        error: str | None = None
        for attempt in range(1, self.s.client_attempts + 1):
            self.sends += 1
            summary, error, retry_after = await self._attempt(session, body, headers)
            if error is None:
                assert summary.first_token_at is not None
                return TaskOutcome(
                    True,
                    attempt,
                    summary.first_token_at - started,
                    loop.time() - started,
                    summary.token_events,
                    lost,
                    broken,
                    None,
                )
            if summary.token_events:
                lost += summary.token_events
                broken += 1
            if error.startswith("http_") and int(error[5:]) not in RETRY_STATUSES:
                break
            if attempt < self.s.client_attempts:
                await asyncio.sleep(self._backoff(attempt, retry_after))
        return TaskOutcome(False, attempt, None, loop.time() - started, 0, lost, broken, error)

    async def _attempt(
        self, session: aiohttp.ClientSession, body: bytes, headers: dict[str, str]
    ) -> tuple[StreamSummary, str | None, float | None]:
        loop = asyncio.get_running_loop()
        meter = StreamMeter()
        error: str | None = None
        retry_after: float | None = None
        try:
            async with asyncio.timeout(self.s.client_timeout_s):
                async with session.post(self.url, data=body, headers=headers) as resp:
                    if resp.status != 200:
                        raw = await resp.read()
                        with contextlib.suppress(ValueError):
                            retry_after = float(resp.headers.get("Retry-After", ""))
                        self._note(f"http_{resp.status} {_error_code(raw)}")
                        return meter.summary(), f"http_{resp.status}", retry_after
                    async for chunk in resp.content.iter_any():
                        meter.feed(chunk, loop.time())
        except TimeoutError:
            error = "timeout"
        except (aiohttp.ClientError, ConnectionError):
            error = "broken"
        summary = meter.summary()
        if error is None:
            if summary.error is not None:
                error = "sse_error"
            elif not summary.done or summary.token_events == 0:
                error = "truncated"
        if error is not None:
            self._note(error)
        return summary, error, retry_after

    def _note(self, kind: str) -> None:
        self.attempt_errors[kind] = self.attempt_errors.get(kind, 0) + 1


def _error_code(raw: bytes) -> str:
    """The `code` (or type) of an OpenAI-style error body, for the failure counts."""
    with contextlib.suppress(ValueError, AttributeError):
        err = json.loads(raw).get("error") or {}
        return str(err.get("code") or err.get("type") or "")
    return ""


# ---- one pass --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PassResult:
    scenario: str
    policy: str
    summary: str
    requests: int
    ok: int
    sends: int
    upstream_attempts: float
    generated_tokens: float
    good_tokens: int
    lost_tokens: int
    broken_streams: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    duration_s: float
    fleet_usd: float
    errors: dict[str, int] = field(default_factory=dict)  # failed requests, last error
    # scaleup: TTFT p99 of the requests that arrived after the scale-up, and the attempts
    # each engine took (the last cold_engines are the new ones).
    ttft_p99_after_s: float | None = None
    engine_attempts: tuple[float, ...] = ()
    attempt_errors: dict[str, int] = field(default_factory=dict)  # failed attempts
    skipped: str | None = None

    @property
    def goodput_rps(self) -> float:
        return self.ok / self.duration_s if self.duration_s else 0.0

    @property
    def success(self) -> float:
        return self.ok / self.requests if self.requests else 0.0

    @property
    def amplification(self) -> float:
        return self.upstream_attempts / self.requests if self.requests else math.nan

    @property
    def proxy_amplification(self) -> float:
        return self.upstream_attempts / self.sends if self.sends else math.nan

    @property
    def wasted_tokens(self) -> float:
        return max(0.0, self.generated_tokens - self.good_tokens)

    @property
    def usd_per_1k_tasks(self) -> float:
        return 1000 * self.fleet_usd / self.ok if self.ok else math.inf


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))
    return xs[k]


async def _counters(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, float]]:
    async def one(u: str) -> dict[str, float]:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ConnectionError):
            async with asyncio.timeout(5.0):
                async with session.get(u + "/metrics") as resp:
                    return parse_metrics(await resp.text(), {REQUEST_SUCCESS, GENERATION_TOKENS})
        return {}

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def _idle(session: aiohttp.ClientSession, urls: Sequence[str], timeout_s: float) -> None:
    """Wait until no engine runs or queues anything (abandoned requests are aborted)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        busy = 0.0
        for u in urls:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with asyncio.timeout(5.0):
                    async with session.get(u + "/admin/state") as resp:
                        doc = await resp.json(content_type=None)
                        busy += float(doc.get("running", 0)) + float(doc.get("waiting", 0))
        if busy == 0:
            return
        await asyncio.sleep(0.2)


async def _fault(session: aiohttp.ClientSession, url: str, doc: dict[str, Any]) -> None:
    async with session.post(url + "/admin/fault", json=doc) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} refused fault {doc}: HTTP {resp.status}")


def faults_of(scenario: str, s: CascadeSettings) -> list[tuple[int, dict[str, Any]]]:
    """(engine index, fault) applied at fault_at_s."""
    if scenario == "degraded":
        return [(0, {"kind": "slowdown", "factor": s.slow_factor})]
    if scenario == "crash":
        n = s.crash_after_tokens
        return [
            (0, {"kind": "crash_after_tokens", "tokens": n, "count": -1}),
            (1, {"kind": "crash_after_tokens", "tokens": max(1, n // 3), "count": 5}),
        ]
    return []


def cold_at_start(scenario: str, s: CascadeSettings) -> list[tuple[int, dict[str, Any]]]:
    """(engine index, fault) applied before the first request: the scaleup scenario's last
    `cold_engines` load their weights (connection refused) until scaleup_at_s, in the
    engines' simulated seconds (wall x time_scale)."""
    if scenario != "scaleup":
        return []
    seconds = s.scaleup_at_s * s.time_scale
    first = max(0, s.engines - s.cold_engines)
    return [
        (i, {"kind": "cold_start", "seconds": seconds, "mode": "refuse"})
        for i in range(first, s.engines)
    ]


async def _start_router(spec: PolicySpec, fleet: FleetProcess, workdir: Path) -> Router:
    on_fleet = getattr(spec, "start_on_fleet", None)
    if on_fleet is not None:
        router: Router = await on_fleet(fleet.engines, workdir)
        return router
    return await spec.start(fleet.urls, workdir)


async def run_pass(
    scenario: str,
    spec: PolicySpec,
    s: CascadeSettings,
    workdir: Path,
    *,
    log: Log = _stderr,
    progress: bool = True,
) -> PassResult:
    reason = spec.unavailable()
    if reason is not None:
        log(f"{scenario}/{spec.name}: skipped: {reason}")
        return _skipped(scenario, spec, reason)
    if scenario == "scaleup":
        s = replace(s, rate_rps=s.scaleup_rate_rps)
    planned = plan(s, shared=scenario == "scaleup")
    fleet_spec = FleetSpec(
        gpus=(s.gpu,) * s.engines,
        kind="sim",
        time_scale=s.time_scale,
        seed=s.seed,
        extra={"max_num_seqs": s.max_num_seqs},
    )
    fleet = await start_fleet(fleet_spec, workdir / "fleet.log")
    router: Router | None = None
    try:
        router = await _start_router(spec, fleet, workdir)
        urls = list(fleet.urls)
        async with aiohttp.ClientSession() as session:
            async with session.get(urls[0] + "/v1/models") as resp:
                model = str((await resp.json())["data"][0]["id"])
            before = await _counters(session, urls)
            for i, doc in cold_at_start(scenario, s):
                await _fault(session, urls[i], doc)
            client = RetryingClient(router.url, model, s)

            async def inject() -> None:
                await asyncio.sleep(s.fault_at_s)
                for i, doc in faults_of(scenario, s):
                    await _fault(session, urls[i], doc)

            bar = _progress(len(planned), f"{scenario}/{spec.name}") if progress else None
            injector = asyncio.create_task(inject())
            t0 = time.monotonic()
            try:
                outcomes = await client.run(planned, bar)
            finally:
                injector.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await injector
                if bar is not None:
                    bar.close()
            wall = time.monotonic() - t0
            # Counted once the engines are done with what the clients left behind.
            for i, doc in faults_of(scenario, s):
                if doc["kind"] == "slowdown":
                    await _fault(session, urls[i], {"kind": "slowdown", "factor": 1})
            await _idle(session, urls, _IDLE_TIMEOUT_S)
            after = await _counters(session, urls)
    finally:
        if router is not None:
            await router.stop()
        await fleet.stop()
    r = _result(scenario, spec, s, planned, outcomes, client.sends, before, after, wall, fleet)
    return replace(r, attempt_errors=dict(client.attempt_errors))


def _delta(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]], k: str) -> float:
    return sum(a.get(k, 0.0) - b.get(k, 0.0) for b, a in zip(before, after, strict=True))


def _result(
    scenario: str,
    spec: PolicySpec,
    s: CascadeSettings,
    planned: Sequence[Planned],
    outcomes: Sequence[TaskOutcome],
    sends: int,
    before: Sequence[dict[str, float]],
    after: Sequence[dict[str, float]],
    wall: float,
    fleet: FleetProcess,
) -> PassResult:
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    after_ttfts = [
        o.ttft_s for o in ok if o.ttft_s is not None and o.planned_at_s >= s.scaleup_at_s
    ]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error or "?"] = errors.get(o.error or "?", 0) + 1
    usd_per_s = sum(e.price_per_gpu_hour for e in fleet.engines) / 3600.0
    return PassResult(
        scenario=scenario,
        policy=spec.name,
        summary=spec.summary,
        requests=len(planned),
        ok=len(ok),
        sends=sends,
        upstream_attempts=_delta(before, after, REQUEST_SUCCESS),
        generated_tokens=_delta(before, after, GENERATION_TOKENS),
        good_tokens=sum(o.tokens for o in ok),
        lost_tokens=sum(o.lost_tokens for o in outcomes),
        broken_streams=sum(o.broken_streams for o in outcomes),
        ttft_p50_s=_percentile(ttfts, 0.50),
        ttft_p99_s=_percentile(ttfts, 0.99),
        duration_s=s.duration_s,
        fleet_usd=usd_per_s * wall * s.time_scale,
        errors=errors,
        ttft_p99_after_s=_percentile(after_ttfts, 0.99) if scenario == "scaleup" else None,
        engine_attempts=tuple(
            a.get(REQUEST_SUCCESS, 0.0) - b.get(REQUEST_SUCCESS, 0.0)
            for b, a in zip(before, after, strict=True)
        )
        if scenario == "scaleup"
        else (),
    )


def _skipped(scenario: str, spec: PolicySpec, reason: str) -> PassResult:
    return PassResult(
        scenario, spec.name, spec.summary, 0, 0, 0, 0.0, 0.0, 0, 0, 0, None, None, 0.0, 0.0,
        skipped=reason,
    )  # fmt: skip


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, mininterval=0.5)


# ---- the run ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CascadeReport:
    settings: CascadeSettings
    passes: tuple[PassResult, ...]

    def get(self, scenario: str, policy: str) -> PassResult | None:
        for p in self.passes:
            if p.scenario == scenario and p.policy == policy and p.skipped is None:
                return p
        return None

    @property
    def healthy_goodput(self) -> float | None:
        ref = [p for p in self.passes if p.scenario == "healthy" and p.skipped is None]
        return ref[0].goodput_rps if ref else None

    @property
    def goodput_target(self) -> float | None:
        h = self.healthy_goodput
        return None if h is None else 0.9 * h * self.settings.remaining_capacity

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "healthy_goodput_rps": self.healthy_goodput,
            "goodput_target_rps": self.goodput_target,
            "passes": [
                {
                    **asdict(p),
                    "goodput_rps": p.goodput_rps,
                    "amplification": p.amplification,
                    "proxy_amplification": p.proxy_amplification,
                    "wasted_tokens": p.wasted_tokens,
                    "usd_per_1k_tasks": p.usd_per_1k_tasks,
                }
                for p in self.passes
            ],
        }


async def run_cascade(
    settings: CascadeSettings, workdir: Path, *, log: Log = _stderr, progress: bool = True
) -> CascadeReport:
    passes: list[PassResult] = []
    specs = [POLICIES[name] for name in settings.policies]
    for scenario in settings.scenarios:
        todo = specs if scenario != "healthy" else specs[:1]
        if scenario == "scaleup":
            # The rewarm against none: meshd as it is and without its slow start.
            todo = [POLICIES[name] for name in SCALEUP_POLICIES]
        for spec in todo:
            log(f"{scenario}: {spec.name} ({spec.summary})")
            try:
                r = await run_pass(
                    scenario,
                    spec,
                    settings,
                    workdir / scenario / spec.name,
                    log=log,
                    progress=progress,
                )
            except (RuntimeError, OSError, aiohttp.ClientError) as exc:
                log(f"{scenario}/{spec.name}: failed: {exc}")
                r = _skipped(scenario, spec, f"failed: {str(exc).splitlines()[0]}")
            passes.append(r)
    return CascadeReport(settings, tuple(passes))


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def format_report(report: CascadeReport) -> str:
    s = report.settings
    h, target = report.healthy_goodput, report.goodput_target
    lines = [
        f"cascade: {s.engines} x {s.gpu} (sim, time_scale {s.time_scale:g}, max_num_seqs "
        f"{s.max_num_seqs}), {s.rate_rps:g} req/s for {s.duration_s:g} s, {s.max_tokens} "
        f"tokens each; clients: {s.client_attempts} attempts, {s.client_timeout_s:g} s "
        f"timeout; fault at {s.fault_at_s:g} s",
        f"degraded: engine 0 at 1/{s.slow_factor:g} speed; remaining capacity "
        f"{s.remaining_capacity:.4f}; healthy goodput {_f(h)} req/s; goodput target "
        f"(0.9 x healthy x remaining) {_f(target)} req/s; amplification target <= 1.2",
        *(
            [
                f"scaleup: {s.scaleup_rate_rps:g} req/s sharing {s.prefix_groups} prefixes of "
                f"{s.prefix_words} words; engines {s.engines - s.cold_engines}-{s.engines - 1} "
                f"loading until {s.scaleup_at_s:g} s (connection refused), then up, cold"
            ]
            if "scaleup" in s.scenarios
            else []
        ),
        "",
    ]
    head = (
        "scenario", "policy", "goodput", "x target", "ok %", "amp", "proxy amp",
        "TTFT p50", "TTFT p99", "broken", "lost tok", "wasted tok", "$/1k tasks", "x cost",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for p in report.passes:
        if p.skipped is not None:
            rows.append((p.scenario, p.policy, f"skipped: {p.skipped}", *[""] * (len(head) - 3)))
            continue
        base = report.get(p.scenario, BASELINE)
        x_cost = (
            p.usd_per_1k_tasks / base.usd_per_1k_tasks
            if base is not None and base.ok and p.ok
            else None
        )
        rows.append(
            (
                p.scenario,
                p.policy,
                _f(p.goodput_rps),
                _f(p.goodput_rps / target if target and p.scenario == "degraded" else None),
                _f(100 * p.success, "{:.1f}"),
                _f(p.amplification, "{:.3f}"),
                _f(p.proxy_amplification, "{:.3f}"),
                _f(p.ttft_p50_s, "{:.3f}s"),
                _f(p.ttft_p99_s, "{:.3f}s"),
                str(p.broken_streams),
                str(p.lost_tokens),
                _f(p.wasted_tokens, "{:.0f}"),
                _f(p.usd_per_1k_tasks, "{:.4f}"),
                _f(x_cost, "{:.2f}"),
            )
        )
    widths = [max(len(r[i]) for r in rows if len(r) > i) for i in range(len(head))]
    for r in rows:
        if r[2].startswith("skipped"):
            lines.append("  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2]]))
            continue
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    lines.append("")
    lines.append(
        "x target: goodput / target (>= 1 meets it); amp: engine attempts / client requests; "
        f"x cost: $/task relative to {BASELINE}"
    )
    for p in report.passes:
        if p.attempt_errors:
            lines.append(
                f"  {p.scenario}/{p.policy}: failed attempts {json.dumps(p.attempt_errors)}, "
                f"failed requests {json.dumps(p.errors)}"
            )
    lines.extend(_verdicts(report))
    return "\n".join(lines)


def _verdicts(report: CascadeReport) -> list[str]:
    out = []
    target = report.goodput_target
    m = report.get("degraded", "meshd")
    if m is not None:
        amp_ok = m.amplification <= 1.2
        out.append(
            f"meshd degraded: amplification {m.amplification:.3f} "
            f"({'meets' if amp_ok else 'MISSES'} <= 1.2)"
            + (
                f"; goodput {m.goodput_rps:.2f} vs target {target:.2f} "
                f"({'meets' if m.goodput_rps >= target else 'MISSES'})"
                if target is not None
                else ""
            )
        )
    c = report.get("crash", "meshd")
    if c is not None:
        out.append(
            f"meshd crash: {c.broken_streams} streams lost "
            f"({'meets' if c.broken_streams == 0 else 'MISSES'} zero)"
        )
    s = report.settings
    for p in report.passes:
        if p.scenario == "scaleup" and p.skipped is None:
            out.append(
                f"scaleup/{p.policy}: {s.scaleup_rate_rps:g} req/s; {s.cold_engines} of "
                f"{s.engines} engines up at "
                f"{s.scaleup_at_s:g} s; TTFT p99 {_f(p.ttft_p99_s, '{:.3f}s')} (after the "
                f"scale-up {_f(p.ttft_p99_after_s, '{:.3f}s')}), ok {100 * p.success:.1f}%, "
                f"$/1k successful tasks {_f(p.usd_per_1k_tasks, '{:.4f}')}; attempts by "
                f"engine {[round(a) for a in p.engine_attempts]}"
            )
    return out


def parse_args(argv: Sequence[str] | None) -> tuple[CascadeSettings, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.cascade", description=__doc__)
    p.add_argument("--quick", action="store_true", help="20 s passes (the default is 60 s)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per pass")
    p.add_argument("--rate", type=float, help="requests per second")
    p.add_argument("--policies", help=f"comma-separated (default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--scenarios", help=f"comma-separated (default {','.join(SCENARIOS)})")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", type=Path, default=Path("results") / "cascade")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    s = QUICK if args.quick else CascadeSettings()
    if args.duration is not None:
        s = replace(s, duration_s=args.duration)
    if args.rate is not None:
        s = replace(s, rate_rps=args.rate)
    if args.seed is not None:
        s = replace(s, seed=args.seed)
    if args.policies:
        names = tuple(n.strip() for n in args.policies.split(",") if n.strip())
        unknown = [n for n in names if n not in POLICIES]
        if unknown:
            p.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
        s = replace(s, policies=names)
    if args.scenarios:
        names = tuple(n.strip() for n in args.scenarios.split(",") if n.strip())
        if any(n not in ALL_SCENARIOS for n in names):
            p.error(f"scenarios are {', '.join(ALL_SCENARIOS)}")
        s = replace(s, scenarios=names)
    return s, args


def main(argv: Sequence[str] | None = None) -> int:
    settings, args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run_cascade(settings, out / "logs", progress=not args.no_progress))
    (out / "cascade.json").write_text(json.dumps(report.to_json(), indent=2))
    print(format_report(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
