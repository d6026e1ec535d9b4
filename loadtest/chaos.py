"""Issue #21's fault campaign: meshd (sidecar, control planes, agents) against simulated
engines, one fault at a time under a steady open-loop load of streamed completions.

    python -m loadtest.chaos [--scenarios a,b] [--quick] [--json PATH]

Each scenario (loadtest/chaos_scenarios.py) starts its own processes (loadtest/chaos_rig.py:
`meshd sim-engine` per engine, `meshd sidecar`, `meshd control-plane`, `meshd agent`),
sends Poisson arrivals (loadtest/chaos_client.py classifies every request: completed,
failed with a clear error, broken mid-body, lost, abandoned), injects its fault at
`fault_at_s` (a one-engine fault hits the engine that has served the most so far: at low
load the picker may keep every request on one engine), clears it at `clear_at_s`, and
after the last client has ended checks that no engine still runs a request (one that
outlived its client). The sidecar's timeouts are shortened to fit
10-20 s scenarios (chaos_rig.sidecar_config); everything else is meshd's default.

`--json PATH` writes {"date", "machine", "settings", "rows": [...]}; each row has:
  scenario, what, skipped (null, or why it did not run), sent, completed, failed, broken,
  lost, abandoned (requests by class; broken: the connection broke mid-body, visible to the
  client's HTTP library but without an SSE error event), resumed (mid-stream failovers,
  meshd_stream_resumes_total{outcome="resumed"}), attempts (meshd_upstream_attempts_total
  over the run), amplification (attempts / requests sent; null where the sidecar
  restarts: its counters die with it), fault_amplification (attempts between the fault and
  its clear / requests that ended in that time), recover_s (from the fault's end to the
  sending of the last request that failed, 0 when none failed after it; null where nothing
  clears), engine_fault and engine_back_s (one-engine faults: from the clear until that
  engine takes a request again; null when it took none before the load ended), outlived
  (requests the engines still ran or queued 5 s after every client had ended),
  goodput_rps and capacity_rps (overload scenarios: completions per second over the load
  after its first 2 s, each spread over its life, and what the fleet completes when kept
  full: its engines' generated tokens / tokens per request), refused_429 /
  with_retry_after (429s and those that carried Retry-After), failures (the first few
  clear errors by text), note (what the fault did), checks (the targets missed: lost 0,
  broken 0 except where the sidecar is killed, amplification <= 1.2 in the 503 storms, the
  slowdown and the latency, outlived 0, goodput >= 90% of capacity with admission).

The latency scenario's sidecar reaches each engine through a delay proxy
(loadtest/chaos_delay.py, in this process), which holds everything the busiest engine
sends for 200 ms during the fault; the other scenarios connect to the engines directly.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench.scrape import GENERATION_TOKENS, parse_metrics
from loadtest.chaos_client import (
    Outcome,
    completion_body,
    one_request,
    open_loop,
)
from loadtest.chaos_rig import (
    HOST_NETNS_ENV,
    Rig,
    in_namespace,
    netns_id,
    netns_unavailable,
)
from loadtest.chaos_scenarios import QUICK, ChaosSettings, Run, Scenario, scenarios

AMPLIFICATION_BOUND = 1.2
GOODPUT_SHARE = 0.9
SETTLE_S = 5.0


@dataclass(slots=True)
class Row:
    scenario: str
    what: str
    skipped: str | None = None
    sent: int = 0
    completed: int = 0
    failed: int = 0
    broken: int = 0
    lost: int = 0
    abandoned: int = 0
    resumed: int = 0
    attempts: int = 0
    amplification: float | None = None
    fault_amplification: float | None = None
    recover_s: float | None = None
    engine_back_s: float | None = None
    outlived: int | None = None
    goodput_rps: float | None = None
    capacity_rps: float | None = None
    engine_fault: bool = False
    refused_429: int = 0
    with_retry_after: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    note: str = ""
    checks: list[str] = field(default_factory=list)


# ---- running one ----------------------------------------------------------------------


async def _generated(run: Run) -> float:
    total = 0.0
    for e in run.rig.engines:
        async with run.session.get(e.url + "/metrics") as r:
            total += parse_metrics(await r.text(), (GENERATION_TOKENS,)).get(GENERATION_TOKENS, 0)
    return total


async def _capacity(run: Run, s: ChaosSettings) -> float:
    """Requests per second the fleet completes when kept full: twice max_num_seqs streams
    per engine (a queue behind every batch) sent to the engines directly; the tokens they
    generate per second over the second half of `calibrate_s` / tokens per request (whole
    batches end together, so counting completions in a short window would alias)."""
    spec = s.load(max_tokens=s.overload_max_tokens, deadline_s=60.0)
    t0 = time.monotonic()

    async def worker(url: str, seed: int) -> None:
        rng = random.Random(seed)
        while True:
            await one_request(run.session, url, completion_body(rng, spec), spec, t0)

    workers = [
        asyncio.create_task(worker(e.url, 1000 * i + j))
        for i, e in enumerate(run.rig.engines)
        for j in range(2 * s.overload_max_num_seqs)
    ]
    try:
        await asyncio.sleep(s.calibrate_s / 2)
        before, t1 = await _generated(run), time.monotonic()
        await asyncio.sleep(s.calibrate_s / 2)
        after, t2 = await _generated(run), time.monotonic()
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    await _settle(run)
    return (after - before) / (t2 - t1) / s.overload_max_tokens


async def _settle(run: Run) -> int | None:
    """Requests the engines still run or queue once every client has ended (after up to
    SETTLE_S for aborts to land); None when no engine answers."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        counts = [await e.in_flight(run.session) for e in run.rig.engines if e.alive]
        known = [c for c in counts if c is not None]
        if not known:
            return None
        left = int(sum(known))
        if left == 0 or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.25)


