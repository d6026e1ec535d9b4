"""Prefill/decode disaggregation measured (issue #25): the same GPUs aggregated and split
prefill/decode, meshd vs round robin, through a real meshd sidecar.

    python -m loadtest.pd_bench [--requests 300] [--rate 5] [--splits 4,5,6] [--out DIR]

Workload, "long prompts and long answers" from the Mooncake synthetic trace
(../shared/data/traces/synthetic_trace.jsonl, loadtest/workloads/traces.py): the rows whose
input is at least `--min-input` tokens (2,000) and whose output is at least `--min-output`
(100), 739 of the trace's 3,993 rows, and whose input + output fit the engines'
`--max-model-len` (32,768: Llama-3.1-8B served at 32k), 700 rows: input mean 15.9k tokens,
output mean 253 (the whole trace: 15.3k and 149). The first `--requests` of them in trace
order, their arrivals (the trace's Poisson process) rescaled to `--rate` requests per
simulated second; prompt lengths x `--prompt-scale` (blocks shrink alike, so the trace's
shared prefixes stay shared), outputs as the trace says. Every request a streamed
completion (`ignore_eos`, `stream_options.include_usage`), sent open loop at its arrival.

Fleets (loadtest/engine, simulated `--gpu` H100s, one seed, a fresh fleet and sidecar per
run): (a) aggregated, `--engines` (8) engines of role both in one pool; (b) disaggregated,
the same engines split P prefill + (engines - P) decode for each P in `--splits`: pool
`prefill` (role prefill) and pool `decode` (role decode, `disaggregation.prefill_pool:
prefill`, `--min-prefill-tokens`, the link `--kv-link` GB/s as the engines' kv_link_gbps).
Routers: `routing.policy: meshd` and `round-robin` (which then also picks both legs).
`--protocol` says how the split fleet's legs speak: `vllm-nixl` (vLLM's NIXL protocol: the
prefill step, then the decode step with its kv_transfer_params; the default) or `sglang`
(SGLang's: the request with bootstrap_host/port/room to a prefill and a decode engine at
once; every request is split, so `--min-prefill-tokens` does not apply); the engines speak
the same one (EngineSpec.pd_protocol). `--faster-whole-margin` (simulated seconds, scaled
to the sidecar's wall clock as below; `off`) and `--faster-whole-stall-weight` set the
decider's rule 4 (filters/disagg.py: a request the prefill pool would keep waiting goes
whole to a decode engine), meshd's defaults unless given.

The engines run at `--engine-time-scale` simulated seconds per wall second (0.5: half
as fast as a real GPU), so that the two shared cores that run the engines, the
sidecar and the client keep up with the token rate and their scheduling noise is small
against a decode step. Times below are simulated seconds (the client's wall clock x the
time scale): what a client of real GPUs would see, with the sidecar's and the loopback's
own time shrunk alike. meshd's admission time constants (knee_wait_s, knee_max_wait_s,
queue_timeout_s: its picker's predicted waits are learnt on the wall clock) are its
defaults / the time scale, so that they keep their meaning in simulated time.

Measured per run: TTFT p50/p90/p99 (planned send to first token event) and ITL p50/p99
(the gaps between a stream's token events, pooled over all successful requests, as vLLM's
benchmark does), success rate (HTTP 200 and a stream ending in [DONE]), $ per successful
task from the sidecar's access log through the cost ledger (filters/cost_ledger.py,
elastic view; both legs of a split request are attempts there; a request is a task): its
figure (each attempt engine-measured where the sidecar read the engine's busy time,
meshd_sim:gpu_busy_seconds_total, apportioned by filters/busy_time.py, else the timing
model; the measured share printed beside) and the timing model's alone, the
engines' own busy GPU-seconds (/admin/state busy_time) priced alike as a cross-check, the
share of requests split (access log `pd`, and meshd_pd_requests_total), a split request's
TTFT by leg (p50/p90 of the prefill leg, arrival to the prefill step's answer, and of the
decode leg, that to the first token: the access log's attempts[].ttft_s), KV transfer refusals
(the engines' meshd_sim:kv_fetch_refused_total), the prefix hit rate (the prefill step's
cached tokens for a split request). Beside them the TTFT floor (loadtest/bench/floor.py:
each request alone on an idle engine that holds every earlier prompt; on the split fleet
plus its KV transfer), whose p90 over round robin's bounds the TTFT ratio from below.

Targets (issue #25): disaggregated meshd's ITL p99 <= 0.6 x aggregated meshd's at equal or
better $ per successful task; meshd's TTFT p90 <= 0.7 x round robin's on the disaggregated
fleet. Writes results.json, requests.jsonl and pd_cdf.png (ITL and TTFT CDFs) into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from loadtest.bench.fleet import EngineInfo
from loadtest.bench.policies import ProcessRouter, start_sidecar_process
from loadtest.bench.stream import StreamMeter
from loadtest.cache_bench import (
    admin_metrics,
    bench_sidecar_config,
    endpoint_entry,
    fmt,
    ledger_of,
    percentile,
    ratio,
    read_records,
    render_table,
    run_loop,
    start_engines,
    usd,
    write_outputs,
)
from loadtest.engine.config import EngineSpec
from loadtest.engine.profiles import get_profile
from loadtest.workloads import MOONCAKE_SYNTHETIC, PlannedRequest, traces_dir
from loadtest.workloads.traces import parse_mooncake
from meshd.access_log import AccessRecord

__all__ = ["PDBenchSettings", "build_workload", "main", "run_bench"]

ROUTERS = {"meshd": "meshd", "rr": "round-robin"}
PROTOCOLS = ("vllm-nixl", "sglang")
ITL_TARGET = 0.6
TTFT_TARGET = 0.7
_ERROR_BYTES = 512


@dataclass(frozen=True, slots=True)
class PDBenchSettings:
    requests: int = 300
    min_input: int = 2000
    min_output: int = 100
    max_model_len: int = 32768  # rows whose input + output fit (Llama-3.1-8B at 32k)
    prompt_scale: float = 1.0
    rate: float = 5.0  # requests per simulated second
    engines: int = 8
    splits: tuple[int, ...] = (4, 5, 6)  # prefill engines of the disaggregated fleet
    gpu: str = "H100"
    engine_time_scale: float = 0.5
    min_prefill_tokens: int | None = None  # None: the config's default
    # The decider's rule 4 margin, simulated seconds: "default" meshd's, None off.
    faster_whole_margin_s: float | str | None = "default"
    faster_whole_stall_weight: float | None = None  # None: meshd's default
    kv_link_gb_per_s: float = 50.0
    protocol: str = "vllm-nixl"  # the split fleet's: vllm-nixl | sglang
    concurrency: int = 1024
    timeout_s: float = 600.0
    seed: int = 0
    traces: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.requests < 1 or self.engines < 2:
            raise ValueError("need requests >= 1 and engines >= 2")
        if not self.splits or any(not 0 < p < self.engines for p in self.splits):
            raise ValueError(f"each split must leave both pools engines: 0 < P < {self.engines}")
        if not (self.rate > 0 and self.engine_time_scale > 0 and self.prompt_scale > 0):
            raise ValueError("rate, engine_time_scale and prompt_scale must be > 0")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.protocol == "sglang" and self.min_prefill_tokens is not None:
            raise ValueError("min_prefill_tokens: not with protocol sglang (every request splits)")
        margin = self.faster_whole_margin_s
        if isinstance(margin, str) and margin != "default":
            raise ValueError(f"faster_whole_margin_s: seconds, 'default' or None, got {margin!r}")
        if isinstance(margin, float | int) and margin < 0:
            raise ValueError("faster_whole_margin_s: must be >= 0")
        weight = self.faster_whole_stall_weight
        if weight is not None and weight < 0:
            raise ValueError("faster_whole_stall_weight: must be >= 0")


# ---- the workload ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    requests: tuple[PlannedRequest, ...]  # at_s in simulated seconds
    source: str
    rows_matching: int
    rows_total: int

    @property
    def span_s(self) -> float:
        return self.requests[-1].at_s if self.requests else 0.0

    def describe(self) -> str:
        n = len(self.requests)
        ins = [r.prompt_tokens or 0 for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return (
            f"{n} requests over {self.span_s:.1f} simulated s ({n / max(self.span_s, 1e-9):.2f}"
            f"/s); prompt tokens mean {sum(ins) / n:,.0f} (p50 {percentile(ins, 0.5):,.0f}, "
            f"max {max(ins):,}), output tokens mean {sum(outs) / n:.0f} (max {max(outs)})"
        )


def build_workload(s: PDBenchSettings) -> Workload:
    """The Mooncake rows with input >= min_input, output >= min_output and both within
    max_model_len, the first
    `s.requests`, arrivals rescaled to `s.rate`, prompts x prompt_scale, outputs as is."""
    path = traces_dir(s.traces) / MOONCAKE_SYNTHETIC
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    chosen: list[str] = []
    outputs: list[int] = []
    for line in lines:
        row = json.loads(line)
        n_in, n_out = row["input_length"], row["output_length"]
        if n_in >= s.min_input and n_out >= s.min_output and n_in + n_out <= s.max_model_len:
            chosen.append(line)
            outputs.append(int(row["output_length"]))
    matching = len(chosen)
    chosen, outputs = chosen[: s.requests], outputs[: s.requests]
    if not chosen:
        raise ValueError("no trace row matches --min-input/--min-output")
    rows = parse_mooncake(chosen, str(path), token_scale=s.prompt_scale, seed=s.seed)
    # parse_mooncake scales max_tokens too and sorts by time: put the trace's outputs back
    # (request ids are "<stem>:<line of `chosen`>", 1-based).
    rows = [replace(r, max_tokens=outputs[int(r.request_id.rsplit(":", 1)[1]) - 1]) for r in rows]
    span = rows[-1].at_s - rows[0].at_s
    # n requests over the span is the trace's own rate; stretch or squeeze to s.rate.
    factor = (len(rows) / s.rate) / span if span > 0 and len(rows) > 1 else 1.0
    t0 = rows[0].at_s
    rows = [replace(r, at_s=(r.at_s - t0) * factor) for r in rows]
    return Workload(tuple(rows), str(path), matching, len(lines))


def completion_body(r: PlannedRequest, model: str) -> bytes:
    body = {
        "model": model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def ttft_floors(s: PDBenchSettings, w: Workload) -> dict[str, Any]:
    """Each request's first token on an idle engine whose cache holds every earlier prompt
    (loadtest/bench/floor.py: the engines' own EngineCore, no queue, no network), and on
    the split fleet that plus its KV transfer over the link: the TTFT no router goes under."""
    from loadtest.bench.floor import floors_on

    spec = EngineSpec(gpu=s.gpu, max_model_len=s.max_model_len, seed=s.seed)
    floors, _ = floors_on(spec, w.requests)
    kv_bytes = get_profile(s.gpu).kv_bytes_per_token
    link = s.kv_link_gb_per_s * 1e9
    agg = list(floors.values())
    pd = [
        floors[r.request_id] + (r.prompt_tokens or 0) * kv_bytes / link
        for r in w.requests
        if r.request_id in floors
    ]
    return {
        "aggregated": {f"p{q}_s": percentile(agg, q / 100) for q in (50, 90, 99)},
        "split": {f"p{q}_s": percentile(pd, q / 100) for q in (50, 90, 99)},
    }


# ---- the client ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's fate; times in simulated seconds (wall x the engines' time scale)."""

    index: int
    request_id: str
    sent_at_s: float
    ok: bool
    status: int
    error: str | None
    ttft_s: float | None
    e2e_s: float
    tokens: int
    gaps: tuple[float, ...] = field(default=(), repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["gaps"]
        out["itl_max_s"] = max(self.gaps) if self.gaps else None
        return out


async def send_all(
    base_url: str,
    planned: Sequence[tuple[str, float, bytes]],
    *,
    time_scale: float,
    concurrency: int,
    timeout_s: float,
    progress: str | None,
) -> tuple[list[Outcome], float]:
    """POST each (request id, simulated arrival, body) to /v1/completions at its wall time
    (arrival / time_scale), open loop; outcomes in order and the wall time taken."""
    bar = _progress(len(planned), progress)
    sem = asyncio.Semaphore(concurrency)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
        auto_decompress=False,
    )
    # Measured on time.monotonic(): uvloop's loop.time() ticks in whole milliseconds (and
    # stands still within a loop iteration), coarse against a 10-20 ms inter-token gap.
    t0 = _now()
    results: dict[int, Outcome] = {}

    async def one(i: int, rid: str, at_s: float, body: bytes) -> None:
        at = t0 + at_s / time_scale
        delay = at - _now()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            results[i] = await _request(session, base_url, i, rid, body, at, t0, time_scale,
                                        timeout_s)  # fmt: skip
        if bar is not None:
            ok = sum(o.ok for o in results.values())
            bar.set_postfix_str(f"ok {ok}/{len(results)}", refresh=False)
            bar.update(1)

    try:
        await asyncio.gather(*(one(i, *p) for i, p in enumerate(planned)))
    finally:
        await session.close()
        if bar is not None:
            bar.close()
    return [results[i] for i in range(len(planned))], _now() - t0


async def _request(
    session: aiohttp.ClientSession,
    base_url: str,
    index: int,
    rid: str,
    body: bytes,
    planned: float,
    t0: float,
    scale: float,
    timeout_s: float,
) -> Outcome:
    meter = StreamMeter()
    status, error = 0, None
    headers = {"Content-Type": "application/json", "x-request-id": rid}
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(base_url + "/v1/completions", data=body,
                                    headers=headers) as resp:  # fmt: skip
                status = resp.status
                if status != 200:
                    raw = await resp.content.read(_ERROR_BYTES)
                    error = f"http_{status}: {raw.decode(errors='replace')[:200]}"
                else:
                    async for chunk in resp.content.iter_any():
                        meter.feed(chunk, _now())
    except TimeoutError:
        error = "timeout"
    except (aiohttp.ClientError, OSError) as exc:
        error = f"connection: {type(exc).__name__}"
    end = _now()
    summary = meter.summary()
    if error is None:
        if summary.error is not None:
            error = f"sse_error: {summary.error}"
        elif not summary.done:
            error = "truncated"
        elif summary.token_events == 0:
            error = "empty"
    first = summary.first_token_at
    return Outcome(
        index=index,
        request_id=rid,
        sent_at_s=(planned - t0) * scale,
        ok=error is None,
        status=status,
        error=error,
        ttft_s=None if first is None else (first - planned) * scale,
        e2e_s=(end - planned) * scale,
        tokens=summary.output_tokens,
        gaps=tuple(g * scale for g in summary.gaps),
    )


_now = time.monotonic


def _progress(total: int, desc: str | None) -> Any:
    if desc is None:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5, leave=False)


