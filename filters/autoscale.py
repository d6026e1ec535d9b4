"""What an autoscaler needs from meshd and cannot see itself: per pool, the demand in tokens
per second (prefill and decode apart), the requests shed or sent to fallbacks, the queue, KV
headroom, the predicted TTFT against the pool's SLO, and a desired-replicas figure computed
from them (docs/autoscaling.md gives the formula and its reasons). Sans-I/O: time comes in.

Two halves, so that the control plane can sum what many sidecars saw and decide once:
`DemandMeter` (one sidecar's windowed view of one pool; `PoolDemand` is its summable
value) and `ReplicaPlanner` (demand + the replicas' learnt capacity -> the figure, with
hysteresis so that it does not flap).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from filters.endpoint_state import DEFAULT_PROMPT_TOKENS, EndpointState
from filters.gpu import GpuProfile, GpuTable

__all__ = [
    "DECODE_BATCH",
    "DEFAULT_DRAIN_S",
    "FAST_RISE",
    "FAST_WINDOW_S",
    "SCALE_DOWN_DELAY_S",
    "DemandBoard",
    "DemandMeter",
    "PoolDemand",
    "ReplicaCapacity",
    "ReplicaPlan",
    "ReplicaPlanner",
    "ScalingPolicy",
    "merge_demand",
    "policy_from",
    "replica_capacity",
]

# A replica's decode capacity is its output tokens/s at this batch (the picker's healthy
# batch, filters/picker.py DECODE_REF_BATCH): a pool that decodes at a larger batch gets
# more tokens/s from a replica, but its streams' inter-token latency grows with it.
DECODE_BATCH = 64
# Without an SLO the queue is to be drained within this many seconds by added replicas.
DEFAULT_DRAIN_S = 10.0
# The SLO term raises the figure by at most this factor of the replicas serving now per
# decision (HPA's default scale-up policy doubles at most, too): TTFT is not linear in
# replicas, so a larger breach is answered over several decisions.
MAX_SLO_STEP = 2.0
# The figure goes down only when the pool would still have this much headroom (10%, as
# HPA's tolerance), and only once it has wanted less for the whole scale-down delay.
TOLERANCE = 0.1
# How long the figure must have wanted less before it falls (HPA's own default
# stabilisation is 300 s; meshd's is shorter, the autoscaler's adds to it).
SCALE_DOWN_DELAY_S = 120.0
# The short window whose rates the demand takes when they are clearly higher (by FAST_RISE:
# a step, not the noise of a steady load, which moved the figure 7 -> 6 -> 7 within 20 s
# on the load-step bench at 120 req/s when any excess counted).
FAST_WINDOW_S = 5.0
FAST_RISE = 1.25
# Predicted TTFT samples go into log-spaced bins (ratio 2**0.25, 1 ms to ~17 min) per time
# bucket, so a window's p90 costs bounded memory whatever the request rate (within 19%).
_TTFT_MIN_S = 0.001
_TTFT_BIN_RATIO = 2**0.25
_TTFT_BINS = 80


def _ttft_bin(ttft_s: float) -> int:
    if ttft_s <= _TTFT_MIN_S:
        return 0
    # Conditionals, not min()/max(), here and in `finished`: the same values, without a
    # builtin call (~750 instructions each) per request (issue #22).
    b = 1 + int(math.log(ttft_s / _TTFT_MIN_S, _TTFT_BIN_RATIO))
    return b if b < _TTFT_BINS - 1 else _TTFT_BINS - 1


def _bin_upper(b: int) -> float:
    return float(_TTFT_MIN_S * _TTFT_BIN_RATIO**b)


@dataclass(frozen=True, slots=True)
class PoolDemand:
    """One pool's demand as one sidecar saw it over its window (rates per second), or
    several sidecars' summed by `merge_demand`. Engine-side figures (KV, the engines'
    queue) are the same engines seen from every sidecar: merged by the largest, not summed.
    """

    prefill_tokens_per_s: float = 0.0  # uncached prompt tokens of requests that ended
    decode_tokens_per_s: float = 0.0  # completion tokens of those
    requests_per_s: float = 0.0
    # Refused by admission (429/503) and sent to a fallback pool: counted, and the tokens
    # of those this pool should have served (shed, and fallbacks for want of capacity)
    # added as unmet demand.
    shed_per_s: float = 0.0
    fallbacks_per_s: float = 0.0
    unmet_prefill_tokens_per_s: float = 0.0
    unmet_decode_tokens_per_s: float = 0.0
    # Predicted TTFT (the picker's, at the pick) at p90 over the window; None: no sample.
    predicted_ttft_s: float | None = None
    ttft_samples: int = 0
    queue_depth: float = 0.0  # waiting in this sidecar's admission queue (summed)
    engine_queue_depth: float = 0.0  # waiting at the engines (largest view)
    mean_prefill_tokens: float = 0.0  # per request that ended: what a queued one will cost
    kv_used_tokens: float = 0.0  # over the pool's engines (largest view)
    kv_capacity_tokens: float = 0.0
    # One replica's learnt capacity (mean over the pool's endpoints); 0: not known.
    replica_prefill_tokens_per_s: float = 0.0
    replica_decode_tokens_per_s: float = 0.0
    replicas: int = 0  # endpoints eligible now (largest view)

    @property
    def kv_headroom(self) -> float | None:
        """Free share of the pool's KV capacity, None when no capacity is known."""
        if self.kv_capacity_tokens <= 0:
            return None
        return max(0.0, 1.0 - self.kv_used_tokens / self.kv_capacity_tokens)


