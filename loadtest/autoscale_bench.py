"""The desired-replicas figure over a run with a load step (issue #24, "the loop to the
autoscaler", measured): a fixed fleet of simulated engines behind meshd's router and
admission on the virtual clock (loadtest/bench/virtual.py), an open-loop load that steps
up and back down, and the sidecar's per-pool demand (filters/autoscale.py DemandMeter, fed
as meshd/observe.py feeds it: uncached prompt and completion tokens of each finished
request, the pick's predicted TTFT, each 429 shed) turned into the figure by the same
ReplicaPlanner every second. The fleet does not scale here: the figure is what an
autoscaler would be told, beside the load that caused it.

    python -m loadtest.autoscale_bench [--quick] [--out DIR]

Prints a table (one row per `--table-every` seconds) and writes autoscale.csv,
autoscale.json and autoscale.png (load beside the figure) into the output directory.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from filters.autoscale import (
    DemandMeter,
    PoolDemand,
    ReplicaPlanner,
    ScalingPolicy,
    replica_capacity,
)
from filters.gpu import GpuTable
from loadtest.bench.client import ClientSettings
from loadtest.bench.fleet import FleetSpec
from loadtest.bench.virtual import (
    SidecarModel,
    VirtualPass,
    _Flight,
    engine_specs,
    engine_url,
    kv_capacity_tokens,
    sidecar_model,
)
from loadtest.engine.core import SimRequest
from loadtest.engine.virtual import VirtualFleet
from loadtest.workloads import PlannedRequest, mix, shared_prefix

__all__ = ["AutoscalePass", "Phase", "Row", "main", "run"]


@dataclass(frozen=True, slots=True)
class Phase:
    """`rate` requests per second for `duration_s`."""

    rate: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class Row:
    """One second of the run."""

    t_s: float
    offered_rps: float  # requests planned in the last second
    served_rps: float  # the meter's window rate
    prefill_tps: float
    decode_tps: float
    shed_per_s: float
    predicted_ttft_p90_s: float | None
    queue: float  # admission + engines' waiting
    replicas: int
    desired: int
    reason: str
    load_term: float
    slo_term: float


def step_load(phases: Sequence[Phase], seed: int = 0, **shape: Any) -> list[PlannedRequest]:
    """Shared-prefix questions (8 system prompts) arriving open-loop at each phase's rate."""
    out: list[list[PlannedRequest]] = []
    start = 0.0
    for i, ph in enumerate(phases):
        n = max(1, round(ph.rate * ph.duration_s))
        groups = 8
        part = shared_prefix(
            groups=groups,
            questions_per_group=math.ceil(n / groups),
            rate=ph.rate,
            seed=seed,
            name=f"step{i}",
            **shape,
        )
        out.append([replace(r, at_s=r.at_s + start) for r in part if r.at_s < ph.duration_s])
        start += ph.duration_s
    return mix(*out)


