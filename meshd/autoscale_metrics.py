"""The sidecar's per-pool autoscaling signals (filters/autoscale.py, docs/autoscaling.md) on
its admin /metrics: demand in tokens/s by phase, shed and fallbacks, queue, KV headroom,
predicted TTFT against the SLO, and the desired-replicas figure.

`PoolSignals` reads what the sidecar's layers already keep (the observer's DemandBoard, fed
as requests end; the guards' admission queues; the routers' endpoint states) and keeps one
`ReplicaPlanner` per pool; `AutoscaleCollector` turns its latest evaluation into series at
scrape time, in the DataPlaneMetrics registry.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from filters.autoscale import (
    DemandBoard,
    PoolDemand,
    ReplicaCapacity,
    ReplicaPlan,
    ReplicaPlanner,
    ScalingPolicy,
    merge_demand,
    policy_from,
    replica_capacity,
)
from filters.endpoint_state import EndpointState, ReportedState
from filters.gpu import GpuTable

if TYPE_CHECKING:
    from xds.resources import PoolDemandReport

__all__ = ["AutoscaleCollector", "FleetDemand", "FleetDemandCollector", "PoolSignals"]

# The control plane counts a sidecar's report for this long after its last publish (the
# sidecars publish every PUBLISH_INTERVAL_S, meshd/demand_publisher.py).
REPORT_MAX_AGE_S = 30.0

# Evaluations closer together than this reuse the last one (a scrape and the reaper).
_MIN_PERIOD_S = 1.0


class CapacityTally:
    """A pool's endpoints' replica capacities (filters/autoscale.py replica_capacity) and
    their sums, each endpoint's kept while nothing it depends on changed, so a second's
    evaluation does not rebuild 1,000 of them (6.6-8.5 ms a walk; the walk is the
    reference, and tests/test_autoscale_tally.py holds the two equal).

    An endpoint's capacity depends on its `version` (moved by every change of an
    EndpointState: reports, local counters, flags, calibrations), whether its report is
    fresh and whether it is ejected (the only things time changes); it is recomputed when
    one of those moved. What depends on the GPU, the calibrations and the KV capacity (its
    prefill and decode rates) is kept while those are the same (at 10 Hz of reports every
    endpoint's version moves, its GPU and speed seldom); its KV in use, queue and
    eligibility are taken anew. It relies on EndpointState's contract that every change
    moves `version` (a field assigned directly is followed by touch())."""

    __slots__ = (
        "_keys",
        "_rates",
        "_states",
        "decode",
        "eligible",
        "kv_capacity",
        "kv_used",
        "prefill",
        "queued",
    )

    def __init__(self) -> None:
        self._states: list[EndpointState | None] = []
        # Per endpoint, in the pool's order: (version, fresh report, ejected) when its
        # figures were taken, and (GPU name, GPUs, speed, calibrations, KV capacity) with
        # the rates they give.
        self._keys: list[tuple[int, object, bool]] = []
        self._rates: list[tuple[tuple[object, ...], float, float, float]] = []
        self.queued: list[int] = []
        self.kv_used: list[float] = []
        self.kv_capacity: list[float] = []
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.eligible: list[bool] = []

    def update(self, states: Sequence[EndpointState], gpus: GpuTable, now: float) -> None:
        """Bring every endpoint's figures to `now`."""
        n = len(states)
        if n != len(self._states):
            self._states = [None] * n  # none known: every endpoint's figures taken
            self._keys = [(-1, None, False)] * n
            self._rates = [((), 0.0, 0.0, 0.0)] * n
            self.queued, self.kv_used, self.eligible = [0] * n, [0.0] * n, [False] * n
            self.kv_capacity, self.prefill, self.decode = [0.0] * n, [0.0] * n, [0.0] * n
        known, keys = self._states, self._keys
        for i, s in enumerate(states):
            r = s.reported  # s.fresh_report(now), inline (so below)
            if r is not None and not now - s.reported_at < s.report_ttl_s:
                r = None
            ejected = now < s.ejected_until or now < s.outlier_ejected_until
            if known[i] is s:
                k = keys[i]
                if k[0] == s.version and k[1] is r and k[2] == ejected:
                    continue
            else:
                known[i] = s
                self._rates[i] = ((), 0.0, 0.0, 0.0)
            keys[i] = (s.version, r, ejected)
            self._take(i, s, r, ejected, gpus, now)

    def _take(
        self,
        i: int,
        s: EndpointState,
        r: ReportedState | None,
        ejected: bool,
        gpus: GpuTable,
        now: float,
    ) -> None:
        """Endpoint i's figures: replica_capacity's (`r`: its fresh report, else None), its
        rates kept while their inputs are. EndpointState's derived views (gpu_name, gpus,
        kv_capacity, kv_used, queued, ineligible_reason) are taken here inline from `r`,
        each once: 10 us an endpoint through them and replica_capacity, ~1.5 inline."""
        used = float(s.tokens_in_flight)
        if r is None:
            static = (s.gpu, s.gpu_count, s.speed_scale, s.ttft_ratio, s.decode_ratio,
                      s.kv_capacity_tokens)  # fmt: skip
            queued = s.waiting
            eligible = not (s.draining or s.breaker_open or ejected)
        else:
            cap = r.kv_capacity_tokens
            static = (
                r.gpu or s.gpu, r.gpu_count or s.gpu_count, s.speed_scale, s.ttft_ratio,
                s.decode_ratio, s.kv_capacity_tokens if cap is None else cap,
            )  # fmt: skip
            if cap is not None and r.kv_usage is not None:
                x = r.kv_usage * cap
                used = x if x > used else used  # max(used, x)
            x = float(r.tokens_in_flight)
            used = x if x > used else used
            queued = r.requests_waiting if r.requests_waiting > s.waiting else s.waiting
            eligible = not (s.draining or s.breaker_open or ejected or not r.healthy or r.draining)
        rates = self._rates[i]
        if rates[0] != static:
            c = replica_capacity(s, gpus, now)
            rates = self._rates[i] = (
                static,
                c.prefill_tokens_per_s,
                c.decode_tokens_per_s,
                c.kv_capacity_tokens,
            )
        kv_cap = rates[3]
        self.kv_used[i] = used if used < kv_cap else kv_cap  # min(kv_cap, used)
        self.kv_capacity[i] = kv_cap
        self.prefill[i] = rates[1]
        self.decode[i] = rates[2]
        self.queued[i] = queued
        self.eligible[i] = eligible


class PoolSignals:
    """One sidecar's autoscaling view of its pools. `evaluate(now)` gives each pool's
    demand (this sidecar's, plus the live queue, KV and capacity) and its plan."""

    def __init__(
        self,
        config: Any,
        routers: Mapping[str, Any],
        guards: Mapping[str, Any],
        board: DemandBoard,
    ) -> None:
        self.routers = routers
        self.guards = guards
        self.board = board
        self.slo: dict[str, float | None] = {}
        self.planners: dict[str, ReplicaPlanner] = {}
        self._static: dict[str, list[EndpointState]] = {}
        self._gpus: dict[str, GpuTable] = {}
        for pool in config.pools:
            name = pool.name
            router = routers.get(name)
            picker = getattr(router, "picker", None)
            gpus = getattr(picker, "gpus", None) or GpuTable()
            self._gpus[name] = gpus
            if getattr(router, "states", None) is None:
                # A balancer's endpoints: their configured GPUs, not calibrated.
                self._static[name] = [
                    EndpointState(
                        ep.url,
                        url=ep.url,
                        gpu=ep.gpu or "unknown",
                        kv_capacity_tokens=ep.kv_capacity_tokens,
                    )
                    for ep in pool.endpoints
                ]
            first = pool.endpoints[0]
            fallback = replica_capacity(
                EndpointState(first.url, gpu=first.gpu or "unknown"), gpus, 0.0
            )
            self.planners[name] = ReplicaPlanner(policy_from(pool.autoscaling), fallback)
            self.slo[name] = pool.autoscaling.slo_ttft_s
        self.last: dict[str, tuple[PoolDemand, ReplicaPlan]] = {}
        self._last_at = float("-inf")
        self._tallies: dict[str, CapacityTally] = {}

    def _states(self, pool: str) -> list[EndpointState]:
        router = self.routers.get(pool)
        states = getattr(router, "states", None)
        if states is not None:
            return list(states)
        return self._static.get(pool, [])

    def demand(self, pool: str, now: float) -> PoolDemand:
        """This sidecar's demand for `pool` at `now`, with the live figures."""
        meter = self.board.meters[pool]
        d = meter.demand(now)
        tally = self._tallies.get(pool)
        if tally is None:
            tally = self._tallies[pool] = CapacityTally()
        tally.update(self._states(pool), self._gpus[pool], now)
        eligible = tally.eligible
        replicas = sum(eligible)
        prefill, decode = tally.prefill, tally.decode
        if replicas:  # the eligible ones' mean, else every endpoint's
            prefill = list(compress(prefill, eligible))
            decode = list(compress(decode, eligible))
        guard = self.guards.get(pool)
        # A balancer's endpoints count nothing of their own: their queue and KV are unknown
        # here (no headroom series), not empty.
        counted = pool not in self._static
        return dataclasses.replace(
            d,
            queue_depth=float(guard.queued) if guard is not None else 0.0,
            engine_queue_depth=float(sum(tally.queued)) if counted else 0.0,
            kv_used_tokens=sum(tally.kv_used) if counted else 0.0,
            kv_capacity_tokens=sum(tally.kv_capacity) if counted else 0.0,
            replica_prefill_tokens_per_s=_mean(prefill),
            replica_decode_tokens_per_s=_mean(decode),
            replicas=replicas,
        )

    def walk(self, pool: str, now: float) -> PoolDemand:
        """demand(), every endpoint's capacity built anew: the reference it keeps to."""
        meter = self.board.meters[pool]
        d = meter.demand(now)
        caps: list[ReplicaCapacity] = [
            replica_capacity(s, self._gpus[pool], now) for s in self._states(pool)
        ]
        live = [c for c in caps if c.eligible] or caps
        guard = self.guards.get(pool)
        counted = pool not in self._static
        return dataclasses.replace(
            d,
            queue_depth=float(guard.queued) if guard is not None else 0.0,
            engine_queue_depth=float(sum(c.queued for c in caps)) if counted else 0.0,
            kv_used_tokens=sum(c.kv_used_tokens for c in caps) if counted else 0.0,
            kv_capacity_tokens=sum(c.kv_capacity_tokens for c in caps) if counted else 0.0,
            replica_prefill_tokens_per_s=_mean(c.prefill_tokens_per_s for c in live),
            replica_decode_tokens_per_s=_mean(c.decode_tokens_per_s for c in live),
            replicas=sum(1 for c in caps if c.eligible),
        )

    def evaluate(
        self, now: float, *, force: bool = False
    ) -> dict[str, tuple[PoolDemand, ReplicaPlan]]:
        """Every pool's demand and plan: a scrape forces one, the reaper's ticks make one a
        second at most (so the figure falls after its delay whether or not anyone scrapes)."""
        if not force and now - self._last_at < _MIN_PERIOD_S and self.last:
            return self.last
        out = {}
        for pool, planner in self.planners.items():
            d = self.demand(pool, now)
            out[pool] = (d, planner.plan(d, now))
        self.last = out
        self._last_at = now
        return out

    def totals(self, pool: str) -> tuple[int, int]:
        """(shed, fallbacks) since the sidecar started."""
        m = self.board.meters[pool]
        return m.shed_total, m.fallbacks_total


def _mean(values: Iterable[float]) -> float:
    vs = list(values)
    return sum(vs) / len(vs) if vs else 0.0


def demand_families(
    rows: Mapping[str, tuple[PoolDemand, ReplicaPlan | None]],
    slo: Mapping[str, float | None],
    totals: Callable[[str], tuple[int, int]] | None = None,
    prefix: str = "meshd_pool_",
) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """The meshd_pool_* families for pools' demand and plans: the sidecar's own, or (prefix
    meshd_fleet_pool_) the control plane's figure over every sidecar. `totals` gives the
    shed and fallback counters where the caller counts them."""
    tps = GaugeMetricFamily(
        prefix + "demand_tokens_per_second",
        "Tokens/s the pool's finished requests needed (prefill: prompt minus engine-cached; "
        "decode: completion), over the last 30 s",
        labels=["pool", "phase"],
    )
    unmet = GaugeMetricFamily(
        prefix + "unmet_demand_tokens_per_second",
        "Tokens/s of requests shed or sent to a fallback for want of capacity (estimated)",
        labels=["pool", "phase"],
    )
    capacity = GaugeMetricFamily(
        prefix + "replica_capacity_tokens_per_second",
        "One replica's learnt capacity: prefill tokens/s, decode tokens/s at a batch of 64",
        labels=["pool", "phase"],
    )
    ttft = GaugeMetricFamily(
        prefix + "predicted_ttft_seconds",
        "p90 over the last 30 s of the TTFT the picker predicted at the pick",
        labels=["pool"],
    )
    slo_f = GaugeMetricFamily(
        prefix + "slo_ttft_seconds",
        "The pool's TTFT SLO (pools[].autoscaling.slo_ttft_s), where set",
        labels=["pool"],
    )
    queue = GaugeMetricFamily(
        prefix + "queue_depth",
        "Requests waiting now: in the admission queue, and at the engines",
        labels=["pool", "where"],
    )
    kv = GaugeMetricFamily(
        prefix + "kv_headroom_ratio",
        "Free share of the pool's KV cache capacity (engines' reports, else meshd's count)",
        labels=["pool"],
    )
    replicas = GaugeMetricFamily(
        prefix + "replicas", "Endpoints of the pool eligible for traffic now", labels=["pool"]
    )
    rates = GaugeMetricFamily(
        prefix + "refused_per_second",
        "Requests/s shed by admission or sent to a fallback pool, over the last 30 s",
        labels=["pool", "kind"],
    )
    desired = GaugeMetricFamily(
        prefix + "desired_replicas",
        "Replicas the pool should have (docs/autoscaling.md): what an autoscaler scales on",
        labels=["pool"],
    )
    terms = GaugeMetricFamily(
        prefix + "desired_replicas_term",
        "The figure's terms in replicas before rounding: load, queue (part of load), kv, slo",
        labels=["pool", "term"],
    )
    shed_c = CounterMetricFamily(
        prefix + "shed",
        "Requests refused by admission (429) or the throttle (503)",
        labels=["pool"],
    )
    fb_c = CounterMetricFamily(
        prefix + "fallbacks", "Requests sent to a fallback pool", labels=["pool"]
    )
    for pool, (d, plan) in sorted(rows.items()):
        tps.add_metric([pool, "prefill"], d.prefill_tokens_per_s)
        tps.add_metric([pool, "decode"], d.decode_tokens_per_s)
        unmet.add_metric([pool, "prefill"], d.unmet_prefill_tokens_per_s)
        unmet.add_metric([pool, "decode"], d.unmet_decode_tokens_per_s)
        capacity.add_metric([pool, "prefill"], d.replica_prefill_tokens_per_s)
        capacity.add_metric([pool, "decode"], d.replica_decode_tokens_per_s)
        if d.predicted_ttft_s is not None:
            ttft.add_metric([pool], d.predicted_ttft_s)
        s = slo.get(pool)
        if s is not None:
            slo_f.add_metric([pool], s)
        queue.add_metric([pool, "admission"], d.queue_depth)
        queue.add_metric([pool, "engines"], d.engine_queue_depth)
        headroom = d.kv_headroom
        if headroom is not None:
            kv.add_metric([pool], headroom)
        replicas.add_metric([pool], d.replicas)
        rates.add_metric([pool, "shed"], d.shed_per_s)
        rates.add_metric([pool, "fallback"], d.fallbacks_per_s)
        if plan is not None:
            desired.add_metric([pool], plan.desired)
            terms.add_metric([pool, "load"], plan.load)
            terms.add_metric([pool, "queue"], plan.queue)
            terms.add_metric([pool, "kv"], plan.kv)
            terms.add_metric([pool, "slo"], plan.slo)
        if totals is not None:
            shed_n, fb_n = totals(pool)
            shed_c.add_metric([pool], shed_n)
            fb_c.add_metric([pool], fb_n)
    out: list[GaugeMetricFamily | CounterMetricFamily] = [
        tps, unmet, capacity, ttft, slo_f, queue, kv, replicas, rates, desired, terms,
    ]  # fmt: skip
    if totals is not None:
        out += [shed_c, fb_c]
    return out


class AutoscaleCollector(Collector):
    """The meshd_pool_* series of one sidecar; empty until `bind` gives it the signals."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.signals: PoolSignals | None = None

    def bind(self, signals: PoolSignals) -> None:
        self.signals = signals

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self.signals
        if s is None:
            return demand_families({}, {}, lambda _p: (0, 0))
        rows = s.evaluate(self._clock(), force=True)
        return demand_families(dict(rows), s.slo, s.totals)

    def describe(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        return demand_families({}, {}, lambda _p: (0, 0))


class FleetDemand:
    """The control plane's view (meshd control-plane): every sidecar's PoolDemandReport
    (xds/resources.py) merged into one demand and one desired-replicas figure per pool.
    A report older than `max_age_s` no longer counts (its sidecar is gone)."""

    def __init__(self, plane: Any, *, max_age_s: float = REPORT_MAX_AGE_S) -> None:
        self.plane = plane
        self.max_age_s = max_age_s
        self._planners: dict[str, ReplicaPlanner] = {}
        self._decoded: dict[str, tuple[str, PoolDemandReport]] = {}  # name -> (version, report)

    def reports(self) -> dict[str, list[PoolDemandReport]]:
        """The fresh reports, by pool."""
        from xds.resources import POOL_DEMAND_TYPE, ResourceError, decode_pool_demand

        by_pool: dict[str, list[PoolDemandReport]] = {}
        live = self.plane.cache.resources(POOL_DEMAND_TYPE)
        for name in list(self._decoded):
            if name not in live:
                del self._decoded[name]
        for name, r in sorted(live.items()):
            age = self.plane.published_age(name)
            if age is None or age > self.max_age_s:
                continue
            seen = self._decoded.get(name)
            if seen is None or seen[0] != r.version:
                try:
                    seen = self._decoded[name] = (r.version, decode_pool_demand(r.body))
                except ResourceError:  # validated at publish: only a newer schema
                    continue
            by_pool.setdefault(seen[1].pool, []).append(seen[1])
        return by_pool

    def evaluate(self, now: float) -> dict[str, tuple[PoolDemand, ReplicaPlan, int, ScalingPolicy]]:
        """Each reported pool: (merged demand, plan, sidecars reporting, policy)."""
        out = {}
        for pool, reps in self.reports().items():
            # Sidecars of one pool share its config; where they differ (a rollout), the
            # most recently published report's policy.
            newest = min(reps, key=lambda r: self.plane.published_age(r.name) or 0.0)
            policy = newest.policy
            planner = self._planners.get(pool)
            if planner is None or planner.policy != policy:
                planner = self._planners[pool] = ReplicaPlanner(policy)
            merged = merge_demand(r.demand for r in reps)
            out[pool] = (merged, planner.plan(merged, now), len(reps), policy)
        return out

    def as_json(self, now: float) -> dict[str, Any]:
        """What KEDA's metrics-api scaler reads (`pools.<pool>.desired_replicas`)."""
        pools = {}
        for pool, (d, plan, n, policy) in self.evaluate(now).items():
            pools[pool] = {
                "desired_replicas": plan.desired,
                "reason": plan.reason,
                "sidecars": n,
                "replicas": d.replicas,
                "prefill_tokens_per_s": d.prefill_tokens_per_s,
                "decode_tokens_per_s": d.decode_tokens_per_s,
                "unmet_prefill_tokens_per_s": d.unmet_prefill_tokens_per_s,
                "unmet_decode_tokens_per_s": d.unmet_decode_tokens_per_s,
                "shed_per_s": d.shed_per_s,
                "fallbacks_per_s": d.fallbacks_per_s,
                "predicted_ttft_s": d.predicted_ttft_s,
                "slo_ttft_s": policy.slo_ttft_s,
                "queue_depth": d.queue_depth + d.engine_queue_depth,
                "kv_headroom": d.kv_headroom,
                "terms": {"load": plan.load, "queue": plan.queue, "kv": plan.kv, "slo": plan.slo},
            }
        return {"pools": pools}


class FleetDemandCollector(Collector):
    """meshd_fleet_pool_* on the control plane's /metrics: one figure per pool."""

    PREFIX = "meshd_fleet_pool_"

    def __init__(self, fleet: FleetDemand, clock: Callable[[], float] = time.monotonic) -> None:
        self.fleet = fleet
        self._clock = clock

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        rows = self.fleet.evaluate(self._clock())
        slo = {p: r[3].slo_ttft_s for p, r in rows.items()}
        yield from demand_families(
            {p: (r[0], r[1]) for p, r in rows.items()}, slo, prefix=self.PREFIX
        )
        sidecars = GaugeMetricFamily(
            self.PREFIX + "sidecars",
            "Sidecars whose demand reports for the pool count now",
            labels=["pool"],
        )
        for pool, r in sorted(rows.items()):
            sidecars.add_metric([pool], r[2])
        yield sidecars