def merge_demand(parts: Iterable[PoolDemand]) -> PoolDemand:
    """Several sidecars' demand for one pool as one: rates and admission queues summed,
    the engines' figures (their queue, KV, replica count) the largest view, the replicas'
    capacity and TTFT weighted by the requests each sidecar saw."""
    parts = list(parts)
    if not parts:
        return PoolDemand()
    if len(parts) == 1:
        return parts[0]

    def total(name: str) -> float:
        return float(sum(getattr(p, name) for p in parts))

    reqs = total("requests_per_s")

    def weighted(name: str, only: list[PoolDemand] | None = None) -> float:
        use = [p for p in (only or parts) if getattr(p, name) > 0]
        if not use:
            return 0.0
        w = [p.requests_per_s for p in use]
        if sum(w) <= 0:
            return sum(getattr(p, name) for p in use) / len(use)
        return sum(getattr(p, name) * wi for p, wi in zip(use, w, strict=True)) / sum(w)

    timed = [p for p in parts if p.predicted_ttft_s is not None]
    ttft: float | None = None
    if timed:
        ws = [max(p.ttft_samples, 1) for p in timed]
        ttft = sum((p.predicted_ttft_s or 0.0) * w for p, w in zip(timed, ws, strict=True)) / sum(
            ws
        )
    prefill_served = total("prefill_tokens_per_s")
    return PoolDemand(
        prefill_tokens_per_s=prefill_served,
        decode_tokens_per_s=total("decode_tokens_per_s"),
        requests_per_s=reqs,
        shed_per_s=total("shed_per_s"),
        fallbacks_per_s=total("fallbacks_per_s"),
        unmet_prefill_tokens_per_s=total("unmet_prefill_tokens_per_s"),
        unmet_decode_tokens_per_s=total("unmet_decode_tokens_per_s"),
        predicted_ttft_s=ttft,
        ttft_samples=sum(p.ttft_samples for p in parts),
        queue_depth=total("queue_depth"),
        engine_queue_depth=max(p.engine_queue_depth for p in parts),
        mean_prefill_tokens=prefill_served / reqs if reqs > 0 else weighted("mean_prefill_tokens"),
        kv_used_tokens=max(p.kv_used_tokens for p in parts),
        kv_capacity_tokens=max(p.kv_capacity_tokens for p in parts),
        replica_prefill_tokens_per_s=weighted("replica_prefill_tokens_per_s"),
        replica_decode_tokens_per_s=weighted("replica_decode_tokens_per_s"),
        replicas=max(p.replicas for p in parts),
    )


@dataclass(slots=True)
class _Bucket:
    index: int
    prefill: float = 0.0
    decode: float = 0.0
    requests: int = 0
    shed: int = 0
    fallbacks: int = 0
    unmet_prefill: float = 0.0
    unmet_requests: int = 0  # their decode is taken at the window's mean completion
    ttft: dict[int, int] = field(default_factory=dict)


