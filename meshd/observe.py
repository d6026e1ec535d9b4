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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from filters.cost_ledger import (
    ABANDONED_OUTCOMES,
    NO_WORK_OUTCOMES,
    OK_OUTCOME,
    CostLedger,
    PriceTable,
    TaskResult,
    TimingModel,
)
from filters.gpu import normalise_gpu_name
from filters.request import InferenceRequest
from filters.routing_headers import RoutingHeaders
from meshd import __version__
from meshd import telemetry as t

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
from meshd.access_log import AccessLogWriter, AccessRecord, AttemptRecord
from meshd.metrics import DataPlaneMetrics

__all__ = [
    "DEFAULT_MAX_MODEL_LABELS",
    "DEFAULT_MAX_TENANT_LABELS",
    "AttemptTrace",
    "BoundedLabels",
    "RequestObserver",
    "RequestTrace",
    "RouteLike",
]

# Label values taken from clients are capped: each distinct value is a set of series in
# every histogram it labels (ttft x endpoints x models x tenants x 17 buckets). A sidecar
# usually serves one app, so few tenants; the first N seen keep their name, later ones
# read "other". Tenants named in reliability.admission.tenants always keep theirs. The caps
# are telemetry.metrics.max_tenant_labels / max_model_labels (meshd/config.py, same defaults).
DEFAULT_MAX_TENANT_LABELS = 16
DEFAULT_MAX_MODEL_LABELS = 32
NO_VALUE = "none"
OVERFLOW = "other"
# Outcomes that are not the server's fault: the span status stays unset for them.
_NOT_AN_ERROR = ABANDONED_OUTCOMES | {OK_OUTCOME}


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


