"""The sidecar's garbage-collector pauses and event-loop stalls while it follows the control
plane and relays requests (issue #23's 44 ms full collections; issue #22's TTFB p99).

One real sidecar process (`meshd.sidecar.serve`, as `meshd sidecar` runs it, on uvloop)
follows a real control plane (its own process, frames port) that publisher processes
write `--rate` engine updates/s into (loadtest/xds_apply_bench.py's set-up, 1,000 engines
by default), and relays `--requests` streamed completions/s (Poisson) to a stub backend.
Inside the sidecar the bench records every collection (gc.callbacks: generation, pause)
and the event loop's lag (a task asleep `LAG_PERIOD_S` at a time: how late it wakes).
Outside, each request's time to first byte. The control plane's collections are recorded
too (its own columns, `CP`): it is started as `meshd control-plane` starts it.

Arms, alternated `--rounds` times, each a fresh set of processes:
- `head`: the sidecar and the control plane without meshd.heap.settle (no freeze after
  start), as before;
- `freeze`: as shipped (gc.collect(); gc.freeze() after start);
- `freeze+tN`: as shipped, then the gen-0 threshold set to N (gc.set_threshold(N)).

Run: .venv/bin/python -m loadtest.gc_pause_bench [--arms head,freeze] [--rounds 2]
     [--duration 30] [--rate 10000] [--engines 1000] [--requests 20] [--json PATH]

--json PATH writes {"runs": [{"arm", "window_s", "updates_applied_per_s", "requests",
"gc": {generation: {"count", "max_ms", "p99_ms", "sum_ms"}}, "control_plane_gc" (the
same, the control plane's), "lag_ms": {"p50", "p99",
"p999", "max"}, "stalls_over_10ms", "ttfb_ms": {"p50", "p99", "max"}, "sidecar_cpu_share",
"frozen", "held_at_exit", "young_at_collections"}]}.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import yaml

from loadtest import procstats

LAG_PERIOD_S = 0.005
YOUNG_SAMPLE = 20  # --verbose: every 20th collection's young generation, by type
T = "type.googleapis.com/meshd.v1.EndpointState"  # as loadtest/xds_apply_bench.py's
STUB_MODEL = "stub-model"


# -- inside the sidecar process -----------------------------------------------------------


def child(argv: Sequence[str]) -> int:
    """The sidecar as `meshd sidecar --config` runs it, with the recorders; writes what
    they recorded to --out as it exits."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arm", default="freeze")
    args = ap.parse_args(argv)

    import uvloop

    import meshd.sidecar
    from meshd.config import load_config

    config = load_config(args.config)
    logging.basicConfig(level="WARNING")
    frozen = [0]
    if args.arm == "head":
        meshd.sidecar.settle = lambda: 0
    else:
        shipped: Callable[[], int] = meshd.sidecar.settle
        threshold = int(args.arm.split("+t", 1)[1]) if "+t" in args.arm else None

        def settle() -> int:
            n = shipped()
            if threshold is not None:
                gc.set_threshold(threshold, *gc.get_threshold()[1:])
            frozen[0] = n
            return n

        meshd.sidecar.settle = settle

    pauses: list[tuple[float, int, float]] = []
    started = [0.0]
    clock = time.monotonic

    young: Counter[str] = Counter()

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            # What a young collection finds (every YOUNG_SAMPLE-th, untimed): what the
            # process allocates that the collector tracks, by type.
            if info["generation"] == 0 and len(pauses) % YOUNG_SAMPLE == 0:
                young.update(type(o).__name__ for o in gc.get_objects(0))
            started[0] = clock()
        else:
            pauses.append((started[0], info["generation"], clock() - started[0]))

    gc.callbacks.append(on_gc)
    lags: list[tuple[float, float]] = []

    async def sample_lag() -> None:
        while True:
            due = clock() + LAG_PERIOD_S
            await asyncio.sleep(LAG_PERIOD_S)
            now = clock()
            lags.append((now, now - due))

    async def main() -> int:
        task = asyncio.create_task(sample_lag())
        try:
            return await meshd.sidecar.serve(config)
        finally:
            task.cancel()

    try:
        return uvloop.run(main())
    finally:
        gc.callbacks.remove(on_gc)
        # What the generations not frozen hold as it stops (with the freeze: what the
        # process added to them since its start), by type.
        held = Counter(type(o).__name__ for g in range(3) for o in gc.get_objects(g))
        recorded = {
            "gc": pauses,
            "lag": lags,
            "frozen": frozen[0],
            "held": held.most_common(12),
            "young": young.most_common(12),
        }
        Path(args.out).write_text(json.dumps(recorded))


