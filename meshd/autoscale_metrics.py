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
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from filters.autoscale import (
    DemandBoard,
    PoolDemand,
    ReplicaCapacity,
    ReplicaPlan,
    ReplicaPlanner,
    policy_from,
    replica_capacity,
)
from filters.endpoint_state import EndpointState
from filters.gpu import GpuTable

__all__ = ["AutoscaleCollector", "PoolSignals"]

# Evaluations closer together than this reuse the last one (a scrape and the reaper).
_MIN_PERIOD_S = 1.0


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
        caps: list[ReplicaCapacity] = [
            replica_capacity(s, self._gpus[pool], now) for s in self._states(pool)
        ]
        live = [c for c in caps if c.eligible] or caps
        guard = self.guards.get(pool)
        return dataclasses.replace(
            d,
            queue_depth=float(guard.queued) if guard is not None else 0.0,
            engine_queue_depth=float(sum(c.queued for c in caps)),
            kv_used_tokens=sum(c.kv_used_tokens for c in caps),
            kv_capacity_tokens=sum(c.kv_capacity_tokens for c in caps),
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
) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """The meshd_pool_* families for pools' demand and plans (the sidecar's own, or the
    control plane's merged figure; `totals` gives the shed and fallback counters where the
    caller counts them)."""
    tps = GaugeMetricFamily(
        "meshd_pool_demand_tokens_per_second",
        "Tokens/s the pool's finished requests needed (prefill: prompt minus engine-cached; "
        "decode: completion), over the last 30 s",
        labels=["pool", "phase"],
    )
    unmet = GaugeMetricFamily(
        "meshd_pool_unmet_demand_tokens_per_second",
        "Tokens/s of requests shed or sent to a fallback for want of capacity (estimated)",
        labels=["pool", "phase"],
    )
    capacity = GaugeMetricFamily(
        "meshd_pool_replica_capacity_tokens_per_second",
        "One replica's learnt capacity: prefill tokens/s, decode tokens/s at a batch of 64",
        labels=["pool", "phase"],
    )
    ttft = GaugeMetricFamily(
        "meshd_pool_predicted_ttft_seconds",
        "p90 over the last 30 s of the TTFT the picker predicted at the pick",
        labels=["pool"],
    )
    slo_f = GaugeMetricFamily(
        "meshd_pool_slo_ttft_seconds",
        "The pool's TTFT SLO (pools[].autoscaling.slo_ttft_s), where set",
        labels=["pool"],
    )
    queue = GaugeMetricFamily(
        "meshd_pool_queue_depth",
        "Requests waiting now: in the admission queue, and at the engines",
        labels=["pool", "where"],
    )
    kv = GaugeMetricFamily(
        "meshd_pool_kv_headroom_ratio",
        "Free share of the pool's KV cache capacity (engines' reports, else meshd's count)",
        labels=["pool"],
    )
    replicas = GaugeMetricFamily(
        "meshd_pool_replicas", "Endpoints of the pool eligible for traffic now", labels=["pool"]
    )
    rates = GaugeMetricFamily(
        "meshd_pool_refused_per_second",
        "Requests/s shed by admission or sent to a fallback pool, over the last 30 s",
        labels=["pool", "kind"],
    )
    desired = GaugeMetricFamily(
        "meshd_pool_desired_replicas",
        "Replicas the pool should have (docs/autoscaling.md): what an autoscaler scales on",
        labels=["pool"],
    )
    terms = GaugeMetricFamily(
        "meshd_pool_desired_replicas_term",
        "The figure's terms in replicas before rounding: load, queue (part of load), kv, slo",
        labels=["pool", "term"],
    )
    shed_c = CounterMetricFamily(
        "meshd_pool_shed",
        "Requests refused by admission (429) or the throttle (503)",
        labels=["pool"],
    )
    fb_c = CounterMetricFamily(
        "meshd_pool_fallbacks", "Requests sent to a fallback pool", labels=["pool"]
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