class AutoscalePass(VirtualPass):
    """A virtual pass that feeds the pool's DemandMeter as the sidecar does and asks the
    planner for the figure every `sample_period_s`."""

    def __init__(
        self,
        fleet: VirtualFleet,
        sidecar: SidecarModel,
        settings: ClientSettings,
        planner: ReplicaPlanner,
        offered: Sequence[float],
        *,
        window_s: float = 30.0,
    ) -> None:
        super().__init__(fleet, sidecar, settings, sample_period_s=1.0)
        self.meter = DemandMeter(window_s=window_s, now=0.0)
        self.planner = planner
        self.offered = offered
        self.rows: list[Row] = []
        router = sidecar.router
        self._states = getattr(router, "states", [])
        self._gpus: GpuTable = getattr(getattr(router, "picker", None), "gpus", None) or (
            GpuTable()
        )
        self._kv = [kv_capacity_tokens(e) for e in fleet]

    def finish_ok(self, flight: _Flight, req: SimRequest, now: float) -> None:
        if not flight.done and req.num_output_tokens > 0:
            route = flight.route
            self.meter.finished(
                now,
                prefill_tokens=req.num_prompt_tokens - req.cached_tokens,
                decode_tokens=req.num_output_tokens,
                predicted_ttft_s=route.predicted_ttft_s if route is not None else None,
            )
        super().finish_ok(flight, req, now)

    def _too_many(self, flight: _Flight, message: str, now: float) -> None:
        pick = flight.pick
        self.meter.shed(now, prompt_tokens=pick.prompt_tokens if pick is not None else 0)
        super()._too_many(flight, message, now)

    def _sample(self, now: float) -> None:
        super()._sample(now)
        d = self.meter.demand(now)
        caps = [replica_capacity(s, self._gpus, now) for s in self._states]
        engines = self.fleet.engines
        live = [c for c in caps if c.eligible] or caps
        d = replace(
            d,
            queue_depth=float(len(self._held)),
            engine_queue_depth=float(sum(e.core.num_waiting for e in engines)),
            kv_used_tokens=sum(
                e.core.kv_usage() * k for e, k in zip(engines, self._kv, strict=True)
            ),
            kv_capacity_tokens=float(sum(self._kv)),
            replica_prefill_tokens_per_s=_mean([c.prefill_tokens_per_s for c in live]),
            replica_decode_tokens_per_s=_mean([c.decode_tokens_per_s for c in live]),
            replicas=sum(1 for c in caps if c.eligible),
        )
        plan = self.planner.plan(d, now)
        second = int(now)
        offered = self.offered[second - 1] if 0 < second <= len(self.offered) else 0.0
        self.rows.append(_row(now, offered, d, plan.desired, plan.reason, plan.load, plan.slo))


def _row(
    now: float, offered: float, d: PoolDemand, desired: int, reason: str, load: float, slo: float
) -> Row:
    return Row(
        t_s=round(now, 3),
        offered_rps=offered,
        served_rps=d.requests_per_s,
        prefill_tps=d.prefill_tokens_per_s,
        decode_tps=d.decode_tokens_per_s,
        shed_per_s=d.shed_per_s,
        predicted_ttft_p90_s=d.predicted_ttft_s,
        queue=d.queue_depth + d.engine_queue_depth,
        replicas=d.replicas,
        desired=desired,
        reason=reason,
        load_term=load,
        slo_term=slo,
    )


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def offered_per_second(requests: Sequence[PlannedRequest], horizon_s: float) -> list[float]:
    counts = [0.0] * max(1, math.ceil(horizon_s))
    for r in requests:
        i = int(r.at_s)
        if 0 <= i < len(counts):
            counts[i] += 1
    return counts


def run(
    phases: Sequence[Phase],
    *,
    gpus: Sequence[str] = ("H100",) * 4,
    policy: ScalingPolicy | None = None,
    seed: int = 0,
    drain_s: float = 30.0,
    shape: dict[str, Any] | None = None,
) -> list[Row]:
    """One run on the virtual clock: the rows, a second apart."""
    shape = shape or {"system_prompt_tokens": 1024, "question_tokens": 256, "max_tokens": 128}
    requests = step_load(phases, seed, **shape)
    horizon = sum(p.duration_s for p in phases)
    fleet_spec = FleetSpec(gpus=tuple(gpus), seed=seed)
    fleet = VirtualFleet(engine_specs(fleet_spec))
    sidecar = sidecar_model(
        [engine_url(e) for e in fleet],
        "meshd",
        [e.replica.profile.gpu for e in fleet],
        [kv_capacity_tokens(e) for e in fleet],
    )
    settings = ClientSettings(
        timeout_s=120.0, max_concurrency=100_000, duration_s=horizon, drain_s=drain_s
    )
    planner = ReplicaPlanner(
        policy or ScalingPolicy(slo_ttft_s=1.0, max_replicas=64, scale_down_delay_s=60.0)
    )
    p = AutoscalePass(fleet, sidecar, settings, planner, offered_per_second(requests, horizon))
    p.run(requests)
    return p.rows