def _control_plane(conn: Connection, arm: str) -> None:
    """xds_apply_bench's control plane (frames port included), started as `meshd
    control-plane` starts it (settled, but in the `head` arm), its collections recorded;
    sends them back once told to stop."""
    from meshd.heap import settle
    from xds.server import ControlPlane

    pauses: list[tuple[float, int, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.monotonic()
        else:
            pauses.append((started[0], info["generation"], time.monotonic() - started[0]))

    async def main() -> None:
        cp = ControlPlane()
        port = await cp.start("127.0.0.1", 0, publish_port=0)
        if arm != "head":
            settle()
        gc.callbacks.append(on_gc)
        conn.send(port)
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, conn.recv) == "responses":
            conn.send(cp.stats.responses[T])
        await cp.stop(0)

    asyncio.run(main())
    gc.callbacks.remove(on_gc)
    conn.send(pauses)


def _gc_summary(
    recorded: Sequence[Sequence[float]], start: float, end: float
) -> dict[str, dict[str, float]]:
    """Per generation: the collections begun in [start, end], the longest, p99, the sum."""
    pauses = [(int(g), d * 1e3) for t, g, d in recorded if start <= t <= end]
    out: dict[str, dict[str, float]] = {}
    for g in range(3):
        ds = [d for gg, d in pauses if gg == g]
        out[str(g)] = {
            "count": len(ds),
            "max_ms": max(ds, default=0.0),
            "p99_ms": _pct(ds, 99) if ds else 0.0,
            "sum_ms": sum(ds),
        }
    return out


# -- the bench ----------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


async def _requests(url: str, rate: float, duration_s: float) -> list[float]:
    from loadtest.openloop import Endpoint, LoadGenerator, completion_request

    gen = LoadGenerator([Endpoint.parse(url)], completion_request(max_tokens=16, model=STUB_MODEL))
    await gen.prewarm(4)
    samples = await gen.open_loop(rate, duration_s)
    await gen.close()
    return [s.ttfb for s in samples if s.ok]


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    from loadtest.overhead import start_child
    from loadtest.xds_apply_bench import _publisher, _scrape, sidecar_config

    ctx = mp.get_context("spawn")
    procs: list[Any] = []

    def spawn(target: Callable[..., None], *a: Any) -> Connection:
        parent, conn = ctx.Pipe()
        p = ctx.Process(target=target, args=(conn, *a), daemon=True)
        p.start()
        procs.append(p)
        return parent

    children: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="gc-pause-") as tmp:
        work = Path(tmp)
        try:
            cp = spawn(_control_plane, arm)
            port = cp.recv()
            pubs = []
            if args.rate > 0:
                pubs = [
                    spawn(
                        _publisher,
                        port,
                        list(range(k, args.engines, args.publishers)),
                        args.rate / args.publishers,
                        args.batch,
                        8,
                    )
                    for k in range(args.publishers)
                ]
                for p in pubs:
                    if p.recv() != "published":
                        raise RuntimeError("a publisher did not start")
            stub = start_child(
                "stub",
                [sys.executable, "-m", "loadtest.stub_backend", "--port", "0", "--tokens", "16"],
                work,
                30.0,
            )
            children.append(stub)
            config = sidecar_config(args.engines, f"127.0.0.1:{port}")
            stub_url = f"http://127.0.0.1:{stub.ready['port']}"
            config["pools"].insert(
                0, {"name": "stub", "models": [STUB_MODEL], "endpoints": [stub_url]}
            )
            path = work / "sidecar.yaml"
            path.write_text(yaml.safe_dump(config))
            out = work / "recorded.json"
            cmd = [sys.executable, "-m", "loadtest.gc_pause_bench", "--child"]
            cmd += ["--config", str(path), "--out", str(out), "--arm", arm]
            sidecar = start_child("sidecar", cmd, work, 60.0)
            children.append(sidecar)
            admin = str(sidecar.ready["admin"])
            deadline = time.monotonic() + 60
            # --rate 0: nothing published, nothing followed; requests alone.
            while args.rate > 0 and _scrape(admin)[1] < args.engines:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sidecar follows {_scrape(admin)[1]:.0f} engines")
                time.sleep(0.1)
            start = time.monotonic() + 0.5
            end = start + args.duration
            for p in pubs:
                p.send((start, end))
            while time.monotonic() < start:
                time.sleep(0.01)
            u0 = _scrape(admin)[0]
            s0 = procstats.sample(sidecar.proc.pid)
            ttfbs: list[float] = []
            if args.requests > 0:
                ttfbs = asyncio.run(
                    _requests(f"http://{sidecar.ready['outbound']}", args.requests, args.duration)
                )
            time.sleep(max(0.0, end - time.monotonic()))
            s1 = procstats.sample(sidecar.proc.pid)
            window = time.monotonic() - start
            u1 = _scrape(admin)[0]
            for p in pubs:
                p.recv()
            sidecar.stop()
            children.remove(sidecar)
            cp.send("stop")
            cp_recorded = cp.recv()
            recorded = json.loads(out.read_text())
        finally:
            for c in children:
                c.stop()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    lags = [lag for t, lag in recorded["lag"] if start <= t <= end]
    gcs = _gc_summary(recorded["gc"], start, end)
    lag_ms = [x * 1e3 for x in lags]
    ttfb_ms = [x * 1e3 for x in ttfbs]
    return {
        "arm": arm,
        "window_s": window,
        "updates_applied_per_s": (u1 - u0) / window,
        "requests": len(ttfbs),
        "gc": gcs,
        "control_plane_gc": _gc_summary(cp_recorded, start, end),
        "lag_ms": {
            "p50": _pct(lag_ms, 50),
            "p99": _pct(lag_ms, 99),
            "p999": _pct(lag_ms, 99.9),
            "max": max(lag_ms, default=float("nan")),
        },
        "stalls_over_10ms": sum(1 for x in lag_ms if x > 10),
        "ttfb_ms": {
            "p50": _pct(ttfb_ms, 50),
            "p99": _pct(ttfb_ms, 99),
            "max": max(ttfb_ms, default=float("nan")),
        },
        "sidecar_cpu_share": s1.cpu_since(s0) / window,
        "frozen": recorded["frozen"],
        "held_at_exit": recorded["held"],
        "young_at_collections": recorded["young"],
    }