class DemandMeter:
    """One pool's demand as one sidecar sees it: a sliding window of `window_s` seconds in
    buckets of `bucket_s`, fed as requests end. Memory: window_s / bucket_s buckets.

    Rates rise fast and fall slow: each is the last `fast_window_s`'s where that is over
    FAST_RISE x the whole window's, else the window's (a load step shows within seconds, not
    after the window has filled; a lull shows only once the whole window has seen it; the
    noise of a steady load does not count). 0: the window alone."""

    def __init__(
        self,
        window_s: float = 30.0,
        bucket_s: float = 1.0,
        now: float = 0.0,
        *,
        fast_window_s: float = FAST_WINDOW_S,
    ) -> None:
        if not (window_s > 0 and bucket_s > 0 and bucket_s <= window_s):
            raise ValueError(f"need 0 < bucket_s <= window_s, got {bucket_s}, {window_s}")
        if not 0 <= fast_window_s <= window_s:
            raise ValueError(f"need 0 <= fast_window_s <= window_s, got {fast_window_s}")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._n = max(1, round(window_s / bucket_s))
        self._fast_n = round(fast_window_s / bucket_s)
        self._buckets: deque[_Bucket] = deque()
        self._since = now
        self.shed_total = 0
        self.fallbacks_total = 0

    def _bucket(self, now: float) -> _Bucket:
        i = math.floor(now / self.bucket_s)
        b = self._buckets
        if b and b[-1].index >= i:
            # Late (another clock's now, or equal): into the newest bucket.
            return b[-1]
        b.append(_Bucket(i))
        self._trim(i)
        return b[-1]

    def _trim(self, i: int) -> None:
        b = self._buckets
        while b and b[0].index <= i - self._n:
            b.popleft()

    def finished(
        self,
        now: float,
        *,
        prefill_tokens: float,
        decode_tokens: float,
        predicted_ttft_s: float | None = None,
    ) -> None:
        """A request the pool served ended: its uncached prompt tokens (what the engine had
        to prefill), its completion tokens, and the TTFT the picker predicted for it."""
        b = self._bucket(now)
        b.prefill += prefill_tokens if prefill_tokens > 0.0 else 0.0
        b.decode += decode_tokens if decode_tokens > 0.0 else 0.0
        b.requests += 1
        if predicted_ttft_s is not None and predicted_ttft_s >= 0:
            k = _ttft_bin(predicted_ttft_s)
            b.ttft[k] = b.ttft.get(k, 0) + 1

    def shed(self, now: float, *, prompt_tokens: float = 0.0) -> None:
        """A request refused for want of capacity (admission's 429/503): unmet demand."""
        b = self._bucket(now)
        b.shed += 1
        b.unmet_prefill += max(0.0, prompt_tokens)
        b.unmet_requests += 1
        self.shed_total += 1

    def fell_back(self, now: float, *, prompt_tokens: float = 0.0, unmet: bool = True) -> None:
        """A request sent to a fallback pool. unmet: because this pool could not serve it in
        time (its tokens are demand here); False: for another reason (a cost cap), counted
        only."""
        b = self._bucket(now)
        b.fallbacks += 1
        self.fallbacks_total += 1
        if unmet:
            b.unmet_prefill += max(0.0, prompt_tokens)
            b.unmet_requests += 1

    def demand(self, now: float) -> PoolDemand:
        """The window's rates at `now` (over the time since the meter started while that is
        shorter than the window; each the larger of the window's and the fast window's).
        Queue, KV and capacity are the driver's to add (dataclasses.replace)."""
        i = math.floor(now / self.bucket_s)
        self._trim(i)
        whole = self._rates(now, i, self._n)
        if self._fast_n <= 0 or self._fast_n >= self._n:
            return whole
        fast = self._rates(now, i, self._fast_n)

        def rise(name: str) -> float:
            w, f = getattr(whole, name), getattr(fast, name)
            return float(f if f > FAST_RISE * w else w)

        return replace(
            whole,
            prefill_tokens_per_s=rise("prefill_tokens_per_s"),
            decode_tokens_per_s=rise("decode_tokens_per_s"),
            requests_per_s=rise("requests_per_s"),
            shed_per_s=rise("shed_per_s"),
            fallbacks_per_s=rise("fallbacks_per_s"),
            unmet_prefill_tokens_per_s=rise("unmet_prefill_tokens_per_s"),
            unmet_decode_tokens_per_s=rise("unmet_decode_tokens_per_s"),
        )

    def _rates(self, now: float, i: int, n: int) -> PoolDemand:
        """Rates over the last n buckets (the current one partly)."""
        # The n - 1 whole buckets before the current and the current's part so far (or
        # the time since the meter started, when shorter).
        covered = (n - 1) * self.bucket_s + (now - i * self.bucket_s)
        span = max(self.bucket_s, min(covered, now - self._since))
        prefill = decode = unmet_prefill = 0.0
        requests = shed = fallbacks = unmet_requests = 0
        bins: dict[int, int] = {}
        for b in self._buckets:
            if b.index <= i - n:
                continue
            prefill += b.prefill
            decode += b.decode
            requests += b.requests
            shed += b.shed
            fallbacks += b.fallbacks
            unmet_prefill += b.unmet_prefill
            unmet_requests += b.unmet_requests
            for k, c in b.ttft.items():
                bins[k] = bins.get(k, 0) + c
        samples = sum(bins.values())
        p90: float | None = None
        if samples:
            want = math.ceil(0.9 * samples)
            seen = 0
            for k in sorted(bins):
                seen += bins[k]
                if seen >= want:
                    p90 = _bin_upper(k)
                    break
        mean_decode = decode / requests if requests else 0.0
        return PoolDemand(
            prefill_tokens_per_s=prefill / span,
            decode_tokens_per_s=decode / span,
            requests_per_s=requests / span,
            shed_per_s=shed / span,
            fallbacks_per_s=fallbacks / span,
            unmet_prefill_tokens_per_s=unmet_prefill / span,
            unmet_decode_tokens_per_s=unmet_requests * mean_decode / span,
            predicted_ttft_s=p90,
            ttft_samples=samples,
            mean_prefill_tokens=prefill / requests if requests else 0.0,
        )