def table(rows: Sequence[Row], every_s: float = 10.0) -> str:
    head = (
        f"{'t s':>6} {'offered/s':>9} {'served/s':>8} {'prefill tok/s':>13} "
        f"{'decode tok/s':>12} {'shed/s':>6} {'TTFT p90':>8} {'queue':>6} "
        f"{'replicas':>8} {'desired':>7}  why"
    )
    out = [head]
    next_t = 0.0
    for r in rows:
        if r.t_s + 1e-9 < next_t:
            continue
        next_t = r.t_s + every_s
        ttft = "-" if r.predicted_ttft_p90_s is None else f"{r.predicted_ttft_p90_s:.3f}"
        out.append(
            f"{r.t_s:6.0f} {r.offered_rps:9.1f} {r.served_rps:8.1f} {r.prefill_tps:13,.0f} "
            f"{r.decode_tps:12,.0f} {r.shed_per_s:6.2f} {ttft:>8} {r.queue:6.0f} "
            f"{r.replicas:8d} {r.desired:7d}  {r.reason}"
        )
    return "\n".join(out)


def write(rows: Sequence[Row], out: Path, phases: Sequence[Phase], meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "autoscale.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(Row.__dataclass_fields__))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    doc = {"phases": [asdict(p) for p in phases], **meta, "rows": [asdict(r) for r in rows]}
    (out / "autoscale.json").write_text(json.dumps(doc, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is optional (meshd[bench] brings matplotlib)
        return
    t = [r.t_s for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    ax1.step(t, [r.offered_rps for r in rows], where="post", label="offered req/s", color="C0")
    ax1.plot(
        t,
        [r.served_rps for r in rows],
        label="served req/s (30 s window, 5 s when higher)",
        color="C1",
    )
    ax1.plot(t, [r.shed_per_s for r in rows], label="shed req/s", color="C3")
    ax1.set_ylabel("requests / s")
    ax1.legend(loc="upper right", fontsize=8)
    ax1b = ax1.twinx()
    ttft = [
        r.predicted_ttft_p90_s if r.predicted_ttft_p90_s is not None else math.nan for r in rows
    ]
    ax1b.plot(t, ttft, label="predicted TTFT p90 (s)", color="C2", linestyle=":")
    ax1b.set_ylabel("seconds")
    ax1b.legend(loc="upper left", fontsize=8)
    ax2.step(t, [r.desired for r in rows], where="post", label="desired replicas", color="C4")
    ax2.step(t, [r.replicas for r in rows], where="post", label="replicas", color="k", alpha=0.5)
    ax2.plot(t, [r.load_term for r in rows], label="load term", color="C5", alpha=0.6)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("replicas")
    ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle("meshd_pool_desired_replicas beside the load (virtual clock)")
    fig.tight_layout()
    fig.savefig(out / "autoscale.png", dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.autoscale_bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a short run (CI-sized)")
    p.add_argument("--low", type=float, default=30.0, help="requests/s before and after")
    p.add_argument("--high", type=float, default=120.0, help="requests/s during the step")
    p.add_argument("--engines", type=int, default=4, help="H100 engines (fixed)")
    p.add_argument("--slo-ttft-s", type=float, default=1.0)
    p.add_argument("--scale-down-delay-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table-every", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        phases = [Phase(args.low, 20.0), Phase(args.high, 30.0), Phase(args.low, 40.0)]
    else:
        phases = [Phase(args.low, 60.0), Phase(args.high, 120.0), Phase(args.low, 120.0)]
    policy = ScalingPolicy(
        slo_ttft_s=args.slo_ttft_s,
        max_replicas=64,
        scale_down_delay_s=args.scale_down_delay_s,
    )
    wall = time.perf_counter()
    rows = run(phases, gpus=("H100",) * args.engines, policy=policy, seed=args.seed)
    wall = time.perf_counter() - wall
    print(
        f"load step {args.low:g} -> {args.high:g} -> {args.low:g} req/s on "
        f"{args.engines} H100 (fixed), SLO TTFT {args.slo_ttft_s:g} s, scale-down delay "
        f"{args.scale_down_delay_s:g} s; {len(rows)} s simulated in {wall:.1f} s"
    )
    print(table(rows, args.table_every))
    out = args.out or Path("results") / time.strftime("autoscale-%Y%m%d-%H%M%S")
    meta = {
        "engines": args.engines,
        "gpu": "H100",
        "policy": asdict(policy),
        "seed": args.seed,
        "wall_s": round(wall, 2),
    }
    write(rows, out, phases, meta)
    print(
        f"wrote {out}/autoscale.csv, autoscale.json"
        + (", autoscale.png" if (out / "autoscale.png").exists() else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
