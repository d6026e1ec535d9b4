"""Scale-up with and without the rewarm, on the virtual clock (issue #24: "a new engine gets
traffic by slow start, and prefixes that are hot elsewhere are replicated to it first, so
shedding traffic to a cold pool does not collapse it").

A fleet of `--engines` simulated H100s of which `--cold` are not in the pool until
`--scale-up-at` (pods being scheduled: ejected from the router until then); they join with
empty caches. Shared-prefix traffic (long system prompts) at a rate the warm engines alone
cannot carry and the whole fleet can. Four variants, each on a fresh fleet:

- rewarm: the guard's slow start (filters/slow_start.py, the sidecar's defaults: 60 s,
  linear, from 10%), published to the router as the sidecar's admission layer does
  (`router.set_flags(url, ramp=w)` every 0.25 s), and the picker's hot-prefix replication;
- slow start only, replication only, and neither (a new engine takes its full share at
  once and prefixes spread only by load).

Per variant: TTFT p50/p99 over the run and after the scale-up, success, and $ per
successful task (every engine's GPU price over the simulated run, as the cascade bench
prices a fleet). What the virtual clock leaves out (loadtest/bench/virtual.py): the network,
the rest of the sidecar's guard (breaker, the ramp's shrinking of in-flight limits), client
retries. `python -m loadtest.bench.cascade --scenarios scaleup` runs the real processes
(slow start on or off; replication is not a config setting).

    python -m loadtest.rewarm_bench [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from filters.slow_start import SlowStart, SlowStartConfig
from loadtest.bench.client import ClientSettings, RequestOutcome
from loadtest.bench.fleet import FleetSpec
from loadtest.bench.virtual import (
    SidecarModel,
    VirtualPass,
    engine_specs,
    engine_url,
    kv_capacity_tokens,
    sidecar_model,
)
from loadtest.engine.virtual import VirtualFleet
from loadtest.workloads import PlannedRequest, shared_prefix

__all__ = ["VARIANTS", "RewarmPass", "RewarmResult", "main", "run_variant"]

# The sidecar's reaper period: how often the guard re-publishes a ramp's weight.
TICK_S = 0.25
# (slow start, replication) per variant.
VARIANTS: dict[str, tuple[bool, bool]] = {
    "rewarm": (True, True),
    "slow-start-only": (True, False),
    "replication-only": (False, True),
    "neither": (False, False),
}
# Replication off: a group's holders are taken to carry any demand (filters/picker.py
# _replica_target: holders needed = demand / (replicate_utilisation x speed)).
NO_REPLICATION = {"replicate_utilisation": 1e12}


@dataclass(frozen=True, slots=True)
class RewarmResult:
    variant: str
    slow_start: bool
    replication: bool
    requests: int
    ok: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_p99_after_s: float | None  # requests sent after the scale-up
    ttft_p99_first_30s_after_s: float | None  # ...within 30 s of it, while the new ones warm
    new_engine_share: float  # of the requests after the scale-up, what the new engines served
    new_before: int  # requests the new engines served before they joined (must be 0)
    hit_rate_new: float  # prefix-cache hit rate on the new engines
    sim_s: float
    usd: float
    wall_s: float

    @property
    def usd_per_1k_tasks(self) -> float:
        return 1000 * self.usd / self.ok if self.ok else math.inf


class RewarmPass(VirtualPass):
    """A virtual pass whose last engines join at `scale_up_at`, ramping by slow start."""

    def __init__(
        self,
        fleet: VirtualFleet,
        sidecar: SidecarModel,
        settings: ClientSettings,
        cold: Sequence[str],
        scale_up_at: float,
        slow_start: SlowStartConfig | None,
    ) -> None:
        super().__init__(fleet, sidecar, settings, sample_period_s=1.0)
        self.cold = list(cold)
        self.scale_up_at = scale_up_at
        self.ramps = SlowStart(slow_start) if slow_start is not None else None
        router = sidecar.router
        for url in self.cold:  # not in the pool yet
            router.set_flags(url, breaker_open=False, ejected_until=scale_up_at, now=0.0)
        self._at(scale_up_at, self._joined)

    def _joined(self, now: float) -> None:
        if self.ramps is None:
            return  # the ejection ended: full weight at once
        for url in self.cold:
            self.ramps.became_healthy(url, now)
        self._ramp(now)

    def _ramp(self, now: float) -> None:
        assert self.ramps is not None
        ramping = False
        for url in self.cold:
            w = self.ramps.weight(url, now)
            self.sidecar.router.set_flags(
                url, breaker_open=False, ejected_until=None, ramp=w, now=now
            )
            ramping |= w < 1.0
        if ramping and (self._open > 0 or self._live):
            self._at(now + TICK_S, self._ramp)


def workload(
    rate: float, duration_s: float, seed: int, groups: int, system_tokens: int, question_tokens: int
) -> list[PlannedRequest]:
    n = max(groups, round(rate * duration_s))
    reqs = shared_prefix(
        groups=groups,
        questions_per_group=math.ceil(n / groups),
        system_prompt_tokens=system_tokens,
        question_tokens=question_tokens,
        max_tokens=64,
        rate=rate,
        seed=seed,
        name="rewarm",
    )
    return [r for r in reqs if r.at_s < duration_s]


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def run_variant(
    variant: str,
    *,
    engines: int = 8,
    cold: int = 4,
    rate: float = 150.0,
    duration_s: float = 120.0,
    scale_up_at: float = 40.0,
    groups: int = 16,
    system_tokens: int = 4096,
    question_tokens: int = 1024,
    seed: int = 0,
    slow_start: SlowStartConfig | None = None,
) -> RewarmResult:
    with_ramp, with_replication = VARIANTS[variant]
    fleet = VirtualFleet(engine_specs(FleetSpec(gpus=("H100",) * engines, seed=seed)))
    urls = [engine_url(e) for e in fleet]
    sidecar = sidecar_model(
        urls,
        "meshd",
        [e.replica.profile.gpu for e in fleet],
        [kv_capacity_tokens(e) for e in fleet],
        None if with_replication else {"picker_config": NO_REPLICATION},
    )
    settings = ClientSettings(timeout_s=60.0, max_concurrency=100_000, duration_s=duration_s)
    new = urls[engines - cold :]
    p = RewarmPass(
        fleet,
        sidecar,
        settings,
        new,
        scale_up_at,
        (slow_start or SlowStartConfig()) if with_ramp else None,
    )
    run = p.run(workload(rate, duration_s, seed, groups, system_tokens, question_tokens))
    outs: Sequence[RequestOutcome] = run.outcomes
    ok = [o for o in outs if o.ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    after = [o for o in ok if o.sent_at_s >= scale_up_at and o.ttft_s is not None]
    soon = [o.ttft_s for o in after if o.sent_at_s < scale_up_at + 30.0 and o.ttft_s is not None]
    on_new = [o for o in after if o.endpoint in set(new)]
    prompt = sum(o.prompt_tokens or 0 for o in on_new)
    cached = sum(o.cached_tokens or 0 for o in on_new)
    usd = sum(e.replica.profile.price_per_gpu_hour for e in fleet) / 3600.0 * run.sim_s
    return RewarmResult(
        variant=variant,
        slow_start=with_ramp,
        replication=with_replication,
        requests=len(outs),
        ok=len(ok),
        ttft_p50_s=_pct(ttft, 0.5),
        ttft_p99_s=_pct(ttft, 0.99),
        ttft_p99_after_s=_pct([o.ttft_s for o in after if o.ttft_s is not None], 0.99),
        ttft_p99_first_30s_after_s=_pct(soon, 0.99),
        new_engine_share=len(on_new) / len(after) if after else 0.0,
        new_before=sum(1 for o in outs if o.sent_at_s < scale_up_at and o.endpoint in set(new)),
        hit_rate_new=cached / prompt if prompt else 0.0,
        sim_s=run.sim_s,
        usd=usd,
        wall_s=run.wall_s,
    )


def table(results: Sequence[RewarmResult]) -> str:
    def f(x: float | None, fmt: str = "{:.3f}") -> str:
        return "-" if x is None else fmt.format(x)

    head = (
        f"{'variant':<17} {'slow start':>10} {'replic.':>7} {'ok %':>6} {'TTFT p50':>8} "
        f"{'p99':>7} {'p99 after':>9} {'p99 +30s':>8} {'new share':>9} {'new hit':>7} "
        f"{'$/1k tasks':>10}"
    )
    rows = [head]
    for r in results:
        rows.append(
            f"{r.variant:<17} {r.slow_start!s:>10} {r.replication!s:>7} "
            f"{100 * r.ok / max(1, r.requests):6.1f} {f(r.ttft_p50_s):>8} {f(r.ttft_p99_s):>7} "
            f"{f(r.ttft_p99_after_s):>9} {f(r.ttft_p99_first_30s_after_s):>8} "
            f"{r.new_engine_share:9.3f} {r.hit_rate_new:7.3f} {r.usd_per_1k_tasks:10.4f}"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.rewarm_bench", description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--cold", type=int, default=4)
    ap.add_argument("--rate", type=float, default=None, help="requests/s (default: 150)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    kw: dict[str, Any] = {"engines": args.engines, "cold": args.cold, "seed": args.seed}
    if args.quick:
        kw.update(duration_s=40.0, scale_up_at=15.0)
    if args.rate is not None:
        kw["rate"] = args.rate
    results = []
    for v in (x.strip() for x in args.variants.split(",") if x.strip()):
        t0 = time.perf_counter()
        r = run_variant(v, **kw)
        print(
            f"[rewarm] {v}: {r.requests} requests in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        results.append(r)
    print(
        f"scale-up: {args.cold} of {args.engines} H100 join at {kw.get('scale_up_at', 40.0):g} s "
        f"(of {kw.get('duration_s', 120.0):g} s), {kw.get('rate', 150.0):g} req/s shared-prefix "
        "(16 x 4,096-token system prompts, 1,024-token questions, 64-token answers); "
        "virtual clock"
    )
    print(table(results))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "settings": kw,
            "results": [{**asdict(r), "usd_per_1k_tasks": r.usd_per_1k_tasks} for r in results],
        }
        (args.out / "rewarm.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