class DemandBoard:
    """Every pool's `DemandMeter` in one sidecar: what the request path calls (observe.py
    when a request ends, the admission layer when it sheds, the attempts layer when a
    request goes to a fallback)."""

    def __init__(self, pools: Iterable[str], window_s: float = 30.0, now: float = 0.0) -> None:
        self.meters = {p: DemandMeter(window_s, now=now) for p in pools}

    def finished(
        self,
        pool: str,
        now: float,
        *,
        prefill_tokens: float,
        decode_tokens: float,
        predicted_ttft_s: float | None = None,
    ) -> None:
        m = self.meters.get(pool)
        if m is not None:
            m.finished(
                now,
                prefill_tokens=prefill_tokens,
                decode_tokens=decode_tokens,
                predicted_ttft_s=predicted_ttft_s,
            )

    def shed(self, pool: str, now: float, *, prompt_tokens: float = 0.0) -> None:
        m = self.meters.get(pool)
        if m is not None:
            m.shed(now, prompt_tokens=prompt_tokens)

    def fell_back(
        self, pool: str, now: float, *, prompt_tokens: float = 0.0, unmet: bool = True
    ) -> None:
        m = self.meters.get(pool)
        if m is not None:
            m.fell_back(now, prompt_tokens=prompt_tokens, unmet=unmet)


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """What one endpoint can do now, as the picker has learnt it."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_capacity_tokens: float
    kv_used_tokens: float
    queued: int
    eligible: bool


def replica_capacity(
    state: EndpointState, gpus: GpuTable, now: float, profile: GpuProfile | None = None
) -> ReplicaCapacity:
    """One endpoint's capacity: its GPU's prefill tokens/s x GPUs x the model's speed
    scale, over its learnt TTFT calibration (observed / predicted: 2 means half the table's
    speed), and its decode tokens/s at a batch of DECODE_BATCH over its decode calibration;
    KV from its report or config, else the GPU's."""
    gpu = profile or gpus.get(state.gpu_name(now))
    n = max(1, state.gpus(now))
    prefill = gpu.prefill_tokens_per_s * n * max(1e-6, state.speed_scale)
    prefill /= max(0.05, state.ttft_ratio)
    step = gpu.decode_step_s(DECODE_BATCH) / n / max(1e-6, state.speed_scale)
    decode = DECODE_BATCH / (step * max(0.05, state.decode_ratio))
    cap = state.kv_capacity(now)
    kv_cap = float(cap) if cap is not None else float(gpu.kv_tokens * n)
    return ReplicaCapacity(
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        kv_capacity_tokens=kv_cap,
        kv_used_tokens=min(kv_cap, state.kv_used(now)),
        queued=state.queued(now),
        eligible=state.ineligible_reason(now) is None,
    )


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """config pools[].autoscaling (meshd/config_schema.py PoolAutoscaling)."""

    slo_ttft_s: float | None = None
    target_utilization: float = 0.7
    min_replicas: int = 1
    max_replicas: int = 100
    scale_down_delay_s: float = SCALE_DOWN_DELAY_S

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self}")
        if self.slo_ttft_s is not None and not self.slo_ttft_s > 0:
            raise ValueError(f"slo_ttft_s must be > 0, got {self.slo_ttft_s}")
        if self.scale_down_delay_s < 0:
            raise ValueError(f"scale_down_delay_s must be >= 0, got {self.scale_down_delay_s}")


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """The figure and how it was reached (each term in replicas, before rounding)."""

    desired: int
    raw: float  # the largest term, before tolerance, clamp and hysteresis
    load: float  # (prefill + decode busy share) / target utilization, + the queue's drain
    queue: float  # the part of `load` that drains the queue
    kv: float  # KV in use / (a replica's KV x target utilization)
    slo: float  # replicas serving now x predicted TTFT / SLO (capped), 0 within the SLO
    reason: str  # which term set the figure: load, kv, slo, min, max, hold


