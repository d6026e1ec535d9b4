"""The picker's OpenTelemetry spans (only with a tracer: `--otlp-endpoint`): a span per
decision in the client's trace, ended with what the response said; a span per refusal; and the
upstream request's `traceparent` naming the decision's span.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from filters.pool_router import Route
from filters.request import InferenceRequest
from filters.routing_headers import RoutingHeaders
from meshd.extproc_messages import host_port, set_header
from meshd.telemetry import (
    ATTR_ENDPOINT,
    ATTR_OUTCOME,
    ATTR_PREDICTED_CACHED_TOKENS,
    ATTR_PREDICTED_TTFT_S,
    ATTR_TENANT,
    ERROR_TYPE,
    GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    context_from_trace,
    genai_request_attributes,
    span_name,
    traceparent_of,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from meshd.extproc_picker import Decision

# Span attributes of the picker's own (meshd.* namespace; HTTP status is the stable semconv key).
HTTP_STATUS = "http.response.status_code"
ATTR_FALLBACKS = "meshd.pick.fallbacks"
ATTR_PICK_REASON = "meshd.pick.reason"
ATTR_SERVED = "meshd.pick.served"
ATTR_DECISION_S = "meshd.pick.decision_s"


def start_span(
    tracer: Tracer,
    kind: str | None,
    inference: InferenceRequest | None,
    routing: RoutingHeaders,
    d: Decision,
) -> Span:
    model = inference.model if inference is not None else None
    attrs = genai_request_attributes(
        kind or "route",
        model,
        stream=inference.stream if inference is not None else None,
        max_tokens=inference.max_tokens if inference is not None else None,
        conversation_id=routing.session_id,
    )
    r = d.route
    attrs[ATTR_ENDPOINT] = d.destination.split(",", 1)[0]
    if len(d.routes) > 1:
        attrs[ATTR_FALLBACKS] = [host_port(x.url) for x in d.routes[1:]]
    attrs[ATTR_PICK_REASON] = r.reason
    if r.predicted_ttft_s is not None:
        attrs[ATTR_PREDICTED_TTFT_S] = r.predicted_ttft_s
    if r.cached_tokens is not None:
        attrs[ATTR_PREDICTED_CACHED_TOKENS] = r.cached_tokens
    if routing.tenant:
        attrs[ATTR_TENANT] = routing.tenant
    attrs[ATTR_DECISION_S] = d.decided_s
    return tracer.start_span(
        span_name(kind or "route", model),
        context=context_from_trace(routing.trace),
        attributes=attrs,
    )


def end_span(
    span: Span, status: int, route: Route | None, *, ok: bool, cached_tokens: int | None = None
) -> None:
    """`status`: the response's (0 when unknown); `route`: the endpoint that served, if any."""
    attrs: dict[str, Any] = {ATTR_OUTCOME: "ok" if ok else ("error" if status else "unknown")}
    if status:
        attrs[HTTP_STATUS] = status
    if route is not None:
        attrs[ATTR_SERVED] = host_port(route.url)
    if cached_tokens is not None:
        attrs[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached_tokens
    span.set_attributes(attrs)
    span.end()


def reject_span(tracer: Tracer, status: int, code: str, routing: RoutingHeaders | None) -> None:
    parent = context_from_trace(routing.trace) if routing is not None else None
    span = tracer.start_span(
        span_name("route", None),
        context=parent,
        attributes={HTTP_STATUS: status, ERROR_TYPE: code, ATTR_OUTCOME: "rejected"},
    )
    span.end()


def continue_trace(mutation: pb.HeaderMutation, span: Span, routing: RoutingHeaders) -> None:
    """Name the picker's span as the upstream request's parent (W3C traceparent, with the
    span's tracestate, else the client's), so the engine's work joins the trace under the
    decision. A tracestate that cannot go with the new traceparent is removed."""
    value = traceparent_of(span)
    if value is None:
        return
    mutation.set_headers.append(set_header("traceparent", value))
    state = span.get_span_context().trace_state.to_header()
    if not state and routing.trace is not None and routing.trace.tracestate:
        state = routing.trace.tracestate
    if state:
        mutation.set_headers.append(set_header("tracestate", state))
    else:
        mutation.remove_headers.append("tracestate")
