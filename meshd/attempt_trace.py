"""One upstream try of a request, as the observer sees it: its client span (and the stream
span under it), its figures (tokens, cached tokens, GPU-seconds) and its access-log entry.
`RequestTrace.attempt` (meshd/request_trace.py) makes it; meshd/observe.py has the protocol.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from filters.cost_ledger import ABANDONED_OUTCOMES, OK_OUTCOME
from meshd import telemetry as t
from meshd.access_log import AttemptRecord

if TYPE_CHECKING:
    from meshd.request_trace import RequestTrace

__all__ = ["NOT_AN_ERROR", "AttemptTrace"]

# Outcomes that are not the server's fault: the span status stays unset for them.
NOT_AN_ERROR = ABANDONED_OUTCOMES | {OK_OUTCOME}


class AttemptTrace:
    """One upstream try. Its attribute names are what filters/cost_ledger.py AttemptLike
    reads, so the ledger prices it without a copy."""

    __slots__ = (
        "_observer",
        "_request",
        "_request_started",
        "_stream_span",
        "cached_tokens",
        "completion_tokens",
        "ended_at",
        "endpoint",
        "first_token_at",
        "gpu",
        "gpu_seconds",
        "gpu_seconds_source",
        "index",
        "kv_transfer_s",
        "outcome",
        "predicted_cached_tokens",
        "prompt_tokens",
        "reason",
        "span",
        "started",
        "started_ts",
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
        # The request weakly: it holds its attempts (_attempts), and a strong reference back
        # made each request a cycle that only the cyclic collector freed (with the routes,
        # the descriptor and the rest it holds): a young collection every ~50 requests,
        # ~2.5% of a request's instructions (issue #22). What an attempt reads of its
        # request (the observer, the start) it keeps; the TTFT and the client's trace
        # context it finds there while the request lives (as long as anyone can ask).
        self._request: Callable[[], RequestTrace | None] = weakref.ref(request)
        self._observer = request.observer
        self._request_started = request.started
        self.index = index
        self.endpoint = url
        self.gpu = gpu
        self.started = now
        # On the wall clock once: the observer re-reads its offset, and the ledger's busy
        # apportioner finds this attempt by it (filters/busy_time.py started/work).
        self.started_ts = request.observer.wall(now)
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
        self.gpu_seconds_source: str | None = None  # "measured": the ledger's busy apportioning
        self.kv_transfer_s: float | None = None

    def kv_transfer(self, seconds: float) -> None:
        """This try is a split request's decode leg, whose KV crosses the link for the
        predicted `seconds` (access log kv_transfer_s, span meshd.pd.kv_transfer_s)."""
        self.kv_transfer_s = seconds
        if self.span is not None and self.span.is_recording():
            self.span.set_attribute(t.ATTR_KV_TRANSFER_S, seconds)

    @property
    def ended(self) -> bool:
        return self.outcome != ""

    @property
    def first_token_ts(self) -> float | None:
        at = self.first_token_at
        return None if at is None else self._observer.wall(at)

    @property
    def ended_ts(self) -> float | None:
        return self._observer.wall(self.ended_at) if self.ended else None

    def traceparent(self) -> str | None:
        """The `traceparent` naming this attempt as the engine's parent (None: tracing off)."""
        return t.traceparent_of(self.span) if self.span is not None else None

    def inject_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """`headers` with traceparent/tracestate naming this attempt (unchanged when tracing
        is off: the client's own trace context passes through)."""
        if self.span is None:
            return headers
        request = self._request()
        routing = request.routing if request is not None else None
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
        req = self._request()
        if req is not None and req.ttft_s is None:
            req.ttft_s = now - req.started
            req._ttft_attempt = self
        if self.span is not None and self.span.is_recording():
            if self._stream_span is None:
                self._start_stream(now)
            assert self._stream_span is not None
            self._stream_span.add_event(
                t.EVENT_FIRST_TOKEN,
                {t.ATTR_TTFT_S: now - self._request_started},
                timestamp=self._observer.wall_ns(now),
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
            end_ns = self._observer.wall_ns(now)
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
            if self.outcome not in NOT_AN_ERROR:
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
        assert self._observer._tracer is not None
        self._stream_span = self._observer._tracer.start_span(
            t.SPAN_STREAM,
            context=trace.set_span_in_context(self.span),
            start_time=self._observer.wall_ns(now),
        )

    def to_record(self) -> AttemptRecord:
        started = self._request_started
        return AttemptRecord(
            endpoint=self.endpoint,
            outcome=self.outcome,
            reason=self.reason,
            gpu=self.gpu,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            gpu_seconds=self.gpu_seconds,
            ttft_s=None if self.first_token_at is None else self.first_token_at - started,
            kv_transfer_s=self.kv_transfer_s,
            gpu_seconds_source=self.gpu_seconds_source,
        )