class ReplicaPlanner:
    """A pool's desired-replicas figure (docs/autoscaling.md). `plan(demand, now)` on every
    scrape or report; the figure rises at once and falls only after `scale_down_delay_s`
    of wanting less (each evaluation's figure with TOLERANCE headroom, the window's max).
    """

    def __init__(self, policy: ScalingPolicy, fallback_capacity: ReplicaCapacity | None = None):
        self.policy = policy
        # Used while no endpoint of the pool is known (scaled to zero).
        self._fallback = fallback_capacity
        # (time, candidate) with candidates decreasing from the front: the window's max.
        self._recent: deque[tuple[float, int]] = deque()
        self.desired: int | None = None

    def terms(self, d: PoolDemand) -> ReplicaPlan:
        """The figure's terms for `d`, without hysteresis."""
        p = self.policy
        cp = d.replica_prefill_tokens_per_s
        cd = d.replica_decode_tokens_per_s
        if (cp <= 0 or cd <= 0) and self._fallback is not None:
            cp = cp if cp > 0 else self._fallback.prefill_tokens_per_s
            cd = cd if cd > 0 else self._fallback.decode_tokens_per_s
        prefill = d.prefill_tokens_per_s + d.unmet_prefill_tokens_per_s
        decode = d.decode_tokens_per_s + d.unmet_decode_tokens_per_s
        busy = (prefill / cp if cp > 0 else 0.0) + (decode / cd if cd > 0 else 0.0)
        drain_s = p.slo_ttft_s if p.slo_ttft_s is not None else DEFAULT_DRAIN_S
        per_request = d.mean_prefill_tokens or DEFAULT_PROMPT_TOKENS
        queued_tokens = (d.queue_depth + d.engine_queue_depth) * per_request
        queue = (queued_tokens / cp / drain_s) if cp > 0 else 0.0
        load = (busy + queue) / p.target_utilization
        kv = 0.0
        if d.replicas > 0 and d.kv_capacity_tokens > 0:
            per_replica = d.kv_capacity_tokens / d.replicas
            kv = d.kv_used_tokens / (per_replica * p.target_utilization)
        slo = 0.0
        if p.slo_ttft_s is not None and d.predicted_ttft_s is not None:
            over = d.predicted_ttft_s / p.slo_ttft_s
            if over > 1.0:
                slo = max(1, d.replicas) * min(over, MAX_SLO_STEP)
        raw = max(load, kv, slo)
        reason = "load" if raw == load else "kv" if raw == kv else "slo"
        return ReplicaPlan(0, raw, load, queue, kv, slo, reason)

    def plan(self, d: PoolDemand, now: float) -> ReplicaPlan:
        p = self.policy
        t = self.terms(d)
        cand = math.ceil(t.raw * (1.0 + TOLERANCE) - 1e-9)
        reason = t.reason
        if cand <= p.min_replicas:
            cand, reason = p.min_replicas, "min"
        elif cand >= p.max_replicas:
            cand, reason = p.max_replicas, "max"
        r = self._recent
        while r and r[-1][1] <= cand:
            r.pop()
        r.append((now, cand))
        while len(r) > 1 and r[0][0] <= now - p.scale_down_delay_s:
            r.popleft()
        desired = r[0][1]
        if desired > cand:
            reason = "hold"
        self.desired = desired
        return ReplicaPlan(desired, t.raw, t.load, t.queue, t.kv, t.slo, reason)


def policy_from(autoscaling: object, *, scale_down_delay_s: float | None = None) -> ScalingPolicy:
    """A ScalingPolicy from a config's pools[].autoscaling (PoolAutoscaling)."""
    return ScalingPolicy(
        slo_ttft_s=getattr(autoscaling, "slo_ttft_s", None),
        target_utilization=getattr(autoscaling, "target_utilization", 0.7),
        min_replicas=getattr(autoscaling, "min_replicas", 1),
        max_replicas=getattr(autoscaling, "max_replicas", 100),
        scale_down_delay_s=(
            SCALE_DOWN_DELAY_S if scale_down_delay_s is None else scale_down_delay_s
        ),
    )