def _tally(row: Row, outcomes: Sequence[Outcome], clear_at: float | None) -> None:
    row.sent = len(outcomes)
    kinds = collections.Counter(o.kind for o in outcomes)
    row.completed, row.failed = kinds["completed"], kinds["failed"]
    row.broken, row.lost, row.abandoned = kinds["broken"], kinds["lost"], kinds["abandoned"]
    row.refused_429 = sum(1 for o in outcomes if o.status == 429)
    row.with_retry_after = sum(1 for o in outcomes if o.status == 429 and o.retry_after)
    row.failures = dict(
        collections.Counter(
            o.detail for o in outcomes if o.kind in ("failed", "broken", "lost")
        ).most_common(4)
    )
    if clear_at is not None:
        bad = [o.sent_at for o in outcomes if o.kind in ("failed", "broken", "lost")]
        after = [t - clear_at for t in bad if t >= clear_at]
        row.recover_s = round(max(after), 2) if after else 0.0


async def run_scenario(sc: Scenario, s: ChaosSettings, workdir: Path) -> Row:
    row = Row(sc.name, sc.what, engine_fault=sc.engine_fault)
    rig_settings = sc.rig(s) if sc.rig else s.rig()
    spec = sc.load(s) if sc.load else s.load()
    overload = sc.name.startswith("overload")
    async with Rig(rig_settings, workdir / sc.name) as rig:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            run = Run(rig, session, time.monotonic())
            if overload:
                row.capacity_rps = round(await _capacity(run, s), 2)
                spec = replace(spec, rate_rps=s.overload_factor * row.capacity_rps)
            c0 = await rig.sidecar.counters(session)
            run.base = dict(c0)
            run.t0 = time.monotonic()
            load = asyncio.create_task(open_loop(rig.sidecar.url, spec, t0=run.t0))
            side: asyncio.Task[None] | None = None
            back: asyncio.Task[float] | None = None
            window: tuple[float, float, float] | None = None
            try:
                await run.until(s.fault_at_s)
                await run.choose_target()
                await sc.inject(run)
                at_fault = await run.counted()
                if sc.side is not None:
                    side = asyncio.create_task(sc.side(run))
                if sc.clear is not None:
                    await run.until(s.clear_at_s)
                    at_clear = await run.counted()
                    await sc.clear(run)
                    run.clear_at = run.now()
                    if sc.engine_fault:
                        back = asyncio.create_task(_engine_back(run, run.clear_at))
                    window = (
                        s.fault_at_s,
                        run.clear_at,
                        at_clear["attempts"] - at_fault["attempts"],
                    )
                outcomes = await load
                if side is not None:
                    await side
                if back is not None and back.done():
                    row.engine_back_s = back.result()
            finally:
                for t in (load, side, back):
                    if t is not None and not t.done():
                        t.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await t
            counted = await run.counted()
            row.outlived = await _settle(run)
    with (workdir / sc.name / "requests.jsonl").open("w") as f:
        f.writelines(json.dumps(asdict(o)) + "\n" for o in outcomes)
    row.attempts = int(counted["attempts"])
    row.resumed = int(counted["resumed"])
    _tally(row, outcomes, run.clear_at)
    if not sc.restarts_sidecar:
        row.amplification = round(row.attempts / row.sent, 3) if row.sent else None
    if window is not None:
        start, end, attempts = window
        # attempts are counted as they end: so are these requests
        during = sum(1 for o in outcomes if start <= o.ended_at < end)
        row.fault_amplification = round(attempts / during, 3) if during else None
    if overload:
        row.goodput_rps = round(_goodput(outcomes, 2.0, s.duration_s), 2)
    row.note = "; ".join(n for n in run.notes if not n.startswith("CHECK"))
    row.checks = _checks(sc, row, run.notes)
    return row