class RouteLike(Protocol):
    """A picker's route (filters/pool_router.py Route): what `picked` reads."""

    @property
    def url(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def predicted_ttft_s(self) -> float | None: ...
    @property
    def cached_tokens(self) -> float | None: ...


class _EndpointSeries:
    """The metric children of one (pool, endpoint, model, tenant): labels() looks up a dict
    under a lock, and a request touches six of them; resolving them once saves ~8 us."""

    __slots__ = ("completion", "hit", "itl", "predicted", "prompt", "ttft")

    def __init__(self, m: DataPlaneMetrics, pool: str, endpoint: str, model: str, tenant: str):
        self.ttft = m.ttft.labels(pool, endpoint, model, tenant)
        self.itl = m.inter_token_latency.labels(pool, endpoint, model, tenant)
        self.prompt = m.prompt_tokens.labels(pool, endpoint)
        self.completion = m.completion_tokens.labels(pool, endpoint)
        self.predicted = m.prefix_cache_predicted_tokens.labels(pool, endpoint)
        self.hit = m.prefix_cache_hit_tokens.labels(pool, endpoint)


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
    ) -> None:
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        self._tracer = (
            tracer_provider.get_tracer("meshd.sidecar", __version__) if tracer_provider else None
        )
        self.access_log = access_log
        self.ledger = CostLedger(prices, timing)
        self.tenant_label = BoundedLabels(max_tenant_labels, tenants)
        self.model_label = BoundedLabels(max_model_labels, (m for m in models if m != "*"))
        self.gpus = dict(gpus or {})
        self._wall_offset = time.time() - time.monotonic()
        self._endpoint_series: dict[tuple[str, str, str, str], _EndpointSeries] = {}
        self._duration: dict[tuple[str, str, str, str, str], Any] = {}
        self._requests: dict[tuple[str, str, str], Any] = {}
        self._by_gpu: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._waste: dict[tuple[str, str], Any] = {}
        self._task_series: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.spent_usd = 0.0
        self.tasks_succeeded = 0
        self.tasks_failed = 0
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
        request arrives), and re-read the wall clock offset."""
        self._wall_offset = time.time() - time.monotonic()
        self._tasks_closed(self.ledger.close_idle(self.wall(now)))

    def wall(self, now: float) -> float:
        return now + self._wall_offset

    def wall_ns(self, now: float) -> int:
        return int((now + self._wall_offset) * 1e9)

    # -- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Export queued spans and write queued log lines (blocks up to ~10 s each)."""
        if self._closed:
            return
        self._closed = True
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.access_log is not None:
            self.access_log.close()

    async def aclose(self) -> None:
        """`close()` off the event loop."""
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
            c = self._requests[key3] = m.requests.labels(*key3)
        c.inc()
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
                s.completion.inc(a.completion_tokens)
                if a.first_token_at is not None and a.completion_tokens > 1:
                    span_s = a.ended_at - a.first_token_at
                    s.itl.observe(max(0.0, span_s) / (a.completion_tokens - 1))
            if is_ttft and req.ttft_s is not None:
                s.ttft.observe(req.ttft_s)
        last = req._attempts[-1] if req._attempts else None
        if last is not None and last.outcome not in NO_WORK_OUTCOMES:
            s = self._series(pool, last.endpoint, model, tenant)
            if req.prompt_tokens:
                s.prompt.inc(req.prompt_tokens)
            if last.cached_tokens:
                s.hit.inc(last.cached_tokens)
            if last.predicted_cached_tokens:
                s.predicted.inc(last.predicted_cached_tokens)

    def _record_cost(self, req: RequestTrace, costs: list[tuple[float, float, bool]]) -> None:
        pool = req.pool
        for a, (seconds, usd, _) in zip(req._attempts, costs, strict=False):
            if seconds <= 0:
                continue
            key = (pool, normalise_gpu_name(a.gpu))
            pair = self._by_gpu.get(key)
            if pair is None:
                pair = self._by_gpu[key] = (
                    self.metrics.gpu_busy_seconds.labels(*key),
                    self.metrics.cost_usd.labels(*key),
                )
            pair[0].inc(seconds)
            pair[1].inc(usd)
        usd = req.cost_usd
        self.spent_usd += usd
        if req.outcome == OK_OUTCOME:
            self._add_waste(pool, "retries", usd - costs[-1][1])
        elif req.outcome in ABANDONED_OUTCOMES:
            self._add_waste(pool, "abandoned_streams", usd)
        else:
            self._add_waste(pool, "failed_requests", usd)

    def _add_waste(self, pool: str, kind: str, usd: float) -> None:
        if usd <= 0:
            return
        c = self._waste.get((pool, kind))
        if c is None:
            c = self._waste[(pool, kind)] = self.metrics.waste_usd.labels(pool, kind)
        c.inc(usd)

    def _tasks_closed(self, closed: list[TaskResult]) -> None:
        if not closed:
            return
        m = self.metrics
        for task in closed:
            key = (task.pool, "success" if task.succeeded else "failure")
            pair = self._task_series.get(key)
            if pair is None:
                pair = self._task_series[key] = (m.tasks.labels(*key), m.task_cost_usd.labels(*key))
            pair[0].inc()
            pair[1].inc(task.cost_usd)
            if task.succeeded:
                self.tasks_succeeded += 1
            else:
                self.tasks_failed += 1
                self._add_waste(task.pool, "failed_tasks", task.settled_usd)
        if self.tasks_succeeded:
            m.cost_per_successful_task.set(self.spent_usd / self.tasks_succeeded)
        if self.spent_usd > 0:
            m.successful_tasks_per_usd.set(self.tasks_succeeded / self.spent_usd)


