"""What the sidecar tells about each request, turned into everything that watches it: a
server span per request and a client span per upstream attempt (OpenTelemetry, GenAI
semantic conventions), the latency/token/cache/cost metrics, one access-log line, and the
live cost ledger that counts tasks and their waste.

The driver's protocol, per request (times are monotonic seconds: loop.time() or
time.monotonic(), the same clock for one request)::

    obs = observer.begin(kind, pool, inference, routing, request_id, now)
    obs.admitted(queued_at, now)                   # optional: time in the admission queue
    obs.picked(routes, now)                        # optional: the picker's ordered routes
    a = obs.attempt(url, gpu, now, reason="")      # each upstream try
    headers = a.inject_headers(headers)            # W3C traceparent naming the attempt
    a.first_token(now)                             # streams: the first token relayed
    a.end(outcome, status, cached, prompt, completion, now)
    obs.resumed("resumed", now, tokens_sent=n)     # mid-stream failover, then a new attempt
    obs.finish(outcome, usage, now, status=200)    # once; later calls are ignored

With tracing and the access log off, a request costs a few objects and the metric updates
(figures in the module's test and in loadtest/observe_overhead.py).

Its parts: meshd/request_trace.py (RequestTrace: one request, its server span and the
figures it ends with) and meshd/attempt_trace.py (AttemptTrace: one upstream try, its client
span). This module keeps the observer, shared by every request: the label caps, and what a
finished trace adds to the metrics and the cost ledger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from filters.autoscale import DemandBoard
from filters.busy_time import BusyApportioner, BusyTicket
from filters.cost_ledger import (
    ABANDONED_OUTCOMES,
    NO_WORK_OUTCOMES,
    OK_OUTCOME,
    AttemptCost,
    CostLedger,
    PriceTable,
    TaskResult,
    TimingModel,
    answer_usd,
)
from filters.gpu import normalise_gpu_name
from filters.request import InferenceRequest
from filters.routing_headers import RoutingHeaders
from meshd import __version__
from meshd import telemetry as t
from meshd.access_log import AccessLogWriter
from meshd.attempt_trace import AttemptTrace
from meshd.metrics import DataPlaneMetrics, checked_adder, counter_adder
from meshd.request_trace import RequestTrace, RouteLike

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "DEFAULT_MAX_MODEL_LABELS",
    "DEFAULT_MAX_TENANT_LABELS",
    "AttemptTrace",
    "BoundedLabels",
    "RequestObserver",
    "RequestTrace",
    "RouteLike",
    "counter_adder",
]

# Label values taken from clients are capped: each distinct value is a set of series in
# every histogram it labels (ttft x endpoints x models x tenants x 17 buckets). A sidecar
# usually serves one app, so few tenants; the first N seen keep their name, later ones
# read "other". Tenants named in reliability.admission.tenants always keep theirs. The caps
# are telemetry.metrics.max_tenant_labels / max_model_labels (MetricsSettings in
# meshd/config_schema.py, same defaults).
DEFAULT_MAX_TENANT_LABELS = 16
DEFAULT_MAX_MODEL_LABELS = 32
NO_VALUE = "none"
OVERFLOW = "other"
# A finished request waits this long at most for the engines' busy time it ran in to settle
# (filters/busy_time.py: until every attempt begun before its windows' ends is over, about a
# request's length); then it is priced by the horizon's factor, or the model, as they stand.
SETTLE_TIMEOUT_S = 120.0
# Finished requests waiting at once; past it the oldest is priced at once, as on a timeout.
MAX_UNSETTLED = 100_000
# (pool, GPU as an attempt named it) pairs whose cost counters are remembered; past it the
# memory starts over (the series stay: labels() finds them again).
MAX_GPU_KEYS = 4096

log = logging.getLogger("meshd.sidecar")


class _Unsettled(NamedTuple):
    req: RequestTrace
    costs: list[AttemptCost]
    tickets: list[BusyTicket | None]
    finish_reasons: list[str | None]
    response_model: str | None
    now: float


class BoundedLabels:
    """Maps a client-given value (tenant, model) to a Prometheus label value from a set of
    at most `limit` names (plus `preset`, always kept): None -> "none", a value seen among
    the first `limit` distinct ones -> itself, any later one -> "other"."""

    __slots__ = ("_known", "limit")

    def __init__(self, limit: int, preset: Iterable[str] = ()) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit = limit
        self._known: dict[str, None] = dict.fromkeys(preset)
        self.limit += len(self._known)

    def __call__(self, value: str | None) -> str:
        if not value:
            return NO_VALUE
        if value in self._known:
            return value
        if len(self._known) < self.limit:
            self._known[value] = None
            return value
        return OVERFLOW

    def __len__(self) -> int:
        return len(self._known)


class _EndpointSeries:
    """The metric children of one (pool, endpoint, model, tenant): labels() looks up a dict
    under a lock, and a request touches six of them; resolving them once saves ~8 us."""

    __slots__ = ("completion", "hit", "itl", "predicted", "prompt", "ttft")

    def __init__(self, m: DataPlaneMetrics, pool: str, endpoint: str, model: str, tenant: str):
        self.ttft = m.ttft.labels(pool, endpoint, model, tenant)
        self.itl = m.inter_token_latency.labels(pool, endpoint, model, tenant)
        # The counters' adders (checked_adder: Counter.inc's work in one call).
        self.prompt = checked_adder(m.prompt_tokens.labels(pool, endpoint))
        self.completion = checked_adder(m.completion_tokens.labels(pool, endpoint))
        self.predicted = checked_adder(m.prefix_cache_predicted_tokens.labels(pool, endpoint))
        self.hit = checked_adder(m.prefix_cache_hit_tokens.labels(pool, endpoint))


class RequestObserver:
    """Shared by every request of one sidecar. Build it with `from_config`; `close()` (or
    `await aclose()`) flushes spans and the access log.

    metrics: where the figures go. tracer_provider: None turns tracing off (no spans are
    made; a client's traceparent still reaches the engine, because the sidecar forwards
    it). access_log: None writes no log. tenants/models: label values that always keep
    their name. gpus: GPU generation by endpoint URL, for `attempt(url, None, now)`.
    """

    def __init__(
        self,
        metrics: DataPlaneMetrics,
        *,
        tracer_provider: TracerProvider | None = None,
        access_log: AccessLogWriter | None = None,
        prices: PriceTable | None = None,
        timing: TimingModel | None = None,
        tenants: Iterable[str] = (),
        models: Iterable[str] = (),
        max_tenant_labels: int = DEFAULT_MAX_TENANT_LABELS,
        max_model_labels: int = DEFAULT_MAX_MODEL_LABELS,
        gpus: Mapping[str, str | None] | None = None,
        demand: DemandBoard | None = None,
    ) -> None:
        self.metrics = metrics
        # Each pool's demand as requests end (filters/autoscale.py); the admission layer
        # adds what it sheds, the attempts layer what it sends to a fallback pool.
        self.demand = demand
        self.tracer_provider = tracer_provider
        self._tracer = (
            tracer_provider.get_tracer("meshd.sidecar", __version__) if tracer_provider else None
        )
        self.access_log = access_log
        # The engines' busy time, where their /metrics count it (engine_busy), priced to
        # the requests in place of the timing model's batch guess: a finished request whose
        # engine measures waits here until the windows it ran in settle (`tick`).
        self.ledger = CostLedger(prices, timing, busy=BusyApportioner())
        self._unsettled: deque[_Unsettled] = deque()
        self.tenant_label = BoundedLabels(max_tenant_labels, tenants)
        self.model_label = BoundedLabels(max_model_labels, (m for m in models if m != "*"))
        self.gpus = dict(gpus or {})
        self._wall_offset = time.time() - time.monotonic()
        self._endpoint_series: dict[tuple[str, str, str, str], _EndpointSeries] = {}
        self._duration: dict[tuple[str, str, str, str, str], Any] = {}
        # Adders (counter_adder) of the counters every request adds to.
        self._requests: dict[tuple[str, str, str], Callable[[float], None]] = {}
        self._by_gpu: dict[tuple[str, str | None], tuple[Any, Any]] = {}
        self._waste: dict[tuple[str, str], Any] = {}
        self._task_series: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.spent_usd = 0.0
        self.tasks_succeeded = 0
        self.tasks_failed = 0
        # The two ratio gauges are read when scraped, not set per task: from the tasks closed
        # and the spend as it was when the last of them closed.
        self._spent_at_close = 0.0
        metrics.cost_per_successful_task.set_function(self._cost_per_successful_task)
        metrics.successful_tasks_per_usd.set_function(self._successful_tasks_per_usd)
        self._closed = False

    @classmethod
    def from_config(cls, config: Any, metrics: DataPlaneMetrics, **kw: Any) -> RequestObserver:
        """From a meshd.config.Config: telemetry.tracing (OTLP exporter when otlp_endpoint
        is set), telemetry.access_log (writer when path is set), the price table, the label
        caps (telemetry.metrics) and preset labels (admission tenants, the pools' models),
        and the pools' GPUs, which also set meshd_gpu_provisioned_seconds_total (one GPU
        per endpoint)."""
        tel = config.telemetry
        tracing = tel.tracing
        provider = kw.pop("tracer_provider", None)
        if provider is None and tracing.otlp_endpoint:
            provider = t.setup_tracing(
                tracing.service_name,
                tracing.otlp_endpoint,
                tracing.sample_ratio,
                headers=tracing.headers,
                insecure=tracing.insecure,
            )
        writer = kw.pop("access_log", None)
        if writer is None and tel.access_log.path:
            writer = AccessLogWriter(
                tel.access_log.path,
                max_bytes=tel.access_log.max_bytes,
                backups=tel.access_log.backups,
            )
        gpus = {ep.url: ep.gpu for pool in config.pools for ep in pool.endpoints}
        kw.setdefault("max_tenant_labels", tel.metrics.max_tenant_labels)
        kw.setdefault("max_model_labels", tel.metrics.max_model_labels)
        observer = cls(
            metrics,
            tracer_provider=provider,
            access_log=writer,
            prices=PriceTable(tel.prices_usd_per_gpu_hour),
            tenants=config.reliability.admission.tenants,
            models=[m for pool in config.pools for m in pool.models],
            gpus=gpus,
            demand=DemandBoard([p.name for p in config.pools], now=time.monotonic()),
            **kw,
        )
        for pool in config.pools:
            counts: dict[str, int] = {}
            for ep in pool.endpoints:
                gpu = normalise_gpu_name(ep.gpu)
                counts[gpu] = counts.get(gpu, 0) + 1
            for gpu, n in counts.items():
                metrics.gpu_provisioned_seconds.set_gpus(pool.name, gpu, n)
        return observer

    # -- per request ----------------------------------------------------------------------

    def begin(
        self,
        kind: str,
        pool: str,
        inference: InferenceRequest | None,
        routing: RoutingHeaders | None,
        request_id: str,
        now: float,
        *,
        step: int | None = None,
        steps_in_task: int | None = None,
        final: bool | None = None,
    ) -> RequestTrace:
        """A request accepted at `now`. step/steps_in_task/final: where the client said this
        request sits in its task (the ledger closes a task when its final step succeeds)."""
        req = RequestTrace(self, kind, pool, inference, routing, request_id, now)
        req.step, req.steps_in_task, req.final = step, steps_in_task, final
        if self._tracer is not None:
            model = inference.model if inference is not None else None
            attrs = t.genai_request_attributes(
                kind,
                model,
                stream=inference.stream if inference is not None else None,
                max_tokens=inference.max_tokens if inference is not None else None,
                conversation_id=routing.session_id if routing is not None else None,
            )
            attrs[t.ATTR_POOL] = pool
            if request_id:
                attrs[t.ATTR_REQUEST_ID] = request_id
            if routing is not None:
                if routing.tenant:
                    attrs[t.ATTR_TENANT] = routing.tenant
                if routing.task_id:
                    attrs[t.ATTR_TASK_ID] = routing.task_id
                if routing.workflow_id:
                    attrs[t.ATTR_WORKFLOW_ID] = routing.workflow_id
            span = self._tracer.start_span(
                t.span_name(kind, model),
                context=t.context_from_trace(routing.trace if routing is not None else None),
                kind=SpanKind.SERVER,
                attributes=attrs,
                start_time=self.wall_ns(now),
            )
            req.span = span
            req._context = trace.set_span_in_context(span)
        return req

    def tick(self, now: float) -> None:
        """Close tasks idle for the ledger's idle timeout (call it now and then, e.g. from
        the reaper: a task whose client went quiet is otherwise judged only when the next
        request arrives), settle the requests whose engines' busy time has settled, and
        re-read the wall clock offset."""
        if self._unsettled:
            self._settle(now)
        self._wall_offset = time.time() - time.monotonic()
        self._tasks_closed(self.ledger.close_idle(self.wall(now)))

    def wall(self, now: float) -> float:
        return now + self._wall_offset

    def unsettled(
        self,
        req: RequestTrace,
        costs: list[AttemptCost],
        tickets: list[BusyTicket | None],
        finish_reasons: list[str | None],
        response_model: str | None,
        now: float,
    ) -> None:
        """A finished request whose cost waits for its engines' busy time (`tick` settles
        it; after SETTLE_TIMEOUT_S, or past MAX_UNSETTLED waiting, it is priced by the
        horizon's factor or the model as it stands)."""
        self._unsettled.append(_Unsettled(req, costs, tickets, finish_reasons, response_model, now))
        while len(self._unsettled) > MAX_UNSETTLED:
            self._settle_one(self._unsettled.popleft(), force=True)

    def _settle(self, now: float, *, force: bool = False) -> None:
        waiting: deque[_Unsettled] = deque()
        for u in self._unsettled:
            if not self._settle_one(u, force=force or now - u.now >= SETTLE_TIMEOUT_S):
                waiting.append(u)
        self._unsettled = waiting

    def _settle_one(self, u: _Unsettled, *, force: bool) -> bool:
        costs = self.ledger.settle(u.req, u.costs, u.tickets, force=force)
        if costs is None:
            return False
        try:
            u.req.settled(costs, u.finish_reasons, u.response_model, u.now)
        except Exception:  # one bad record must not lose the others
            log.exception("settling the cost of request %s failed", u.req.request_id)
        return True

    def engine_busy(self, url: str, now: float, busy_s: float, tokens: float | None) -> None:
        """An engine's cumulative busy GPU-seconds (and prompt + generation tokens) read at
        `now` (the loop's clock), for the cost ledger's measured reading."""
        busy = self.ledger.busy
        if busy is not None:
            busy.reading(url, self.wall(now), busy_s, tokens)

    def wall_ns(self, now: float) -> int:
        return int((now + self._wall_offset) * 1e9)

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Export queued spans and write queued log lines (blocks up to ~10 s each)."""
        if self._closed:
            return
        self._closed = True
        if self._unsettled:  # the engines' busy time as it stands
            self._settle(0.0, force=True)
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.access_log is not None:
            self.access_log.close()

    async def aclose(self) -> None:
        """`close()` off the event loop (the requests still waiting for their engines'
        busy time settled first, on it)."""
        if self._unsettled and not self._closed:
            self._settle(0.0, force=True)
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # -- internals ------------------------------------------------------------------------

    def _series(self, pool: str, endpoint: str, model: str, tenant: str) -> _EndpointSeries:
        key = (pool, endpoint, model, tenant)
        s = self._endpoint_series.get(key)
        if s is None:
            s = self._endpoint_series[key] = _EndpointSeries(
                self.metrics, pool, endpoint, model, tenant
            )
        return s

    def _record_metrics(self, req: RequestTrace, model: str, tenant: str) -> None:
        m = self.metrics
        pool = req.pool
        key3 = (req.kind, pool, req.outcome)
        c = self._requests.get(key3)
        if c is None:
            c = self._requests[key3] = counter_adder(m.requests.labels(*key3))
        c(1)
        endpoint = req.endpoint or ""
        key5 = (req.kind, pool, model, tenant, endpoint)
        h = self._duration.get(key5)
        if h is None:
            h = self._duration[key5] = m.request_duration.labels(*key5)
        h.observe(req.e2e_s)
        for a in req._attempts:
            is_ttft = a is req._ttft_attempt
            if not a.completion_tokens and not is_ttft:
                continue
            s = self._series(pool, a.endpoint, model, tenant)
            if a.completion_tokens:
                s.completion(a.completion_tokens)
                if a.first_token_at is not None and a.completion_tokens > 1:
                    span_s = a.ended_at - a.first_token_at
                    s.itl.observe(max(0.0, span_s) / (a.completion_tokens - 1))
            if is_ttft and req.ttft_s is not None:
                s.ttft.observe(req.ttft_s)
        last = req._attempts[-1] if req._attempts else None
        if last is not None and last.outcome not in NO_WORK_OUTCOMES:
            s = self._series(pool, last.endpoint, model, tenant)
            if req.prompt_tokens:
                s.prompt(req.prompt_tokens)
            if last.cached_tokens:
                s.hit(last.cached_tokens)
            if last.predicted_cached_tokens:
                s.predicted(last.predicted_cached_tokens)
            if self.demand is not None:
                self.demand.finished(
                    pool,
                    req.started + req.e2e_s,
                    prefill_tokens=(req.prompt_tokens or 0) - (last.cached_tokens or 0),
                    decode_tokens=req.completion_tokens or 0,
                    predicted_ttft_s=req.predicted_ttft_s,
                )

    def _record_cost(self, req: RequestTrace, costs: list[AttemptCost]) -> None:
        pool = req.pool
        for a, c in zip(req._attempts, costs, strict=False):
            seconds = c[0]  # (AttemptCost's seconds and usd, by index: no unpacking)
            if seconds <= 0:
                continue
            usd = c[1]
            # Keyed by the attempt's GPU as given (normalise_gpu_name's answer is the same
            # for the same name: a call fewer an attempt); the series by the normalised one.
            raw = (pool, a.gpu)
            pair = self._by_gpu.get(raw)
            if pair is None:
                if len(self._by_gpu) >= MAX_GPU_KEYS:
                    self._by_gpu.clear()
                key = (pool, normalise_gpu_name(a.gpu))
                pair = self._by_gpu[raw] = (
                    counter_adder(self.metrics.gpu_busy_seconds.labels(*key)),
                    # A price is not checked to be >= 0: Counter.inc refuses a negative.
                    checked_adder(self.metrics.cost_usd.labels(*key)),
                )
            pair[0](seconds)  # > 0 here
            pair[1](usd)
        usd = req.cost_usd
        self.spent_usd += usd
        # _add_waste's own test first (`not <= 0`, so NaN is added as there): a request's
        # usual waste is none, and the call is skipped.
        if req.outcome == OK_OUTCOME:
            # The answer's own attempts (the last, and a prefill step that served it) are
            # not retries.
            attempts = req._attempts
            if len(costs) == 1 and len(attempts) <= 1:  # answer_usd's first case
                waste = usd - (costs[0].usd + 0)
            else:
                waste = usd - answer_usd(attempts, costs)
            if not waste <= 0:
                self._add_waste(pool, "retries", waste)
        elif not usd <= 0:
            if req.outcome in ABANDONED_OUTCOMES:
                self._add_waste(pool, "abandoned_streams", usd)
            else:
                self._add_waste(pool, "failed_requests", usd)

    def _add_waste(self, pool: str, kind: str, usd: float) -> None:
        if usd <= 0:
            return
        c = self._waste.get((pool, kind))
        if c is None:
            c = self._waste[(pool, kind)] = checked_adder(self.metrics.waste_usd.labels(pool, kind))
        c(usd)

    def _cost_per_successful_task(self) -> float:
        """meshd_cost_per_successful_task_usd: 0 until a task has succeeded."""
        spent = self._spent_at_close
        return spent / self.tasks_succeeded if self.tasks_succeeded else 0.0

    def _successful_tasks_per_usd(self) -> float:
        """meshd_successful_tasks_per_usd: 0 until a dollar has been spent."""
        spent = self._spent_at_close
        return self.tasks_succeeded / spent if spent > 0 else 0.0

    def _tasks_closed(self, closed: list[TaskResult]) -> None:
        if not closed:
            return
        m = self.metrics
        for task in closed:
            key = (task.pool, "success" if task.succeeded else "failure")
            pair = self._task_series.get(key)
            if pair is None:
                pair = self._task_series[key] = (
                    counter_adder(m.tasks.labels(*key)),
                    checked_adder(m.task_cost_usd.labels(*key)),
                )
            pair[0](1)
            pair[1](task.cost_usd)
            if task.succeeded:
                self.tasks_succeeded += 1
            else:
                self.tasks_failed += 1
                self._add_waste(task.pool, "failed_tasks", task.settled_usd)
        self._spent_at_close = self.spent_usd
