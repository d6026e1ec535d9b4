"""One client request from `RequestObserver.begin` to `finish`: what happened to it (the
queue, the pick, each attempt, a resume), its server span, and the figures it ends with, which
its observer (meshd/observe.py) turns into the metrics, the cost ledger and the access log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from filters.cost_ledger import (
    ESTIMATED,
    MEASURED,
    NO_WORK,
    PREFILL_REASON,
    REPORTED,
    AttemptCost,
)
from filters.request import InferenceRequest
from filters.routing_headers import RoutingHeaders
from meshd import telemetry as t
from meshd.access_log import AccessRecord
from meshd.attempt_trace import NOT_AN_ERROR, AttemptTrace

if TYPE_CHECKING:
    from meshd.observe import RequestObserver

__all__ = ["RequestTrace", "RouteLike"]


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


class RequestTrace:
    """One client request from `RequestObserver.begin` to `finish`. Its attribute names are
    what filters/cost_ledger.py RecordLike reads, so the live ledger takes it as it is."""

    __slots__ = (
        "__weakref__",  # its attempts refer to it weakly (meshd/attempt_trace.py)
        "_attempts",
        "_context",
        "_predicted",
        "_ttft_attempt",
        "affinity_departure",
        "attempts",
        "avoided_gpu_seconds",
        "avoided_usd",
        "cached_tokens",
        "completion_tokens",
        "cost_usd",
        "e2e_s",
        "endpoint",
        "fallback_from",
        "fallback_reason",
        "final",
        "finished",
        "gpu",
        "gpu_seconds",
        "gpu_seconds_source",
        "inference",
        "kind",
        "observer",
        "outcome",
        "pd",
        "pick_reason",
        "pool",
        "predicted_ttft_s",
        "prompt_tokens",
        "queue_s",
        "request_id",
        "response_cache",
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
        # Its attempts as RecordLike has them: a tuple kept beside the list (the ledger
        # reads it three times a request; a property built a tuple each read).
        self.attempts: tuple[AttemptTrace, ...] = ()
        self._ttft_attempt: AttemptTrace | None = None
        self._predicted: Sequence[RouteLike] | None = None  # the pick's routes
        self.pick_reason: str | None = None
        self.affinity_departure: str | None = None
        self.predicted_ttft_s: float | None = None  # the pick's, for the pool's demand
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
        # The response cache (meshd/response_cache.py): hit, coalesced, miss or refresh;
        # a replay's avoided figures are what the engine spent on the stored answer.
        self.response_cache: str | None = None
        # A fallback (meshd/fallback.py): the pool it left (the last one, in a chain) and why.
        self.fallback_from: str | None = None
        self.fallback_reason: str | None = None
        # Prefill/decode (meshd/disagg.py): "split", or "whole:<why>" on a decode pool.
        self.pd: str | None = None
        self.avoided_gpu_seconds: float | None = None
        self.avoided_usd: float | None = None

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
        # Kept as given: an attempt looks its URL up there (a dict made here cost a frame
        # and a table per request before the send, for one or two lookups).
        self._predicted = routes
        if routes:
            self.pick_reason = routes[0].reason
            self.predicted_ttft_s = routes[0].predicted_ttft_s
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
        overlap: bool = False,
    ) -> AttemptTrace:
        """An upstream try starts. reason: why this try happened ("" for the first; the
        failure that caused a retry; "resume" after a mid-stream failover). gpu None: the
        GPU configured for `url`. An earlier attempt not yet ended is ended as "abandoned",
        unless `overlap` (the decode leg of a prefill/decode pair beside its prefill leg)."""
        if not overlap and self._attempts and not self._attempts[-1].ended:
            self._attempts[-1].end("abandoned", 0, None, None, None, now)
        if gpu is None:
            gpu = self.observer.gpus.get(url)
        if predicted_cached_tokens is None and self._predicted is not None:
            for r in self._predicted:  # the last route of `url` that predicted, as a dict
                if r.url == url and r.cached_tokens is not None:
                    predicted_cached_tokens = int(r.cached_tokens)
        a = AttemptTrace(self, len(self._attempts), url, gpu, now, reason, predicted_cached_tokens)
        self._attempts.append(a)
        self.attempts = (*self.attempts, a)
        busy = self.observer.ledger.busy
        if busy is not None:  # its engine's busy windows wait for this attempt's work
            busy.started(url, a.started_ts)
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

    def fell_back(self, source: str, pool: str, model: str | None, why: str, now: float) -> None:
        """The request left pool `source` for its fallback `pool` (asking it for `model`):
        its record names the pool that served it and the one it left; an event on the span."""
        self.pool = pool
        self.fallback_from = source
        self.fallback_reason = why
        span = self.span
        if span is None or not span.is_recording():
            return
        attrs: dict[str, Any] = {
            t.ATTR_FALLBACK_FROM: source,
            t.ATTR_FALLBACK_TO: pool,
            t.ATTR_FALLBACK_REASON: why,
        }
        if model is not None:
            attrs[t.GEN_AI_REQUEST_MODEL] = model
        span.add_event(t.EVENT_FALLBACK, attrs, timestamp=self.observer.wall_ns(now))

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
        e2e = now - self.started
        self.e2e_s = e2e if e2e > 0.0 else 0.0  # max(0.0, e2e) without the builtin call
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
            if len(attempts) == 1:  # the usual request: its one attempt's figures
                prompt = last.prompt_tokens or None
                self.completion_tokens = last.completion_tokens
            else:
                prompt = next((a.prompt_tokens for a in attempts if a.prompt_tokens), None)
                # What the client got: a prefill step's one token is the decode step's too.
                known = [
                    a.completion_tokens
                    for a in attempts
                    if a.completion_tokens is not None and a.reason != PREFILL_REASON
                ]
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
        ledger = obs.ledger
        if attempts:
            costs = ledger.attempt_costs(self)
            tickets = ledger.track(self, costs)
        else:
            costs = [AttemptCost(0.0, 0.0, NO_WORK, 0.0, 0.0)]  # nothing reached an engine
            tickets = None
        reasons = list(finish_reasons)
        if tickets is not None:
            for ticket in tickets:  # (a loop: any() over a generator is two more frames)
                if ticket is not None:
                    # An engine measures its busy time: the cost waits for the windows this
                    # request's attempts ran in to settle (meshd/observe.py settles it).
                    obs.unsettled(self, costs, tickets, reasons, response_model, now)
                    return
        self.settled(costs, reasons, response_model, now)

    def settled(
        self,
        costs: list[AttemptCost],
        finish_reasons: Iterable[str | None],
        response_model: str | None,
        now: float,
    ) -> None:
        """The request's cost is known (`finish`, or its observer once the engines' busy
        time it ran in settled): the ledger, the cost metrics, the span's end and the
        access-log line. `now` is when it finished."""
        obs = self.observer
        attempts = self._attempts
        if len(attempts) == 1 and len(costs) == 1:
            # The usual request, as the loop below leaves it for one attempt (no set of
            # readings, no generator over them).
            a, c = attempts[0], costs[0]
            reading = c.reading
            if reading == MEASURED and a.gpu_seconds is None:  # for the access log
                a.gpu_seconds, a.gpu_seconds_source = c.seconds, MEASURED
            self.gpu_seconds = 0.0 + c.seconds
            self.gpu_seconds_source = (
                ESTIMATED if reading == ESTIMATED else MEASURED if reading == MEASURED else REPORTED
            )
            self.cost_usd = 0.0 + c.usd
        elif attempts:
            seconds = usd = 0.0
            readings = set()
            for a, c in zip(attempts, costs, strict=True):
                seconds += c.seconds
                usd += c.usd
                readings.add(c.reading)
                if c.reading == MEASURED and a.gpu_seconds is None:  # for the access log
                    a.gpu_seconds, a.gpu_seconds_source = c.seconds, MEASURED
            self.gpu_seconds = seconds
            # The least certain reading of its attempts names the request's figure.
            self.gpu_seconds_source = next(
                (r for r in (ESTIMATED, MEASURED) if r in readings), REPORTED
            )
            self.cost_usd = usd
        else:
            self.gpu_seconds, self.gpu_seconds_source = 0.0, "none"
            self.cost_usd = 0.0
        obs._record_cost(self, costs)
        obs._tasks_closed(obs.ledger.record(self, costs, tracked=True))

        span = self.span
        if span is not None:
            self._end_span(span, finish_reasons, response_model, now)
        writer = obs.access_log
        if writer is not None and not writer.write(self.to_record()):
            obs.metrics.access_log_dropped.inc()

    def _end_span(
        self,
        span: Span,
        finish_reasons: Iterable[str | None],
        response_model: str | None,
        now: float,
    ) -> None:
        """`finish`'s last word on the server span: the request's figures and outcome."""
        if span.is_recording():
            outcome = self.outcome
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
            attrs[t.ATTR_ATTEMPTS] = len(self._attempts)
            if self.status:
                attrs[t.HTTP_RESPONSE_STATUS_CODE] = self.status
            if self.endpoint:
                attrs[t.ATTR_ENDPOINT] = self.endpoint
            if self.queue_s is not None:
                attrs[t.ATTR_QUEUE_S] = self.queue_s
            if self.response_cache is not None:
                attrs[t.ATTR_RESPONSE_CACHE] = self.response_cache
                if self.avoided_gpu_seconds is not None:
                    attrs[t.ATTR_AVOIDED_GPU_S] = self.avoided_gpu_seconds
            span.set_attributes(attrs)
            if outcome not in NOT_AN_ERROR:
                span.set_attribute(t.ERROR_TYPE, outcome)
                span.set_status(Status(StatusCode.ERROR, outcome))
            span.end(end_time=self.observer.wall_ns(now))
        else:
            span.end()

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
            response_cache=self.response_cache,
            fallback_from=self.fallback_from,
            fallback_reason=self.fallback_reason,
            pd=self.pd,
            avoided_gpu_seconds=self.avoided_gpu_seconds,
            avoided_usd=self.avoided_usd,
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