async def _engine_back(run: Run, since: float) -> float:
    """Seconds from `since` until the faulted engine takes a request again (finished,
    running or waiting more than when asked)."""
    base = await run.target.served(run.session)
    while await run.target.served(run.session) <= base:
        await asyncio.sleep(0.25)
    return round(run.now() - since, 2)


def _goodput(outcomes: Sequence[Outcome], start: float, end: float) -> float:
    """Completions per second over [start, end], each completed request spread over its
    life (sent to last byte): whole batches end together, so counting the completions that
    fall in a window of a few batches' length would alias."""
    done = 0.0
    for o in outcomes:
        if o.kind == "completed" and o.ended_at > o.sent_at:
            overlap = min(end, o.ended_at) - max(start, o.sent_at)
            done += max(0.0, overlap) / (o.ended_at - o.sent_at)
    return done / (end - start)


def _checks(sc: Scenario, row: Row, notes: Sequence[str]) -> list[str]:
    missed = [n.removeprefix("CHECK: ") for n in notes if n.startswith("CHECK")]
    counterfactual = sc.name == "overload-no-admission"
    if row.lost and not counterfactual:
        missed.append(f"lost {row.lost} (want 0)")
    if row.broken and not sc.may_break and not counterfactual:
        missed.append(f"broken {row.broken} (want 0)")
    if sc.amplification_bound:
        for what, amp in (("", row.amplification), (" during the fault", row.fault_amplification)):
            if (amp or 0) > AMPLIFICATION_BOUND:
                missed.append(f"amplification{what} {amp} > {AMPLIFICATION_BOUND}")
    if row.outlived:
        missed.append(f"{row.outlived} upstream requests outlived their clients")
    if sc.name == "overload":
        cap = row.capacity_rps
        if row.goodput_rps is not None and cap and row.goodput_rps < GOODPUT_SHARE * cap:
            missed.append(f"goodput {row.goodput_rps} < 90% of {row.capacity_rps}/s")
        if row.refused_429 != row.with_retry_after:
            missed.append("a 429 without Retry-After")
    return missed


async def run_in_netns(sc: Scenario, s: ChaosSettings, workdir: Path) -> Row:
    """The scenario in a network namespace of its own (engines, sidecar and clients on its
    loopback), by running this module there; its row comes back as JSON."""
    why = netns_unavailable()
    if why is not None:
        return Row(sc.name, sc.what, skipped=why)
    ns = f"meshd-chaos-{os.getpid()}"
    out = workdir / f"{sc.name}.json"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        argv = [sys.executable, "-m", "loadtest.chaos", "--scenarios", sc.name, "--in-netns"]
        argv += ["--settings", json.dumps(asdict(s)), "--json", str(out), "--quiet"]
        argv += ["--workdir", str(workdir / "netns")]
        env = {**os.environ, HOST_NETNS_ENV: netns_id()}
        proc = await asyncio.create_subprocess_exec(*in_namespace(ns, argv), env=env)
        await proc.wait()
        if proc.returncode != 0 or not out.exists():
            return Row(
                sc.name, sc.what, skipped=f"the run in the namespace failed ({proc.returncode})"
            )
        return Row(**json.loads(out.read_text())["rows"][0])
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


# ---- the campaign ---------------------------------------------------------------------