# ---- fleets and sidecars ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSpec:
    name: str  # agg-meshd, pd3-rr, ...
    router: str  # meshd | rr
    prefill: int  # 0: aggregated

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0


def run_specs(s: PDBenchSettings) -> list[RunSpec]:
    out = [RunSpec(f"agg-{r}", r, 0) for r in ROUTERS]
    for p in s.splits:
        out += [RunSpec(f"pd{p}-{r}", r, p) for r in ROUTERS]
    return out


def engine_specs(s: PDBenchSettings, run: RunSpec, max_model_len: int) -> list[EngineSpec]:
    base = EngineSpec(
        gpu=s.gpu,
        time_scale=s.engine_time_scale,
        seed=s.seed,
        max_model_len=max_model_len,
        kv_link_gbps=s.kv_link_gb_per_s,
        pd_protocol=s.protocol,
    )
    gpu = s.gpu.lower()
    if not run.disaggregated:
        return [replace(base, name=f"{gpu}-{i}") for i in range(s.engines)]
    return [
        replace(base, name=f"{gpu}-{'p' if i < run.prefill else 'd'}{i}",
                role="prefill" if i < run.prefill else "decode")
        for i in range(s.engines)
    ]  # fmt: skip


def pools_config(
    s: PDBenchSettings, run: RunSpec, engines: Sequence[EngineInfo]
) -> list[dict[str, object]]:
    if not run.disaggregated:
        return [{"name": "default", "endpoints": [endpoint_entry(e) for e in engines]}]
    dis: dict[str, object] = {"prefill_pool": "prefill", "kv_link_gb_per_s": s.kv_link_gb_per_s}
    if s.min_prefill_tokens is not None:
        dis["min_prefill_tokens"] = s.min_prefill_tokens
    if s.protocol != "sglang":
        dis["faster_whole_margin_s"] = faster_whole_margin(s)
        if s.faster_whole_stall_weight is not None:  # a ratio of seconds: not scaled
            dis["faster_whole_stall_weight"] = s.faster_whole_stall_weight
    prefill = [endpoint_entry(e) for e in engines[: run.prefill]]
    if s.protocol == "sglang":
        dis["protocol"] = "sglang"
        # The simulated engines' bootstrap port is their HTTP port (EngineSpec.bootstrap_port).
        prefill = [{**ep, "bootstrap_port": urlsplit(e.url).port}
                   for ep, e in zip(prefill, engines[: run.prefill], strict=True)]  # fmt: skip
    return [
        {"name": "prefill", "role": "prefill", "endpoints": prefill},
        {"name": "decode", "role": "decode", "disaggregation": dis,
         "endpoints": [endpoint_entry(e) for e in engines[run.prefill :]]},
    ]  # fmt: skip


