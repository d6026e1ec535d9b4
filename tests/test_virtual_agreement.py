"""The virtual clock agrees with real time: one small workload, one fleet, round robin,
run once over HTTP (SimEngine fleet, in-process meshd sidecar, streaming client on the
wall clock) and once in loadtest.bench.virtual; the answers must be the same.

Tolerance. The engines' timeline is the same model in both runs (the HTTP driver starts
a step when the previous one ends while it is under 20 ms late, CoreConfig.max_lag_s),
so what the real run adds is the path around it: client -> sidecar -> engine and the
SSE events back, a few ms on an idle machine and tens of ms when the two shared cores
are busy, plus wall-clock lateness of the engine's driver beyond max_lag_s. Per request
TTFT must agree within ABS_TTFT_S + REL_TTFT of the virtual figure; the median
difference must stay within MEDIAN_TTFT_S (the systematic part: the hop's cost);
throughput (output tokens over the load's span) within REL_THROUGHPUT, since the span
is dominated by the decode steps both runs share. Token outputs, token counts and the
engines' prefix-cache hits must be identical: round robin's choice does not depend on
time, and requests are spaced (ARRIVAL_GAP_S) far wider than any prefill so that no
cache hit depends on a race.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import replace

import aiohttp

from loadtest.bench.client import ClientSettings, RequestOutcome, request_body, request_headers
from loadtest.bench.fleet import FleetSpec
from loadtest.bench.policies import sidecar_config
from loadtest.bench.results import PolicyResult
from loadtest.bench.stream import StreamMeter
from loadtest.bench.virtual import engine_specs, run_virtual_policy
from loadtest.engine import EngineFleet
from loadtest.workloads import PlannedRequest, shared_prefix
from meshd.config import load_config
from meshd.sidecar import Sidecar

ARRIVAL_GAP_S = 0.12
ABS_TTFT_S = 0.030
REL_TTFT = 0.20
MEDIAN_TTFT_S = 0.015
REL_THROUGHPUT = 0.10


def _workload() -> list[PlannedRequest]:
    reqs = shared_prefix(
        groups=2,
        questions_per_group=6,
        system_prompt_tokens=1200,
        question_tokens=96,
        max_tokens=32,
        seed=3,
    )
    # Evenly spaced instead of Poisson: no two arrivals race for one cache block.
    return [replace(r, at_s=i * ARRIVAL_GAP_S) for i, r in enumerate(reqs)]


async def _real_run(
    fleet_spec: FleetSpec, requests: list[PlannedRequest]
) -> tuple[dict[str, dict[str, object]], list[tuple[float, float]], EngineFleet]:
    fleet = EngineFleet(engine_specs(fleet_spec))
    await fleet.start()
    urls = [e.url for e in fleet]
    sidecar = Sidecar(load_config(None, base=sidecar_config(urls, "round-robin"), env={}))
    await sidecar.start()
    base = f"http://{sidecar.addresses['outbound']}"
    model = fleet[0].spec.model
    out: dict[str, dict[str, object]] = {}
    spans: list[tuple[float, float]] = []
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession() as session:

            async def one(r: PlannedRequest, t0: float) -> None:
                await asyncio.sleep(max(0.0, t0 + r.at_s - loop.time()))
                meter = StreamMeter(keep_text=True)
                started = loop.time()
                async with session.post(
                    base + "/v1/completions",
                    data=request_body(r, r.prompt or "", model),
                    headers=request_headers(r, r.deadline_ms),
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    async for chunk in resp.content.iter_any():
                        meter.feed(chunk, loop.time())
                ended = loop.time()
                s = meter.summary()
                assert s.done and s.first_token_at is not None
                out[r.request_id] = {
                    "text": s.text,
                    "tokens": s.output_tokens,
                    "cached": s.usage_cached_tokens,
                    "ttft": s.first_token_at - started,
                }
                spans.append((started - t0, ended - t0))

            t0 = loop.time()
            await asyncio.gather(*(one(r, t0) for r in requests))
    finally:
        await sidecar.drain_and_stop()
    return out, spans, fleet


def _timing_problems(
    requests: list[PlannedRequest],
    real: dict[str, dict[str, object]],
    spans: list[tuple[float, float]],
    result: PolicyResult,
    virtual: dict[str, RequestOutcome],
) -> list[str]:
    problems = []
    diffs = []
    for r in requests:
        real_ttft = float(real[r.request_id]["ttft"])  # type: ignore[arg-type]
        virt_ttft = virtual[r.request_id].ttft_s
        assert virt_ttft is not None and virt_ttft > 0
        if abs(real_ttft - virt_ttft) > ABS_TTFT_S + REL_TTFT * virt_ttft:
            problems.append(
                f"{r.request_id}: TTFT real {real_ttft:.4f} s, virtual {virt_ttft:.4f} s"
            )
        diffs.append(real_ttft - virt_ttft)
    if abs(statistics.median(diffs)) > MEDIAN_TTFT_S:
        problems.append(f"median TTFT difference {statistics.median(diffs):.4f} s")
    real_span = max(e for _, e in spans) - min(s for s, _ in spans)
    real_tok_s = sum(int(v["tokens"]) for v in real.values()) / real_span  # type: ignore[call-overload]
    if abs(real_tok_s - result.output_tok_s) > REL_THROUGHPUT * result.output_tok_s:
        problems.append(f"output tok/s real {real_tok_s:.1f}, virtual {result.output_tok_s:.1f}")
    return problems


async def test_virtual_clock_agrees_with_real_time() -> None:
    requests = _workload()
    fleet_spec = FleetSpec(gpus=("H100", "A100"), time_scale=1.0)
    result, run = run_virtual_policy(
        "round-robin",
        fleet_spec,
        requests,
        ClientSettings(progress=False),
        capture_text=True,
        log=lambda _: None,
    )
    assert run is not None
    assert result.succeeded == len(requests)
    virtual = {o.request_id: o for o in run.outcomes}
    virtual_hits = [(e.prefix_queries, e.prefix_hits) for e in result.engines]
    assert any(h for _, h in virtual_hits)  # the workload does exercise the cache

    problems: list[str] = []
    # Timing is measured on two cores shared with other work: a stall of the real run
    # (seen: 1.5 s once) is not a disagreement of the models, so it gets one more try.
    # Tokens and counters must agree on every try.
    for _ in range(2):
        real, spans, fleet = await _real_run(fleet_spec, requests)
        try:
            real_hits = [
                (float(e.core.stats.prefix_cache_queries), float(e.core.stats.prefix_cache_hits))
                for e in fleet
            ]
        finally:
            await fleet.stop()
        for r in requests:
            got, want = real[r.request_id], virtual[r.request_id]
            assert got["text"] == run.texts[r.request_id], r.request_id
            assert got["tokens"] == want.output_tokens == r.max_tokens
        # Round robin is deterministic: the same requests met the same caches, unless a
        # stall of the real run held a prefill past the arrival of the next prompt behind
        # the same prefix (seen once in CI: a question found nothing cached where the
        # virtual run had 1,200 tokens), which is timing too and gets the retry.
        problems = [
            f"{r.request_id}: cached real {real[r.request_id]['cached']}, "
            f"virtual {virtual[r.request_id].cached_tokens}"
            for r in requests
            if real[r.request_id]["cached"] != virtual[r.request_id].cached_tokens
        ]
        if real_hits != virtual_hits:
            problems.append(f"prefix cache counters real {real_hits}, virtual {virtual_hits}")
        problems += _timing_problems(requests, real, spans, result, virtual)
        if not problems:
            break
    assert not problems, problems
