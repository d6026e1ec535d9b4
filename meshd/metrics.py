"""Prometheus metrics of the data plane, in a registry per sidecar (so several
sidecars in one test process keep apart). Served by the admin listener; every name is in
README.md's metrics table, and tests check that the Grafana dashboard uses only these.

Per-request figures (latency, tokens, cache hits, cost, tasks) are written by
meshd/observe.py; the sidecar counts what only its control flow knows (attempts, retries,
breaker, admission, failover)."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from meshd.autoscale_metrics import AutoscaleCollector

try:
    from prometheus_client.values import MutexValue as _MutexValue
except ImportError:  # pragma: no cover - another prometheus_client layout
    _MutexValue = None  # type: ignore[assignment,misc]

__all__ = [
    "BREAKER_CLOSED",
    "BREAKER_HALF_OPEN",
    "BREAKER_OPEN",
    "DataPlaneMetrics",
    "GpuSecondsProvisioned",
    "LoopValue",
    "checked_adder",
    "counter_adder",
    "gauge_setter",
]

# TTFT of LLM streams spans milliseconds (cache hit, short prompt) to minutes
# (100k-token prefill behind a queue).
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# Time between two output tokens: a decode step is ~5-50 ms at a healthy batch; seconds
# mean the engine stalled (preemption, a long prefill in the batch).
_INTER_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
# Waits in the admission queue are bounded by the request deadline: ms to a minute.
_QUEUE_WAIT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

# meshd_breaker_state values.
BREAKER_CLOSED = 0
BREAKER_HALF_OPEN = 1
BREAKER_OPEN = 2


class LoopValue:
    """A metric's number without prometheus_client's MutexValue lock: every DataPlaneMetrics
    figure is written on the sidecar's event loop thread, and /metrics is read there too
    (meshd/admin.py, and the control feed's collectors, all on that loop), so a lock taken
    and released per update buys nothing. The same methods as MutexValue, which the
    library's metric objects call; the sums are the same float additions."""

    __slots__ = ("_exemplar", "_value")
    _multiprocess = False

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_float(self, value: float) -> None:
        """Gauge.set's own work on a child (gauge_setter)."""
        self._value = float(value)

    def inc_checked(self, amount: float) -> None:
        """Counter.inc's own work on a child, its refusal of a negative amount included
        (checked_adder)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self._value += amount

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


def _unlocked(value: Any) -> Any:
    """A LoopValue in place of the library's usual MutexValue (another kind of value, e.g.
    its multiprocess mode's, is kept)."""
    return LoopValue() if _MutexValue is not None and type(value) is _MutexValue else value


def counter_adder(child: Any) -> Callable[[float], None]:
    """How to add to a counter child with the least work, for amounts that are never
    negative: its LoopValue's own `inc` (one call) instead of Counter.inc, which first
    checks, in two more calls, that the child is one (labels() made it so) and that the
    amount is not negative. A counter not of DataPlaneMetrics (another value), Counter.inc."""
    value = getattr(child, "_value", None)
    if type(value) is LoopValue:
        inc: Callable[[float], None] = value.inc
        return inc
    return child.inc


def checked_adder(child: Any) -> Callable[[float], None]:
    """counter_adder for amounts that may be negative: Counter.inc's check (ValueError) in
    the LoopValue's own `inc_checked`, one call instead of Counter.inc's three. A counter
    not of DataPlaneMetrics (another value), Counter.inc."""
    value = getattr(child, "_value", None)
    if type(value) is LoopValue:
        inc: Callable[[float], None] = value.inc_checked
        return inc
    return child.inc


def gauge_setter(child: Any) -> Callable[[float], None]:
    """How to set a gauge child with the least work: its LoopValue's `set_float` (one call,
    the float() Gauge.set applies) instead of Gauge.set, which first checks in two more
    calls that the child is one. A gauge not of DataPlaneMetrics (another value), Gauge.set."""
    value = getattr(child, "_value", None)
    if type(value) is LoopValue:
        set_float: Callable[[float], None] = value.set_float
        return set_float
    return child.set


class _LoopCounter(Counter):
    """A Counter whose children keep a LoopValue."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _unlocked(self._value)


class _LoopGauge(Gauge):
    """A Gauge whose children keep a LoopValue."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _unlocked(self._value)


class _LoopHistogram(Histogram):
    """A Histogram whose children keep LoopValues, and observe without Histogram.observe's
    scan of the buckets in Python: the bucket is bisect_left of the upper bounds, the first
    bound >= the amount, as the scan finds it (NaN, which the scan puts in no bucket, and
    exemplars go the library's way)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = _unlocked(self._sum)
        self._buckets = [_unlocked(b) for b in self._buckets]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        total = getattr(self, "_sum", None)  # a labelled parent has none: the library raises
        if type(total) is not LoopValue or exemplar or amount != amount:
            super().observe(amount, exemplar)
            return
        total._value += amount
        self._buckets[bisect_left(self._upper_bounds, amount)]._value += 1


class _Histogram(_LoopHistogram):
    """A histogram whose trailing labels may be left out of a positional `labels()` call
    (they read ""): the per-model/tenant labels were added after the sidecar's own calls
    `ttft.labels(pool, endpoint)` and `request_duration.labels(kind, pool)` were written,
    and those keep working until meshd/observe.py makes them."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        missing = len(self._labelnames) - len(labelvalues)
        if labelvalues and missing > 0:
            labelvalues = (*labelvalues, *([""] * missing))
        return super().labels(*labelvalues, **labelkwargs)


class GpuSecondsProvisioned(Collector):
    """meshd_gpu_provisioned_seconds_total{pool,gpu}: GPUs the pool has x the time it had
    them, advanced at scrape time from `set_gpus` calls (a counter of time that nobody has
    to tick). `now` is monotonic seconds, as everywhere in meshd."""

    NAME = "meshd_gpu_provisioned_seconds"
    LABELS = ("pool", "gpu")

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        # (pool, gpu) -> [gpus now, seconds accumulated, since]
        self._pools: dict[tuple[str, str], list[float]] = {}

    def set_gpus(self, pool: str, gpu: str, count: float, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        entry = self._pools.get((pool, gpu))
        if entry is None:
            self._pools[(pool, gpu)] = [float(count), 0.0, now]
            return
        entry[1] += entry[0] * max(0.0, now - entry[2])
        entry[0], entry[2] = float(count), now

    def value(self, pool: str, gpu: str, now: float | None = None) -> float:
        now = self._clock() if now is None else now
        count, seconds, since = self._pools.get((pool, gpu), (0.0, 0.0, now))
        return seconds + count * max(0.0, now - since)

    def collect(self) -> Iterable[CounterMetricFamily]:
        now = self._clock()
        family = CounterMetricFamily(
            self.NAME,
            "GPU-seconds provisioned: GPUs of the pool's endpoints x time (utilisation = "
            "meshd_gpu_busy_seconds_total / this)",
            labels=self.LABELS,
        )
        for (pool, gpu), _ in sorted(self._pools.items()):
            family.add_metric([pool, gpu], self.value(pool, gpu, now))
        yield family

    def describe(self) -> Iterable[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, "GPU-seconds provisioned", labels=self.LABELS)


class DataPlaneMetrics:
    """Every metric of one sidecar. Label values that come from clients (model, tenant) are
    bounded by meshd/observe.py (BoundedLabels) before they get here; `endpoint` is the
    engine URL, bounded by the pools' endpoints."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, clock: Any = time.monotonic
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._register_requests(r)
        self._register_latency(r)
        self._register_refusals(r)
        self._register_breaker(r)
        self._register_admission(r)
        self._register_tokens(r)
        self._register_cost(r, clock)
        # meshd_pool_* (meshd/autoscale_metrics.py): bound to the sidecar's pools at start.
        self.autoscale = AutoscaleCollector(clock)
        r.register(self.autoscale)
        self.access_log_dropped = _LoopCounter(
            "meshd_access_log_dropped_records",
            "Access-log records dropped because the writer's queue was full",
            registry=r,
        )

    def _register_requests(self, r: CollectorRegistry) -> None:
        """Requests and their upstream attempts and retries."""
        self.requests = _LoopCounter(
            "meshd_requests",
            "Client requests finished, by route kind, pool and outcome",
            ["kind", "pool", "outcome"],
            registry=r,
        )
        self.upstream_attempts = _LoopCounter(
            "meshd_upstream_attempts",
            "Upstream attempts by endpoint and result",
            ["pool", "endpoint", "result"],
            registry=r,
        )
        self.retries = _LoopCounter(
            "meshd_retries",
            "Upstream attempts after the first, by the failure that caused them",
            ["pool", "reason"],
            registry=r,
        )
        self.retry_budget_exhausted = _LoopCounter(
            "meshd_retry_budget_exhausted",
            "Retries not made because the pool's retry budget was spent",
            ["pool"],
            registry=r,
        )

    def _register_latency(self, r: CollectorRegistry) -> None:
        """Latency: end to end, to the first token, between tokens; streams now."""
        self.request_duration = _Histogram(
            "meshd_request_duration_seconds",
            "End-to-end latency: request accepted to the last byte sent to the client",
            ["kind", "pool", "model", "tenant", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = _Histogram(
            "meshd_time_to_first_token_seconds",
            "Time from request accepted to the first token event relayed",
            ["pool", "endpoint", "model", "tenant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = _LoopHistogram(
            "meshd_inter_token_latency_seconds",
            "Mean time between output tokens of one upstream attempt (first token to end, "
            "over tokens - 1), observed once per attempt with two tokens or more",
            ["pool", "endpoint", "model", "tenant"],
            buckets=_INTER_TOKEN_BUCKETS,
            registry=r,
        )
        self.stream_tokens = _LoopCounter(
            "meshd_stream_tokens",
            "Token-bearing SSE events relayed to clients",
            ["pool"],
            registry=r,
        )
        self.active_streams = _LoopGauge(
            "meshd_active_requests", "Requests being served now", registry=r
        )

    def _register_refusals(self, r: CollectorRegistry) -> None:
        """What meshd answered itself, headers it stripped, clients that left."""
        self.rejected = _LoopCounter(
            "meshd_rejected_requests",
            "Requests meshd answered itself with an error, by reason",
            ["reason"],
            registry=r,
        )
        self.pd_requests = _LoopCounter(
            "meshd_pd_requests",
            "Requests to a decode pool (prefill/decode disaggregation), by path (split: a "
            "prefill step on the prefill pool, then the decode; whole: served on the decode "
            "pool; refused: SGLang's protocol with no prefill engine) and why",
            ["pool", "path", "reason"],
            registry=r,
        )
        self.fallbacks = _LoopCounter(
            "meshd_fallbacks",
            "Requests moved to a fallback pool (pools[].fallbacks), by the pool they left, "
            "the pool they went to and why",
            ["pool", "to", "reason"],
            registry=r,
        )
        self.stripped_headers = _LoopCounter(
            "meshd_stripped_routing_headers",
            "x-meshd-* headers removed because the client is outside the trust boundary",
            registry=r,
        )
        self.client_disconnects = _LoopCounter(
            "meshd_client_disconnects",
            "Requests whose client went away before the response finished",
            ["pool"],
            registry=r,
        )

    def _register_breaker(self, r: CollectorRegistry) -> None:
        """Reliability per endpoint: the circuit breaker and outlier ejection."""
        self.breaker_state = _LoopGauge(
            "meshd_breaker_state",
            "Circuit breaker state per endpoint: 0 closed, 1 half-open, 2 open",
            ["pool", "endpoint"],
            registry=r,
        )
        self.breaker_transitions = _LoopCounter(
            "meshd_breaker_transitions",
            "Circuit breaker state changes, by the state entered",
            ["pool", "endpoint", "to"],
            registry=r,
        )
        self.breaker_rejections = _LoopCounter(
            "meshd_breaker_rejections",
            "Attempts not sent because the breaker refused them, by reason",
            ["pool", "reason"],
            registry=r,
        )
        self.outlier_ejected = _LoopGauge(
            "meshd_outlier_ejected",
            "1 while the endpoint is ejected by outlier detection, else 0",
            ["pool", "endpoint"],
            registry=r,
        )
        self.outlier_ejections = _LoopCounter(
            "meshd_outlier_ejections",
            "Outlier ejections, by the signal that caused them",
            ["pool", "endpoint", "reason"],
            registry=r,
        )

    def _register_admission(self, r: CollectorRegistry) -> None:
        """Reliability per pool: admission, the throttle, affinity departures, mid-stream
        failover, tokens in flight."""
        self.admission_queue_depth = _LoopGauge(
            "meshd_admission_queue_depth",
            "Requests waiting in the admission queue now",
            ["pool"],
            registry=r,
        )
        self.admission_queue_wait = _LoopHistogram(
            "meshd_admission_queue_wait_seconds",
            "Time requests spent in the admission queue before admission or rejection",
            ["pool"],
            buckets=_QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.admission_rejections = _LoopCounter(
            "meshd_admission_rejections",
            "Requests refused by admission control, by reason",
            ["pool", "reason"],
            registry=r,
        )
        self.throttled_requests = _LoopCounter(
            "meshd_throttled_requests",
            "Requests delayed or refused by the client-side throttle",
            ["pool"],
            registry=r,
        )
        self.affinity_departures = _LoopCounter(
            "meshd_affinity_departures",
            "Requests sent away from the endpoint holding their prefix (a follow-up step's "
            "engine), by reason (deadline, overloaded, faster-elsewhere, replicate)",
            ["pool", "reason"],
            registry=r,
        )
        self.stream_resumes = _LoopCounter(
            "meshd_stream_resumes",
            "Mid-stream failovers, by outcome (resumed, refused, failed)",
            ["pool", "outcome"],
            registry=r,
        )
        self.tokens_in_flight = _LoopGauge(
            "meshd_tokens_in_flight",
            "Tokens (prompt + expected completion) of requests in flight now",
            ["pool"],
            registry=r,
        )

    def _register_tokens(self, r: CollectorRegistry) -> None:
        """Tokens and the prefix cache: hit rate = hit / prompt; prediction quality = hit /
        predicted (both by endpoint, on the attempt that served the request)."""
        self.prompt_tokens = _LoopCounter(
            "meshd_prompt_tokens",
            "Input tokens of finished requests (engine usage, else meshd's estimate)",
            ["pool", "endpoint"],
            registry=r,
        )
        self.completion_tokens = _LoopCounter(
            "meshd_completion_tokens",
            "Output tokens relayed to clients (every attempt of a resumed stream)",
            ["pool", "endpoint"],
            registry=r,
        )
        self.prefix_cache_predicted_tokens = _LoopCounter(
            "meshd_prefix_cache_predicted_tokens",
            "Prompt tokens the picker expected the chosen endpoint to have cached",
            ["pool", "endpoint"],
            registry=r,
        )
        self.prefix_cache_hit_tokens = _LoopCounter(
            "meshd_prefix_cache_hit_tokens",
            "Prompt tokens the engine served from its prefix cache (usage cached_tokens)",
            ["pool", "endpoint"],
            registry=r,
        )
        self.prefix_index_hit_error = _LoopGauge(
            "meshd_prefix_index_hit_error",
            "The prefix index's predicted hit rate minus the engine's own "
            "(vllm:prefix_cache_hits / queries), over the requests of the last check",
            ["pool", "endpoint"],
            registry=r,
        )

    def _register_cost(self, r: CollectorRegistry, clock: Any) -> None:
        """Cost (filters/cost_ledger.py). Cost per successful task over a window =
        rate(meshd_task_cost_usd_total) / rate(meshd_tasks_total{outcome="success"})."""
        self.gpu_busy_seconds = _LoopCounter(
            "meshd_gpu_busy_seconds",
            "GPU-seconds requests used (engine-reported, else the timing model's estimate)",
            ["pool", "gpu"],
            registry=r,
        )
        self.gpu_provisioned_seconds = GpuSecondsProvisioned(clock)
        r.register(self.gpu_provisioned_seconds)
        self.cost_usd = _LoopCounter(
            "meshd_cost_usd",
            "Dollars spent on requests as they finish: GPU-seconds x the GPU's price",
            ["pool", "gpu"],
            registry=r,
        )
        self.waste_usd = _LoopCounter(
            "meshd_waste_usd",
            "Dollars wasted, by kind: retries, failed_requests, abandoned_streams, "
            "failed_tasks (each dollar in one kind)",
            ["pool", "kind"],
            registry=r,
        )
        self.tasks = _LoopCounter(
            "meshd_tasks",
            "Tasks closed (task id, else workflow id, else the request alone), by outcome: "
            "success or failure",
            ["pool", "outcome"],
            registry=r,
        )
        self.task_cost_usd = _LoopCounter(
            "meshd_task_cost_usd",
            "Dollars spent by closed tasks (every request of the task, waste included)",
            ["pool", "outcome"],
            registry=r,
        )
        self.cost_per_successful_task = _LoopGauge(
            "meshd_cost_per_successful_task_usd",
            "All dollars spent / tasks succeeded, since the sidecar started",
            registry=r,
        )
        self.successful_tasks_per_usd = _LoopGauge(
            "meshd_successful_tasks_per_usd",
            "Tasks succeeded per dollar spent, since the sidecar started",
            registry=r,
        )