def _overrides(pairs: Sequence[str], base: dict[str, Any]) -> dict[str, Any]:
    """`KEY.PATH=JSON` pairs (a bare word is a string) merged over `base`."""
    from meshd.config import deep_merge

    out = dict(base)
    for pair in pairs:
        key, _, raw = pair.partition("=")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        for part in reversed(key.split(".")):
            value = {part: value}
        out = deep_merge(out, value)
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def table(rows: Sequence[Row]) -> str:
    head = (
        "scenario",
        "sent",
        "ok",
        "failed",
        "broken",
        "lost",
        "resumed",
        "amp (in fault)",
        "recover s",
        "engine back s",
        "outlived",
        "goodput / capacity",
        "misses",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.scenario} | skipped: {r.skipped} |" + " |" * (len(head) - 2))
            continue
        good = (
            f"{r.goodput_rps:g} / {r.capacity_rps:g} req/s"
            if r.goodput_rps is not None and r.capacity_rps
            else "-"
        )
        cells = (
            r.scenario,
            r.sent,
            r.completed,
            r.failed,
            r.broken,
            r.lost,
            r.resumed,
            f"{_fmt(r.amplification)} ({_fmt(r.fault_amplification)})",
            r.recover_s,
            r.engine_back_s if r.engine_back_s is not None or not r.engine_fault else "not in run",
            r.outlived,
            good,
            "; ".join(r.checks) or "none",
        )
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return "\n".join(lines)


def notes(rows: Sequence[Row]) -> str:
    out = []
    for r in rows:
        if r.skipped:
            continue
        parts = [r.what]
        if r.note:
            parts.append(r.note)
        if r.abandoned:
            parts.append(f"{r.abandoned} clients left mid-stream")
        if r.refused_429:
            parts.append(f"{r.refused_429} answered 429 ({r.with_retry_after} with Retry-After)")
        if r.failures:
            parts.append("errors: " + ", ".join(f"{k} x{v}" for k, v in r.failures.items()))
        out.append(f"- {r.scenario}: " + "; ".join(parts))
    return "\n".join(out)


async def campaign(
    names: Sequence[str], s: ChaosSettings, workdir: Path, quiet: bool, in_netns: bool
) -> list[Row]:
    by_name = {sc.name: sc for sc in scenarios(s)}
    rows = []
    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(names), desc="chaos", unit="scenario", file=sys.stderr)
    for name in names:
        sc = by_name[name]
        if bar is not None:
            bar.set_postfix_str(name)
        if sc.netns and not in_netns:
            row = await run_in_netns(sc, s, workdir)
        else:
            try:
                row = await run_scenario(sc, s, workdir)
            except Exception as exc:  # one broken scenario does not end the campaign
                row = Row(sc.name, sc.what, skipped=f"failed to run: {exc!r}"[:300])
        rows.append(row)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    all_names = [sc.name for sc in scenarios(ChaosSettings())]
    p = argparse.ArgumentParser(
        prog="python -m loadtest.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenarios",
        default=",".join(all_names),
        help=f"comma-separated, of: {', '.join(all_names)}",
    )
    p.add_argument("--quick", action="store_true", help="5 s scenarios, short streams")
    p.add_argument("--rate", type=float, default=None, help="requests/s of the steady load")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=JSON",
        help="a sidecar setting for every scenario (reliability.breaker.enabled=false)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--workdir", type=Path, default=None, help="logs (default: a temp dir)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--settings", default=None, help=argparse.SUPPRESS)
    p.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in all_names]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(all_names)}")
    s = QUICK if args.quick else ChaosSettings()
    if args.settings:
        s = ChaosSettings(**json.loads(args.settings))
    if args.rate is not None:
        s = replace(s, rate_rps=args.rate)
    if args.set:
        s = replace(s, sidecar=_overrides(args.set, s.sidecar))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="meshd-chaos-"))
    rows = asyncio.run(campaign(names, s, workdir, args.quiet, args.in_netns))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}"
    if not args.quiet:
        print(f"meshd fault campaign, {stamp}, {machine}; logs in {workdir}\n")
        print(table(rows))
        print()
        print(notes(rows))
    if args.json:
        doc = {
            "date": stamp,
            "machine": machine,
            "settings": asdict(s),
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(doc, indent=2))
    return 1 if any(r.checks for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