async def engine_states(engines: Sequence[EngineInfo]) -> list[dict[str, Any]]:
    """Each engine's /admin/state and its meshd_sim:kv_fetch_refused_total by reason."""
    from prometheus_client.parser import text_string_to_metric_families

    async def one(http: aiohttp.ClientSession, e: EngineInfo) -> dict[str, Any]:
        state: dict[str, Any] = {"name": e.name, "url": e.url}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
            async with asyncio.timeout(10.0):
                async with http.get(e.url + "/admin/state") as r:
                    state.update(await r.json())
                async with http.get(e.url + "/metrics") as r:
                    text = await r.text()
            refused: dict[str, float] = {}
            for fam in text_string_to_metric_families(text):
                for smp in fam.samples:
                    if smp.name == "meshd_sim:kv_fetch_refused_total" and smp.value:
                        refused[smp.labels.get("reason", "")] = smp.value
                    elif smp.name == "meshd_sim:kv_transfer_seconds_total":
                        state["kv_transfer_s"] = smp.value
            state["kv_fetch_refused"] = refused
        return state

    async with aiohttp.ClientSession() as http:
        return list(await asyncio.gather(*(one(http, e) for e in engines)))


def pd_metrics(text: str) -> dict[str, float]:
    """meshd_pd_requests_total as {"path:reason": n} from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "meshd_pd_requests_total" and smp.value:
                key = f"{smp.labels.get('path', '')}:{smp.labels.get('reason', '')}"
                out[key] = out.get(key, 0.0) + smp.value
    return out


def faster_whole_margin(s: PDBenchSettings) -> float | None:
    """The decode pool's disaggregation.faster_whole_margin_s on the sidecar's wall clock
    (its predicted TTFTs are learnt there, where the engines run 1 / time_scale times
    slower): the setting's simulated seconds (meshd's default when "default") / the time
    scale; None: the rule off."""
    from meshd.config_schema import Disaggregation

    margin = s.faster_whole_margin_s
    if margin == "default":
        margin = Disaggregation.model_fields["faster_whole_margin_s"].default
    if margin is None:
        return None
    assert not isinstance(margin, str)
    return float(margin) / s.engine_time_scale


def admission_times(time_scale: float) -> dict[str, float]:
    """meshd's admission time constants (its defaults) in the engines' simulated time: the
    picker's predicted waits are calibrated on the wall clock, where the engines run
    1 / time_scale times slower than a GPU."""
    from meshd.config_schema import AdmissionSettings

    d = AdmissionSettings()
    assert d.knee_wait_s is not None
    return {
        "knee_wait_s": d.knee_wait_s / time_scale,
        "knee_max_wait_s": d.knee_max_wait_s / time_scale,
        "queue_timeout_s": d.queue_timeout_s / time_scale,
    }


# ---- one run ---------------------------------------------------------------------------


@dataclass(slots=True)
class RunResult:
    spec: RunSpec
    outcomes: list[Outcome]
    records: list[AccessRecord]
    wall_s: float
    engines: list[dict[str, Any]]
    pd_metric: dict[str, float]

    def legs(self, scale: float) -> dict[str, float | None]:
        """A split request's TTFT by leg, in simulated seconds, from the access log: the
        prefill leg (arrival to the prefill step's answer, its attempt's ttft_s) and the
        decode leg (that to the first token: the transfer and the decode engine's wait);
        p50 and p90 over the split requests that streamed a token."""
        pre: list[float] = []
        dec: list[float] = []
        for r in self.records:
            if r.pd != "split" or r.ttft_s is None:
                continue
            steps = [a.ttft_s for a in r.attempts if a.reason == "prefill" and a.ttft_s]
            if steps:
                pre.append(steps[-1] * scale)
                dec.append((r.ttft_s - steps[-1]) * scale)
        return {
            f"{leg}_leg_p{q}_s": percentile(xs, q / 100)
            for leg, xs in (("prefill", pre), ("decode", dec))
            for q in (50, 90)
        }

    def figures(self, s: PDBenchSettings) -> dict[str, Any]:
        n = len(self.outcomes)
        ok = [o for o in self.outcomes if o.ok]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        gaps = [g for o in ok for g in o.gaps]
        ledger = ledger_of(self.records)
        summary = ledger.total
        pd = Counter(r.pd or "-" for r in self.records)
        split = pd.get("split", 0)
        busy = sum(float(e.get("busy_time") or 0.0) for e in self.engines)
        price = sum(float(e.get("price_per_gpu_hour") or 0.0) for e in self.engines)
        busy_usd = sum(
            float(e.get("busy_time") or 0.0) * float(e.get("price_per_gpu_hour") or 0.0) / 3600
            for e in self.engines
        )
        attempts = Counter(f"{a.reason or 'main'}:{a.outcome}" for r in self.records
                           for a in r.attempts)  # fmt: skip
        refused: Counter[str] = Counter()
        for e in self.engines:
            refused.update(e.get("kv_fetch_refused") or {})
        errors = Counter((o.error or "").split(":")[0] for o in self.outcomes if not o.ok)
        prompt = cached = 0
        for r in self.records:
            prompt += r.prompt_tokens or 0
            if r.pd == "split":  # the prefill step's hit (the decode step's is the transfer)
                cached += sum(a.cached_tokens or 0 for a in r.attempts if a.reason == "prefill")
            else:
                cached += r.cached_tokens or 0
        return {
            "run": self.spec.name,
            "router": ROUTERS[self.spec.router],
            "fleet": f"{self.spec.prefill}P+{s.engines - self.spec.prefill}D"
            if self.spec.disaggregated
            else f"{s.engines} aggregated",
            "requests": n,
            "ok": len(ok),
            "success_rate": len(ok) / n if n else 0.0,
            "client_errors": dict(errors),
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p90_s": percentile(ttft, 0.9),
            "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(gaps, 0.5),
            "itl_p90_s": percentile(gaps, 0.9),
            "itl_p99_s": percentile(gaps, 0.99),
            "itl_gaps": len(gaps),
            "e2e_p50_s": percentile([o.e2e_s for o in ok], 0.5),
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "gpu_seconds": summary.gpu_seconds,
            "cost_usd": summary.cost_usd,
            "tasks_ok": summary.tasks_succeeded,
            "usd_per_ok_task": summary.cost_per_successful_task,
            # The ledger's two readings: the timing model alone, and the share of its $ that
            # engines measured (busy time apportioned, filters/busy_time.py).
            "modelled_usd_per_ok_task": summary.modelled_cost_per_successful_task,
            "measured_share": ledger.measured_share,
            "readings": {k: asdict(v) for k, v in ledger.readings.items()},
            "waste_usd": summary.waste.total,
            "busy_gpu_seconds": busy,
            "busy_usd": busy_usd,
            "busy_usd_per_ok_task": busy_usd / len(ok) if ok else None,
            "fleet_usd_per_hour": price,
            "logged": len(self.records),
            "pd": dict(pd),
            "split_share": split / len(self.records) if self.records else 0.0,
            **self.legs(s.engine_time_scale),
            "pd_metric": self.pd_metric,
            "attempts": dict(sorted(attempts.items())),
            "kv_fetch_refused": dict(refused),
            "kv_transfer_s": sum(float(e.get("kv_transfer_s") or 0.0) for e in self.engines),
            "engine_steps": sum(int(e.get("steps") or 0) for e in self.engines),
            "wall_s": self.wall_s,
        }


async def run_one(s: PDBenchSettings, run: RunSpec, workload: Workload, workdir: Path) -> RunResult:
    """A fresh fleet and sidecar (cold caches), the workload, then the logs and states."""
    workdir.mkdir(parents=True, exist_ok=True)
    specs = engine_specs(s, run, s.max_model_len)
    fleet = await start_engines(specs, workdir / "engines.log")
    access = workdir / "access.jsonl"
    access.unlink(missing_ok=True)
    router: ProcessRouter | None = None
    wall_timeout = s.timeout_s / s.engine_time_scale
    try:
        config = bench_sidecar_config(
            pools_config(s, run, fleet.engines),
            access,
            routing={"policy": ROUTERS[run.router]},
            upstream={
                "first_byte_timeout_s": wall_timeout,
                "idle_timeout_s": wall_timeout,
                "request_timeout_s": wall_timeout,
            },
            reliability={"admission": admission_times(s.engine_time_scale)},
        )
        router = await start_sidecar_process(config, workdir)
        planned = [
            (f"{run.name}-{i}", r.at_s, completion_body(r, specs[0].model))
            for i, r in enumerate(workload.requests)
        ]
        outcomes, wall = await send_all(
            router.url,
            planned,
            time_scale=s.engine_time_scale,
            concurrency=s.concurrency,
            timeout_s=wall_timeout,
            progress=run.name if s.progress else None,
        )
        metric = pd_metrics(await admin_metrics(router))
        states = await engine_states(fleet.engines)
    finally:
        if router is not None:
            await router.stop()  # drains: the access log is flushed
        await fleet.stop()
    return RunResult(run, outcomes, read_records(access), wall, states, metric)


# ---- the report ------------------------------------------------------------------------


def sms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.1f}"


def runs_table(figs: Sequence[Mapping[str, Any]]) -> str:
    head = ("run", "fleet", "router", "ok", "TTFT p50", "p90", "p99", "ITL p50", "p99",
            "hit", "$/ok task", "measured", "model $/ok", "busy $/ok", "split")  # fmt: skip
    rows = [
        [
            f["run"],
            f["fleet"],
            f["router"],
            f"{f['ok']}/{f['requests']}",
            sms(f["ttft_p50_s"]),
            sms(f["ttft_p90_s"]),
            sms(f["ttft_p99_s"]),
            sms(f["itl_p50_s"]),
            sms(f["itl_p99_s"]),
            f"{f['prefix_hit_rate']:.0%}",
            usd(f["usd_per_ok_task"]),
            fmt(f["measured_share"], "{:.0%}"),
            usd(f["modelled_usd_per_ok_task"]),
            usd(f["busy_usd_per_ok_task"]),
            f"{f['split_share']:.0%}",
        ]
        for f in figs
    ]
    return render_table(head, rows)


def targets(
    by_run: Mapping[str, Mapping[str, Any]],
    splits: Sequence[int],
    floor_p90_s: float | None = None,
) -> dict[str, Any]:
    """Per split: the two targets' ratios and verdicts; `best` the split that passes most
    (ties: the lower TTFT ratio). The ITL target's $ condition is the cost ledger's $ per
    successful task (<= aggregated meshd's): engine-measured where the sidecar read the
    engines' busy time, as the ledger charges it; `modelled_usd_per_ok_task_ratio` is the
    ledger's timing model alone, `itl_target_pass_busy_usd` judges it by the engines' busy
    GPU-seconds instead. `ttft_ratio_bound`: the split fleet's TTFT floor p90
    over round robin's p90, under which no router's ratio can go."""
    agg = by_run["agg-meshd"]
    out: dict[str, Any] = {}
    for p in splits:
        pd, rr = by_run[f"pd{p}-meshd"], by_run[f"pd{p}-rr"]
        itl = ratio(pd["itl_p99_s"], agg["itl_p99_s"])
        cost = ratio(pd["usd_per_ok_task"], agg["usd_per_ok_task"])
        modelled = ratio(pd["modelled_usd_per_ok_task"], agg["modelled_usd_per_ok_task"])
        busy_cost = ratio(pd["busy_usd_per_ok_task"], agg["busy_usd_per_ok_task"])
        ttft = ratio(pd["ttft_p90_s"], rr["ttft_p90_s"])
        itl_ok = itl is not None and itl <= ITL_TARGET
        cost_ok = cost is not None and cost <= 1.0
        busy_ok = busy_cost is not None and busy_cost <= 1.0
        out[f"pd{p}"] = {
            "split": f"{p}P+{pd['fleet'].split('+')[1]}",
            "itl_p99_ratio": itl,
            "usd_per_ok_task_ratio": cost,
            "usd_equal_or_better": cost_ok,
            "modelled_usd_per_ok_task_ratio": modelled,
            "measured_share": (pd["measured_share"], agg["measured_share"]),
            "busy_usd_per_ok_task_ratio": busy_cost,
            "itl_target_pass": itl_ok and cost_ok,
            "itl_target_pass_busy_usd": itl_ok and busy_ok,
            "ttft_p90_ratio_vs_rr": ttft,
            "ttft_target_pass": ttft is not None and ttft <= TTFT_TARGET,
            "ttft_ratio_bound": ratio(floor_p90_s, rr["ttft_p90_s"]),
        }

    def rank(k: str) -> tuple[int, int, float]:
        t = out[k]
        passed = t["itl_target_pass"] + t["ttft_target_pass"]
        return (-passed, -t["itl_target_pass_busy_usd"], t["ttft_p90_ratio_vs_rr"] or 9e9)

    best = min(out, key=rank) if out else None
    return {"splits": out, "best": best}


def targets_table(t: Mapping[str, Any]) -> str:
    rows = []
    for k, v in t["splits"].items():
        rows.append([
            k + (" (best)" if k == t["best"] else ""),
            fmt(v["itl_p99_ratio"], "{:.3f}x"),
            fmt(v["usd_per_ok_task_ratio"], "{:.4f}x"),
            "/".join(fmt(x, "{:.0%}") for x in v["measured_share"]),
            fmt(v["modelled_usd_per_ok_task_ratio"], "{:.4f}x"),
            fmt(v["busy_usd_per_ok_task_ratio"], "{:.3f}x"),
            "PASS" if v["itl_target_pass"] else "FAIL",
            "PASS" if v["itl_target_pass_busy_usd"] else "FAIL",
            fmt(v["ttft_p90_ratio_vs_rr"], "{:.3f}x"),
            fmt(v["ttft_ratio_bound"], "{:.3f}x"),
            "PASS" if v["ttft_target_pass"] else "FAIL",
        ])  # fmt: skip
    head = ("split", "ITL p99 pd/agg (<=0.6)", "$/ok pd/agg (<=1)", "measured pd/agg",
            "model $ pd/agg", "busy $ pd/agg",
            "ITL target", "(busy $)", "TTFT p90 meshd/rr (<=0.7)", "floor/rr",
            "TTFT target")  # fmt: skip
    return render_table(head, rows)


def write_plot(path: Path, results: Sequence[RunResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for res in results:
        ok = [o for o in res.outcomes if o.ok]
        style = "-" if res.spec.router == "meshd" else "--"
        gaps = sorted(g * 1000 for o in ok for g in o.gaps if g > 0)
        if gaps:
            ys = [(i + 1) / len(gaps) for i in range(len(gaps))]
            ax1.step(gaps, ys, where="post", linestyle=style, label=res.spec.name)
        ttft = sorted(o.ttft_s * 1000 for o in ok if o.ttft_s is not None)
        if ttft:
            ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
            ax2.step(ttft, ys, where="post", linestyle=style, label=res.spec.name)
    for ax, what in ((ax1, "ITL (ms, simulated)"), (ax2, "TTFT (ms, simulated)")):
        ax.set_xscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("share")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_title("inter-token latency CDF (gaps > 0)")
    ax2.set_title("TTFT CDF")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def header_lines(s: PDBenchSettings, w: Workload) -> list[str]:
    splits = ", ".join(f"{p}P+{s.engines - p}D" for p in s.splits)
    return [
        "prefill/decode disaggregation bench (issue #25): meshd sidecar, aggregated vs split",
        f"workload: {w.source}: rows with input >= {s.min_input} and output >= {s.min_output} "
        f"tokens, input + output <= {s.max_model_len} ({w.rows_matching} of {w.rows_total}), "
        f"first {len(w.requests)}; arrivals "
        f"rescaled to {s.rate:g}/s; prompts x {s.prompt_scale:g}, outputs as the trace",
        f"  {w.describe()}",
        "  every request: streamed /v1/completions, ignore_eos, include_usage, open loop",
        f"fleets: {s.engines} x simulated {s.gpu} (one seed), engine time scale "
        f"{s.engine_time_scale:g} (times below are simulated, ms); aggregated, and split "
        f"{splits}; KV link {s.kv_link_gb_per_s:g} GB/s; protocol {s.protocol}; "
        f"min_prefill_tokens "
        f"{'default' if s.min_prefill_tokens is None else s.min_prefill_tokens}; "
        f"faster_whole_margin_s {_margin_text(s)}; "
        "a fresh fleet and sidecar per run",
    ]


async def run_bench(s: PDBenchSettings, out: Path) -> dict[str, Any]:
    """Every run; prints the tables and writes results.json, requests.jsonl, pd_cdf.png."""
    workload = build_workload(s)
    for line in header_lines(s, workload):
        print(line, flush=True)
    t0 = time.monotonic()
    floors = ttft_floors(s, workload)
    results: list[RunResult] = []
    for spec in run_specs(s):
        res = await run_one(s, spec, workload, out / spec.name)
        results.append(res)
        f = res.figures(s)
        print(
            f"  {spec.name}: {f['ok']}/{f['requests']} ok, TTFT p90 {sms(f['ttft_p90_s'])} ms, "
            f"ITL p99 {sms(f['itl_p99_s'])} ms, split {f['split_share']:.0%}"
            + (
                f" (legs p90: prefill {sms(f['prefill_leg_p90_s'])}, decode "
                f"{sms(f['decode_leg_p90_s'])} ms)"
                if f["prefill_leg_p90_s"] is not None
                else ""
            )
            + f", {res.wall_s:.0f} s wall",
            file=sys.stderr,
            flush=True,
        )
    figs = [r.figures(s) for r in results]
    by_run = {f["run"]: f for f in figs}
    t = targets(by_run, s.splits, floors["split"]["p90_s"])
    print()
    print(runs_table(figs))
    print("(times in simulated ms; $/ok task: the cost ledger over the access log, elastic, "
          "engine-measured where the sidecar read an engine's busy time (measured: that "
          "share of its $), else its timing model; model $/ok: the timing model alone; "
          "busy $/ok: the engines' busy GPU-seconds at their price)")  # fmt: skip
    fa, fs = floors["aggregated"], floors["split"]
    print(
        f"TTFT floor (an idle engine holding every earlier prompt; loadtest/bench/floor.py): "
        f"p50/p90/p99 {sms(fa['p50_s'])}/{sms(fa['p90_s'])}/{sms(fa['p99_s'])} ms; split, "
        f"with the KV transfer: {sms(fs['p50_s'])}/{sms(fs['p90_s'])}/{sms(fs['p99_s'])} ms"
    )
    print()
    print(targets_table(t))
    print(
        "ITL target: ITL p99 ratio <= 0.6 and the ledger's $/ok task <= aggregated meshd's "
        "(its figure: engine-measured where read, else modelled; model $: the timing model "
        "alone); (busy $): the same judged by the engines' busy GPU-seconds. floor/rr: the split "
        "floor's p90 / round robin's TTFT p90, the least ratio any router could reach"
    )
    for f in figs:
        extra = []
        if f["client_errors"]:
            extra.append(f"errors {f['client_errors']}")
        if f["kv_fetch_refused"]:
            extra.append(f"KV fetch refused {f['kv_fetch_refused']}")
        if f["pd"] and set(f["pd"]) != {"-"}:
            extra.append(f"pd {f['pd']}")
        if extra:
            print(f"{f['run']}: " + "; ".join(extra))
    doc = {
        "bench": "pd_bench",
        "settings": asdict(s),
        "workload": {
            "source": workload.source,
            "rows_matching": workload.rows_matching,
            "requests": len(workload.requests),
            "span_s": workload.span_s,
            "prompt_tokens_mean": sum(r.prompt_tokens or 0 for r in workload.requests)
            / len(workload.requests),
            "output_tokens_mean": sum(r.max_tokens for r in workload.requests)
            / len(workload.requests),
        },
        "runs": by_run,
        "engines": {r.spec.name: r.engines for r in results},
        "ttft_floor": floors,
        "targets": t,
        "wall_s": time.monotonic() - t0,
    }
    rows = [("run", r.spec.name, o) for r in results for o in r.outcomes]
    write_outputs(out, doc, rows, "pd_cdf.png", lambda path: write_plot(path, results))
    return doc


def parse_args(argv: Sequence[str] | None) -> tuple[PDBenchSettings, argparse.Namespace]:
    d = PDBenchSettings()
    p = argparse.ArgumentParser(
        prog="python -m loadtest.pd_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=d.requests, help=f"default {d.requests}")
    p.add_argument("--min-input", type=int, default=d.min_input, help="trace rows' input >=")
    p.add_argument("--min-output", type=int, default=d.min_output, help="trace rows' output >=")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="the engines' max_model_len; rows whose input + output fit",
    )
    p.add_argument(
        "--prompt-scale",
        type=float,
        default=d.prompt_scale,
        help="prompt lengths x this (default 1)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=d.rate,
        help=f"requests per simulated second (default {d.rate:g})",
    )
    p.add_argument("--engines", type=int, default=d.engines, help=f"default {d.engines}")
    p.add_argument(
        "--splits",
        default=",".join(map(str, d.splits)),
        help="prefill engines of each split fleet, comma-separated (default 4,5,6)",
    )
    p.add_argument("--gpu", default=d.gpu, help=f"simulated GPU (default {d.gpu})")
    p.add_argument(
        "--engine-time-scale",
        type=float,
        default=d.engine_time_scale,
        help=f"simulated seconds per wall second (default {d.engine_time_scale:g})",
    )
    p.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=None,
        help="the decode pool's disaggregation.min_prefill_tokens (default: meshd's)",
    )
    p.add_argument(
        "--faster-whole-margin",
        default="default",
        help="the decode pool's disaggregation.faster_whole_margin_s in simulated seconds "
        "(scaled to the sidecar's wall clock), 'off', or 'default' (meshd's)",
    )
    p.add_argument(
        "--faster-whole-stall-weight",
        type=float,
        default=None,
        help="the decode pool's disaggregation.faster_whole_stall_weight (default: meshd's)",
    )
    p.add_argument("--kv-link", type=float, default=d.kv_link_gb_per_s, help="GB/s (50)")
    p.add_argument(
        "--protocol",
        default=d.protocol,
        choices=PROTOCOLS,
        help="the split fleet's disaggregated-serving protocol (default vllm-nixl)",
    )
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="in flight at most")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per request, simulated s")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--traces", default=None, help="traces dir (default ../shared/data/traces)")
    p.add_argument("--out", type=Path, default=None, help="default results/pd-bench-<time>")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        s = PDBenchSettings(
            requests=args.requests,
            min_input=args.min_input,
            min_output=args.min_output,
            max_model_len=args.max_model_len,
            prompt_scale=args.prompt_scale,
            rate=args.rate,
            engines=args.engines,
            splits=tuple(int(x) for x in args.splits.split(",") if x.strip()),
            gpu=args.gpu.upper(),
            engine_time_scale=args.engine_time_scale,
            min_prefill_tokens=args.min_prefill_tokens,
            faster_whole_margin_s=_margin_arg(args.faster_whole_margin),
            faster_whole_stall_weight=args.faster_whole_stall_weight,
            kv_link_gb_per_s=args.kv_link,
            protocol=args.protocol,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            seed=args.seed,
            traces=args.traces,
            progress=not args.no_progress,
        )
    except ValueError as exc:
        p.error(str(exc))
    return s, args


def _margin_text(s: PDBenchSettings) -> str:
    if s.protocol == "sglang":
        return "n/a"
    m = faster_whole_margin(s)
    if m is None:
        return "off"
    w = s.faster_whole_stall_weight
    return f"{m * s.engine_time_scale:g} s (simulated), stall weight " + (
        "default" if w is None else f"{w:g}"
    )


def _margin_arg(text: str) -> float | str | None:
    if text in ("default", "off"):
        return None if text == "off" else text
    try:
        return float(text)
    except ValueError:
        what = f"--faster-whole-margin: seconds, 'off' or 'default', got {text!r}"
        raise ValueError(what) from None


def main(argv: Sequence[str] | None = None) -> int:
    s, args = parse_args(argv)
    out = args.out or Path("results") / time.strftime("pd-bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    run_loop(run_bench(s, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