class AttemptTrace:
    """One upstream try. Its attribute names are what filters/cost_ledger.py AttemptLike
    reads, so the ledger prices it without a copy."""

    __slots__ = (
        "_request",
        "_stream_span",
        "cached_tokens",
        "completion_tokens",
        "ended_at",
        "endpoint",
        "first_token_at",
        "gpu",
        "gpu_seconds",
        "index",
        "outcome",
        "predicted_cached_tokens",
        "prompt_tokens",
        "reason",
        "span",
        "started",
        "status",
    )

    def __init__(
        self,
        request: RequestTrace,
        index: int,
        url: str,
        gpu: str | None,
        now: float,
        reason: str,
        predicted_cached_tokens: int | None,
    ) -> None:
        self._request = request
        self.index = index
        self.endpoint = url
        self.gpu = gpu
        self.started = now
        self.reason = reason
        self.predicted_cached_tokens = predicted_cached_tokens
        self.span: Span | None = None
        self._stream_span: Span | None = None
        self.first_token_at: float | None = None
        self.ended_at = now
        self.outcome = ""  # "" until end()
        self.status = 0
        self.cached_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.gpu_seconds: float | None = None

    @property
    def ended(self) -> bool:
        return self.outcome != ""

    def traceparent(self) -> str | None:
        """The `traceparent` naming this attempt as the engine's parent (None: tracing off)."""
        return t.traceparent_of(self.span) if self.span is not None else None

    def inject_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """`headers` with traceparent/tracestate naming this attempt (unchanged when tracing
        is off: the client's own trace context passes through)."""
        if self.span is None:
            return headers
        routing = self._request.routing
        return t.inject_trace_headers(headers, self.span, routing.trace if routing else None)

    def response(self, status: int, now: float) -> None:
        """Optional: the response headers arrived (starts the stream span of a stream)."""
        self.status = status
        if self.span is not None and self._stream_span is None and self.span.is_recording():
            self._start_stream(now)

    def first_token(self, now: float) -> None:
        """The first token of this attempt was relayed. The request's TTFT is its first
        attempt's first token (a resumed stream's later attempts do not reset it)."""
        if self.first_token_at is not None:
            return
        self.first_token_at = now
        req = self._request
        if req.ttft_s is None:
            req.ttft_s = now - req.started
            req._ttft_attempt = self
        if self.span is not None and self.span.is_recording():
            if self._stream_span is None:
                self._start_stream(now)
            assert self._stream_span is not None
            self._stream_span.add_event(
                t.EVENT_FIRST_TOKEN,
                {t.ATTR_TTFT_S: now - req.started},
                timestamp=req.observer.wall_ns(now),
            )

    def end(
        self,
        outcome: str,
        status: int,
        cached_tokens: int | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        now: float,
        *,
        gpu_seconds: float | None = None,
        error: str | None = None,
    ) -> None:
        """The attempt is over. outcome: ok, connect_error, timeout, http_<status>,
        upstream_error, stream_broken, stream_truncated, client_disconnect (docs/access-
        log.md). completion_tokens: what this attempt generated (a resumed stream splits
        the answer). gpu_seconds: the engine's own figure (ORCA request_cost) if it gave
        one. error: a human-readable message for the span status. A second call is ignored.
        """
        if self.outcome:
            return
        self.outcome = outcome or "unknown"
        if status:
            self.status = status
        self.cached_tokens = cached_tokens
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.gpu_seconds = gpu_seconds
        self.ended_at = now
        span = self.span
        if span is None:
            return
        if span.is_recording():
            end_ns = self._request.observer.wall_ns(now)
            attrs = t.genai_response_attributes(
                input_tokens=prompt_tokens,
                output_tokens=completion_tokens,
                cached_tokens=cached_tokens,
            )
            attrs[t.ATTR_OUTCOME] = self.outcome
            if self.status:
                attrs[t.HTTP_RESPONSE_STATUS_CODE] = self.status
            if gpu_seconds is not None:
                attrs[t.ATTR_GPU_SECONDS] = gpu_seconds
            span.set_attributes(attrs)
            if self.outcome not in _NOT_AN_ERROR:
                span.set_attribute(t.ERROR_TYPE, self.outcome)
                span.set_status(Status(StatusCode.ERROR, error or self.outcome))
            if self._stream_span is not None:
                if completion_tokens is not None:
                    self._stream_span.set_attribute(t.GEN_AI_USAGE_OUTPUT_TOKENS, completion_tokens)
                self._stream_span.end(end_time=end_ns)
            span.end(end_time=end_ns)
        else:
            span.end()

    def _start_stream(self, now: float) -> None:
        assert self.span is not None
        assert self._request.observer._tracer is not None
        self._stream_span = self._request.observer._tracer.start_span(
            t.SPAN_STREAM,
            context=trace.set_span_in_context(self.span),
            start_time=self._request.observer.wall_ns(now),
        )

    def to_record(self) -> AttemptRecord:
        started = self._request.started
        return AttemptRecord(
            endpoint=self.endpoint,
            outcome=self.outcome,
            reason=self.reason,
            gpu=self.gpu,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            gpu_seconds=self.gpu_seconds,
            ttft_s=None if self.first_token_at is None else self.first_token_at - started,
        )