def _row(r: dict[str, Any]) -> str:
    g, cp = r["gc"], r["control_plane_gc"]
    return (
        f"{r['arm']:>14}{r['updates_applied_per_s']:>10,.0f}{r['frozen']:>8}"
        + "".join(f"{g[k]['count']:>8}{g[k]['max_ms']:>7.1f}" for k in "012")
        + f"{g['2']['sum_ms']:>8.0f}"
        + f"{r['lag_ms']['p99']:>8.2f}{r['lag_ms']['p999']:>8.2f}{r['lag_ms']['max']:>8.1f}"
        + f"{r['stalls_over_10ms']:>6}"
        + f"{r['ttfb_ms']['p50']:>7.2f}{r['ttfb_ms']['p99']:>7.2f}{r['ttfb_ms']['max']:>7.1f}"
        + f"{r['sidecar_cpu_share']:>7.1%}"
        + f"{cp['0']['count'] + cp['1']['count']:>8}{cp['2']['count']:>4}{cp['2']['max_ms']:>8.1f}"
    )


HEADER = (
    f"{'arm':>14}{'applied/s':>10}{'frozen':>8}"
    + "".join(f"{'gen' + k + ' n':>8}{'max ms':>7}" for k in "012")
    + f"{'gen2 ms':>8}"
    + f"{'lag p99':>8}{'p99.9':>8}{'max':>8}{'>10ms':>6}"
    + f"{'ttfb50':>7}{'p99':>7}{'max':>7}{'CPU':>7}"
    + f"{'CP 0+1':>8}{'2':>4}{'max ms':>8}"
)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="head,freeze")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of each window")
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=10_000, help="engine updates/s published")
    ap.add_argument("--batch", type=int, default=50, help="engines a publish")
    ap.add_argument("--publishers", type=int, default=2)
    ap.add_argument("--requests", type=float, default=20.0, help="requests/s relayed")
    ap.add_argument(
        "--verbose", action="store_true", help="each run: what the generations not frozen held"
    )
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    print(
        f"{args.engines} engines, {args.rate:,.0f} updates/s asked, {args.requests:g} "
        f"requests/s, {args.duration:g} s windows; gen N n / max ms: collections and the "
        f"longest; lag: the event loop's, sampled every {LAG_PERIOD_S * 1e3:g} ms"
    )
    print(HEADER, flush=True)
    runs = []
    for k in range(args.rounds):
        for arm in arms if k % 2 == 0 else arms[::-1]:
            r = run_arm(arm, args)
            runs.append(r)
            print(_row(r), flush=True)
            if args.verbose:
                print("    held at exit:", ", ".join(f"{t} {n}" for t, n in r["held_at_exit"]))
                young = r["young_at_collections"]
                print("    young at collections:", ", ".join(f"{t} {n}" for t, n in young))
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        if len(rs) > 1:
            full = sorted(r["gc"]["2"]["max_ms"] for r in rs)
            lag = sorted(r["lag_ms"]["max"] for r in rs)
            print(
                f"{arm}: full collections {[r['gc']['2']['count'] for r in rs]}, longest "
                f"{full[0]:.1f}-{full[-1]:.1f} ms; loop lag max {lag[0]:.1f}-{lag[-1]:.1f} ms "
                f"(median {statistics.median(lag):.1f})"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