class RequestTrace:
    """One client request from `RequestObserver.begin` to `finish`. Its attribute names are
    what filters/cost_ledger.py RecordLike reads, so the live ledger takes it as it is."""

    __slots__ = (
        "_attempts",
        "_context",
        "_predicted",
        "_ttft_attempt",
        "affinity_departure",
        "cached_tokens",
        "completion_tokens",
        "cost_usd",
        "e2e_s",
        "endpoint",
        "final",
        "finished",
        "gpu",
        "gpu_seconds",
        "gpu_seconds_source",
        "inference",
        "kind",
        "observer",
        "outcome",
        "pick_reason",
        "pool",
        "prompt_tokens",
        "queue_s",
        "request_id",
        "routing",
        "span",
        "started",
        "status",
        "step",
        "steps_in_task",
        "ts",
        "ttft_s",
    )

    def __init__(
        self,
        observer: RequestObserver,
        kind: str,
        pool: str,
        inference: InferenceRequest | None,
        routing: RoutingHeaders | None,
        request_id: str,
        now: float,
    ) -> None:
        self.observer = observer
        self.kind = kind
        self.pool = pool
        self.inference = inference
        self.routing = routing
        self.request_id = request_id
        self.started = now
        self.ts = observer.wall(now)
        self.span: Span | None = None
        self._context: Context | None = None
        self._attempts: list[AttemptTrace] = []
        self._ttft_attempt: AttemptTrace | None = None
        self._predicted: dict[str, int] | None = None
        self.pick_reason: str | None = None
        self.affinity_departure: str | None = None
        self.step: int | None = None
        self.steps_in_task: int | None = None
        self.final: bool | None = None
        self.finished = False
        self.outcome = ""
        self.status = 0
        self.endpoint: str | None = None
        self.gpu: str | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.ttft_s: float | None = None
        self.e2e_s = 0.0
        self.queue_s: float | None = None
        self.cost_usd = 0.0
        self.gpu_seconds: float | None = None
        self.gpu_seconds_source: str | None = None

    # RecordLike's fields that live elsewhere.
    @property
    def tenant(self) -> str | None:
        return self.routing.tenant if self.routing is not None else None

    @property
    def task_id(self) -> str | None:
        return self.routing.task_id if self.routing is not None else None

    @property
    def workflow_id(self) -> str | None:
        return self.routing.workflow_id if self.routing is not None else None

    @property
    def model(self) -> str | None:
        return self.inference.model if self.inference is not None else None

    @property
    def attempts(self) -> tuple[AttemptTrace, ...]:
        return tuple(self._attempts)

    @property
    def trace_id(self) -> str | None:
        """32 hex digits: this request's trace (the client's when it sent a traceparent)."""
        if self.span is not None:
            sc = self.span.get_span_context()
            if sc.is_valid:
                return f"{sc.trace_id:032x}"
        parent = self.routing.trace if self.routing is not None else None
        return parent.trace_id if parent is not None else None

    # -- what happened --------------------------------------------------------------------

    def admitted(self, queued_at: float, now: float, outcome: str = "admitted") -> None:
        """The request waited in the admission queue from `queued_at` to `now` (outcome:
        admitted, or why it was refused). Makes the queue span; the queue metrics are the
        sidecar's (meshd_admission_queue_wait_seconds)."""
        self.queue_s = max(0.0, now - queued_at)
        tracer = self.observer._tracer
        if tracer is None or self.span is None or not self.span.is_recording():
            return
        span = tracer.start_span(
            t.SPAN_QUEUE,
            context=self._context,
            start_time=self.observer.wall_ns(queued_at),
            attributes={t.ATTR_QUEUE_S: self.queue_s, t.ATTR_OUTCOME: outcome},
        )
        if outcome != "admitted":
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(end_time=self.observer.wall_ns(now))

    def picked(self, routes: Sequence[RouteLike], now: float, started: float | None = None) -> None:
        """The picker's answer, best first: the pick span names the chosen endpoint, its
        predicted cached tokens and TTFT, and the runner-up with its reason; each route's
        predicted cached tokens go with a later `attempt` on its URL."""
        self._predicted = {
            r.url: int(r.cached_tokens) for r in routes if r.cached_tokens is not None
        }
        if routes:
            self.pick_reason = routes[0].reason
            self.affinity_departure = getattr(routes[0], "departure", None)
        tracer = self.observer._tracer
        if tracer is None or self.span is None or not self.span.is_recording() or not routes:
            return
        best = routes[0]
        attrs: dict[str, Any] = {
            t.ATTR_ENDPOINT: best.url,
            t.ATTR_PICK_REASON: best.reason,
            t.ATTR_CANDIDATES: len(routes),
        }
        if best.cached_tokens is not None:
            attrs[t.ATTR_PREDICTED_CACHED_TOKENS] = int(best.cached_tokens)
        if best.predicted_ttft_s is not None:
            attrs[t.ATTR_PREDICTED_TTFT_S] = best.predicted_ttft_s
        if len(routes) > 1:
            attrs[t.ATTR_RUNNER_UP] = routes[1].url
            attrs[t.ATTR_RUNNER_UP_REASON] = routes[1].reason
        span = tracer.start_span(
            t.SPAN_PICK,
            context=self._context,
            start_time=self.observer.wall_ns(now if started is None else started),
            attributes=attrs,
        )
        span.end(end_time=self.observer.wall_ns(now))

    def attempt(
        self,
        url: str,
        gpu: str | None,
        now: float,
        *,
        reason: str = "",
        predicted_cached_tokens: int | None = None,
    ) -> AttemptTrace:
        """An upstream try starts. reason: why this try happened ("" for the first; the
        failure that caused a retry; "resume" after a mid-stream failover). gpu None: the
        GPU configured for `url`. An earlier attempt not yet ended is ended as "abandoned"."""
        if self._attempts and not self._attempts[-1].ended:
            self._attempts[-1].end("abandoned", 0, None, None, None, now)
        if gpu is None:
            gpu = self.observer.gpus.get(url)
        if predicted_cached_tokens is None and self._predicted is not None:
            predicted_cached_tokens = self._predicted.get(url)
        a = AttemptTrace(self, len(self._attempts), url, gpu, now, reason, predicted_cached_tokens)
        self._attempts.append(a)
        tracer = self.observer._tracer
        if tracer is not None and self.span is not None:
            attrs: dict[str, Any] | None = None
            if self.span.is_recording():
                parts = urlsplit(url)
                attrs = {
                    t.ATTR_ATTEMPT: a.index,
                    t.ATTR_ENDPOINT: url,
                    t.SERVER_ADDRESS: parts.hostname or url,
                }
                if parts.port is not None:
                    attrs[t.SERVER_PORT] = parts.port
                if gpu:
                    attrs[t.ATTR_GPU] = gpu
                if reason:
                    attrs[t.ATTR_RETRY_REASON] = reason
                if predicted_cached_tokens is not None:
                    attrs[t.ATTR_PREDICTED_CACHED_TOKENS] = predicted_cached_tokens
                model = self.model
                if model:
                    attrs[t.GEN_AI_REQUEST_MODEL] = model
            a.span = tracer.start_span(
                t.SPAN_ATTEMPT,
                context=self._context,
                kind=SpanKind.CLIENT,
                attributes=attrs,
                start_time=self.observer.wall_ns(now),
            )
        return a

    def resumed(self, outcome: str, now: float, *, tokens_sent: int = 0, reason: str = "") -> None:
        """A stream broke after tokens reached the client; outcome: resumed (a new attempt
        follows, with reason="resume"), refused (the policy said no) or failed (no endpoint
        took it). An event on the server span; meshd_stream_resumes_total is counted by the
        sidecar beside its failover decision, not here."""
        span = self.span
        if span is None or not span.is_recording():
            return
        attrs: dict[str, Any] = {t.ATTR_OUTCOME: outcome, t.ATTR_TOKENS_SENT: tokens_sent}
        if reason:
            attrs[t.ATTR_RETRY_REASON] = reason
        if self._attempts:
            attrs[t.ATTR_ENDPOINT] = self._attempts[-1].endpoint
        span.add_event(t.EVENT_RESUME, attrs, timestamp=self.observer.wall_ns(now))

    def finish(
        self,
        outcome: str,
        usage: Mapping[str, Any] | None,
        now: float,
        *,
        status: int = 0,
        finish_reasons: Iterable[str | None] = (),
        response_model: str | None = None,
    ) -> None:
        """The response to the client is over. outcome: ok, client_disconnect, or the error
        code meshd answered with. usage: the final engine's OpenAI `usage` object (None when
        it sent none); it fills the figures the last attempt's `end` left None, in the record
        and the metrics (that attempt's span has ended already, so give `end` the figures
        when you have them). status: the HTTP status sent to the client (0: none). Records
        the metrics, the ledger, the access-log line and ends the spans. Later calls are
        ignored."""
        if self.finished:
            return
        self.finished = True
        obs = self.observer
        self.outcome = outcome = outcome or "unknown"
        self.status = status
        self.e2e_s = max(0.0, now - self.started)
        attempts = self._attempts
        if attempts:
            last = attempts[-1]
            if usage:
                _apply_usage(last, usage)
            if not last.ended:
                # The sidecar finished without ending its attempt (a client disconnect, an
                # error path): the attempt shares the request's fate.
                last.end(outcome, 0, last.cached_tokens, last.prompt_tokens,
                         last.completion_tokens, now)  # fmt: skip
            for a in attempts[:-1]:
                if not a.ended:
                    a.end("abandoned", 0, None, None, None, now)
            self.endpoint = last.endpoint
            self.gpu = last.gpu
            self.cached_tokens = last.cached_tokens
            prompt = next((a.prompt_tokens for a in attempts if a.prompt_tokens), None)
            known = [a.completion_tokens for a in attempts if a.completion_tokens is not None]
            self.completion_tokens = sum(known) if known else None
        else:
            prompt = _int(usage, "prompt_tokens") if usage else None
            self.completion_tokens = _int(usage, "completion_tokens") if usage else None
        if prompt is None and self.inference is not None:
            prompt = self.inference.estimated_prompt_tokens
        self.prompt_tokens = prompt

        model = obs.model_label(self.model)
        tenant = obs.tenant_label(self.tenant)
        obs._record_metrics(self, model, tenant)
        if attempts:
            costs = obs.ledger.attempt_costs(self)
            self.gpu_seconds = sum(s for s, _, _ in costs)
            self.gpu_seconds_source = "estimated" if any(e for _, _, e in costs) else "reported"
        else:
            costs = [(0.0, 0.0, False)]  # nothing reached an engine
            self.gpu_seconds, self.gpu_seconds_source = 0.0, "none"
        self.cost_usd = sum(c for _, c, _ in costs)
        obs._record_cost(self, costs)
        obs._tasks_closed(obs.ledger.record(self, costs))

        span = self.span
        if span is not None:
            if span.is_recording():
                attrs = t.genai_response_attributes(
                    input_tokens=self.prompt_tokens,
                    output_tokens=self.completion_tokens,
                    cached_tokens=self.cached_tokens,
                    finish_reasons=[r for r in finish_reasons if r],
                    response_model=response_model,
                    ttft_s=self.ttft_s,
                )
                attrs[t.ATTR_OUTCOME] = outcome
                attrs[t.ATTR_COST_USD] = self.cost_usd
                attrs[t.ATTR_ATTEMPTS] = len(attempts)
                if status:
                    attrs[t.HTTP_RESPONSE_STATUS_CODE] = status
                if self.endpoint:
                    attrs[t.ATTR_ENDPOINT] = self.endpoint
                if self.queue_s is not None:
                    attrs[t.ATTR_QUEUE_S] = self.queue_s
                span.set_attributes(attrs)
                if outcome not in _NOT_AN_ERROR:
                    span.set_attribute(t.ERROR_TYPE, outcome)
                    span.set_status(Status(StatusCode.ERROR, outcome))
                span.end(end_time=obs.wall_ns(now))
            else:
                span.end()
        writer = obs.access_log
        if writer is not None and not writer.write(self.to_record()):
            obs.metrics.access_log_dropped.inc()

    def to_record(self) -> AccessRecord:
        """The access-log record (docs/access-log.md) of a finished request."""
        routing = self.routing
        inference = self.inference
        last = self._attempts[-1] if self._attempts else None
        return AccessRecord(
            ts=self.ts,
            request_id=self.request_id,
            outcome=self.outcome,
            status=self.status,
            trace_id=self.trace_id,
            tenant=self.tenant,
            model=self.model,
            task_id=self.task_id,
            workflow_id=self.workflow_id,
            session_id=routing.session_id if routing is not None else None,
            step=self.step,
            steps_in_task=self.steps_in_task,
            final=self.final,
            pool=self.pool,
            endpoint=self.endpoint,
            gpu=self.gpu,
            kind=self.kind,
            stream=inference.stream if inference is not None else False,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            ttft_s=self.ttft_s,
            e2e_s=self.e2e_s,
            queue_s=self.queue_s,
            attempts=tuple(a.to_record() for a in self._attempts),
            cost_usd=self.cost_usd,
            gpu_seconds=self.gpu_seconds,
            gpu_seconds_source=self.gpu_seconds_source,
            priority=routing.priority if routing is not None else None,
            deadline_ms=routing.deadline_ms if routing is not None else None,
            predicted_cached_tokens=last.predicted_cached_tokens if last is not None else None,
            pick_reason=self.pick_reason,
            affinity_departure=self.affinity_departure,
        )


def _int(obj: Mapping[str, Any], key: str) -> int | None:
    v = obj.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _apply_usage(a: AttemptTrace, usage: Mapping[str, Any]) -> None:
    """Fill the figures the sidecar did not give from an OpenAI usage object."""
    if a.prompt_tokens is None:
        a.prompt_tokens = _int(usage, "prompt_tokens")
    if a.completion_tokens is None:
        a.completion_tokens = _int(usage, "completion_tokens")
    if a.cached_tokens is None:
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping):
            a.cached_tokens = _int(details, "cached_tokens")
