"""`meshd picker`: an Envoy ext_proc server that picks the endpoint for each inference request
with the same `filters/` router the sidecar uses, and answers in the Gateway API Inference
Extension's endpoint picker protocol (header + `envoy.lb` dynamic metadata).

Protocols followed (looked up, not copied):
- Envoy ExternalProcessor (envoyproxy/envoy:
  api/envoy/service/ext_proc/v3/external_processor.proto), bindings from the `xds-protos` wheel.
- Endpoint picker protocol (kubernetes-sigs/gateway-api-inference-extension:
  docs/proposals/004-endpoint-picker-protocol/README.md): `x-gateway-destination-endpoint`
  header and `envoy.lb` metadata with the same `ip:port[,ip:port...]` value; 503 when no
  endpoint is ready, 429 when shedding; the optional `envoy.lb.subset_hint` subset; gRPC health
  for "", `liveness`, `readiness` and the ext_proc service name.
- gRPC health checking (grpc/grpc: doc/health-checking.md), implemented here on a generic
  handler: its two messages have one field each.

Body modes: BUFFERED (Envoy waits for the headers answer, then sends the whole body; the
destination rides on the body answer) and FULL_DUPLEX_STREAMED (Envoy sends headers and body
without waiting; the headers answer is held until the body is complete, then the body is
sent back whole). With STREAMED Envoy holds body chunks until the headers are answered, so
only a header-based pick is possible there, unless Envoy sends the body without waiting
(`send_body_without_waiting_for_header_response`): then the headers answer is held until the
body is complete, and every held chunk is answered after it.

Request headers must be sent (`request_header_mode: SEND`): with them skipped Envoy passes the
headers on at once, so the router picks the upstream before the body (and the picker's answer)
arrive, and it ignores the header mutation and metadata of the body answer (seen with 1.40).

Fallbacks: with `--fallbacks N` the value is `primary,fallback1,...`; Envoy's override_host load
balancing policy walks the list on retries and reports the endpoint that served under
`envoy.lb` / `x-gateway-destination-endpoint-served` (selected_host_key), which the picker reads
on the response (or, failing that, the `upstream.address` response attribute) to charge the
skipped endpoints with a connect failure and the rest of the request to the one that served.

Traces (`--otlp-endpoint`): a span per decision, continuing the client's traceparent; the
answer sets `traceparent` naming that span (and `tracestate`: the span's, else the client's;
removed when there is none), so Envoy's upstream request, and the engine's work, continue the
trace under the decision. Without a tracer the client's headers pass untouched. Tested with
Envoy's own tracing off; with it on, Envoy's router may write its own span there instead.

Endpoints are static (`--endpoint`). To take engine state from meshd's control plane the
picker would run the sidecar's subscriber (meshd/control_feed.py ControlFeed) on its loop with
its router as the one pool (envoy/README.md, "Endpoints from the control plane").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from filters.hotpath import block_hashes, parse_routing_headers
from filters.picker import PickRequest
from filters.pool_router import POLICIES, EndpointSpec, Policy, PoolRouter, Route, make_router
from filters.request import PATH_KINDS, InferenceRequest, RequestError, parse_inference_request
from filters.routing_headers import RoutingHeaders
from meshd.errors import error_body
from meshd.telemetry import (
    ATTR_ENDPOINT,
    ATTR_OUTCOME,
    ATTR_PREDICTED_CACHED_TOKENS,
    ATTR_PREDICTED_TTFT_S,
    ATTR_TENANT,
    ERROR_TYPE,
    EVENT_FIRST_TOKEN,
    GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    context_from_trace,
    genai_request_attributes,
    span_name,
    traceparent_of,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("meshd.picker")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Set by the data plane on the response: the endpoint that served (protocol v1.0.0); Envoy's
# override_host policy writes it with `selected_host_key`.
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Where Envoy puts the values of `request_attributes` / `response_attributes`.
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
UPSTREAM_ATTRIBUTE = "upstream.address"
# Response attributes the picker reads (the endpoint that served, when no metadata says so).
RESPONSE_ATTRIBUTES = (UPSTREAM_ATTRIBUTE,)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
# Tail of a response body kept to find `usage` in (the last SSE event, or a JSON body).
RESPONSE_TAIL_BYTES = 8192
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # matches the bootstrap's buffer limit
DEFAULT_DRAIN_GRACE_S = 10.0
_BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
# Span attributes of the picker's own (meshd.* namespace; HTTP status is the stable semconv key).
HTTP_STATUS = "http.response.status_code"
ATTR_FALLBACKS = "meshd.pick.fallbacks"
ATTR_PICK_REASON = "meshd.pick.reason"
ATTR_SERVED = "meshd.pick.served"
ATTR_DECISION_S = "meshd.pick.decision_s"


@dataclass(frozen=True, slots=True)
class PickerSettings:
    """Everything `meshd picker` is configured with; each limit is named and defaulted."""

    endpoints: tuple[EndpointSpec, ...]
    policy: Policy = "meshd"
    # x-meshd-* from Envoy's downstream are client-controlled unless Envoy strips them first.
    trust_routing_headers: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_in_flight: int | None = None
    # Endpoints after the primary in the header/metadata list. 0 for ORIGINAL_DST clusters,
    # which parse the header as one address; >0 for data planes that walk the list.
    fallbacks: int = 0
    block_size_bytes: int = 64
    cache_salt: str = ""
    retry_after_s: float = 1.0
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one endpoint")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1 or None")
        if self.fallbacks < 0 or self.max_body_bytes < 1:
            raise ValueError("fallbacks must be >= 0 and max_body_bytes >= 1")


def endpoint_spec(text: str) -> EndpointSpec:
    """`host:port` or `host:port=GPU` (the --endpoint flag) as an EndpointSpec."""
    addr, _, gpu = text.partition("=")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port[=GPU], got {text!r}")
    return EndpointSpec(f"http://{addr}", gpu=gpu or None)


def host_port(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


@dataclass(frozen=True, slots=True)
class Decision:
    """What the picker answered for one request, kept for observation and tests."""

    destination: str  # the header value: primary first
    route: Route  # the primary
    pick: PickRequest
    decided_s: float  # time spent deciding (parse + hash + order)
    routes: tuple[Route, ...] = ()  # primary, then the fallbacks, as in `destination`


@dataclass
class _Stream:
    """One HTTP request's ext_proc stream."""

    path: str = ""
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    body: bytearray = dataclasses.field(default_factory=bytearray)
    body_mode: int = _BodyMode.BUFFERED
    saw_headers: bool = False
    saw_metadata: bool = False
    # STREAMED with send_body_without_waiting_for_header_response: the headers answer is held
    # until the body is complete, and each held chunk is answered after it.
    early_body: bool = False
    held_chunks: int = 0
    subset: frozenset[str] | None = None
    decision: Decision | None = None
    route: Route | None = None  # the endpoint the request is charged to now
    rid: int = 0
    status: int = 0
    first_token: bool = False
    tail: bytes = b""
    counted: bool = False
    span: Span | None = None


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _set_header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(
    status: int, message: str, code: str, retry_after_s: float | None = None
) -> pb.ProcessingResponse:
    """An OpenAI-style JSON error Envoy sends to the client instead of forwarding."""
    body = json.dumps(error_body(status, message, code), separators=(",", ":")).encode()
    headers = [_set_header("content-type", "application/json"), _set_header("x-meshd-error", code)]
    if retry_after_s is not None:
        headers.append(_set_header("retry-after", str(max(1, round(retry_after_s)))))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=body,
            details=f"meshd_{code}",
        )
    )


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ExternalProcessor: one `Process` stream per HTTP request. Not thread-safe; runs on
    one asyncio loop (grpc.aio), like the router objects it drives."""

    def __init__(
        self,
        settings: PickerSettings,
        *,
        router: PoolRouter | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        self.router = router or make_router(settings.policy, settings.endpoints)
        self.clock = clock
        # None: no spans at all (the default; costs one attribute test per decision).
        self.tracer = tracer
        self.in_flight = 0
        self.serving = True
        self.decisions = 0
        self.rejected: dict[int, int] = {}
        self.decision_s: list[float] = []  # bounded sample for benchmarks
        self.on_decision: Callable[[Decision], None] | None = None
        self._rids = itertools.count(1)
        self._by_host = {host_port(e.url): e for e in settings.endpoints}

    # -- the stream ---------------------------------------------------------------------------

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        s = _Stream(rid=next(self._rids))
        try:
            async for req in request_iterator:
                for resp in self._handle(s, req):
                    yield resp
        finally:
            self._close(s)

    def _handle(self, s: _Stream, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        which = req.WhichOneof("request")
        if req.HasField("protocol_config"):
            pc = req.protocol_config
            s.body_mode = pc.request_body_mode
            s.early_body = pc.send_body_without_waiting_for_header_response
        if not s.saw_metadata and which in ("request_headers", "request_body"):
            s.saw_metadata = True
            s.subset = _subset_hint(req.metadata_context)
        if which == "request_headers":
            return self._on_request_headers(s, req.request_headers)
        if which == "request_body":
            return self._on_request_body(s, req.request_body)
        if which == "response_headers":
            return [self._on_response_headers(s, req)]
        if which == "response_body":
            return [self._on_response_body(s, req.response_body)]
        if which == "request_trailers":
            return self._on_request_trailers(s)
        if which == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _on_request_headers(self, s: _Stream, hm: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        s.saw_headers = True
        for h in hm.headers.headers:
            value = _header_value(h)
            if h.key == ":path":
                s.path = value
            elif not h.key.startswith(":"):
                s.headers.append((h.key, value))
        mode = s.body_mode
        if (
            hm.end_of_stream
            or mode == _BodyMode.NONE
            or (mode == _BodyMode.STREAMED and not s.early_body)
        ):
            # Nothing more will arrive before Envoy routes: decide from what we have.
            return [self._decide(s, b"", "request_headers")]
        if mode == _BodyMode.BUFFERED:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []  # FULL_DUPLEX_STREAMED, or STREAMED with the body sent early: hold the answer

    def _on_request_body(self, s: _Stream, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if s.decision is not None:  # STREAMED after a header-based pick: pass chunks through
            return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        if len(s.body) + len(body.body) > self.settings.max_body_bytes:
            return [
                self._reject(
                    413,
                    f"the request body exceeds {self.settings.max_body_bytes} bytes",
                    "body_too_large",
                )
            ]
        s.body += body.body
        mode = s.body_mode
        if mode == _BodyMode.STREAMED:
            s.held_chunks += 1
            return self._answer_held(s) if body.end_of_stream else []
        if mode == _BodyMode.FULL_DUPLEX_STREAMED:
            return self._answer_duplex(s) if body.end_of_stream else []
        # BUFFERED: the whole body, in one message; headers answered already or skipped.
        return [self._decide(s, bytes(s.body), "request_body")]

    def _answer_held(self, s: _Stream) -> list[pb.ProcessingResponse]:
        """STREAMED, body sent early: the held headers answer, then one per held chunk."""
        first = self._decide(s, bytes(s.body), "request_headers")
        if first.HasField("immediate_response"):
            return [first]
        chunk = pb.ProcessingResponse(request_body=pb.BodyResponse())
        return [first, *([chunk] * s.held_chunks)]

    def _answer_duplex(self, s: _Stream) -> list[pb.ProcessingResponse]:
        # The held headers answer carries the destination; the body goes back whole, since in
        # this mode Envoy forwards only what the processor returns.
        first = self._decide(s, bytes(s.body), "request_headers")
        if first.HasField("immediate_response"):
            return [first]
        back = pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(
                            body=bytes(s.body), end_of_stream=True
                        )
                    )
                )
            )
        )
        return [first, back]

    def _on_request_trailers(self, s: _Stream) -> list[pb.ProcessingResponse]:
        trailers = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        if s.decision is not None or not s.saw_headers:
            return [trailers]
        # The body ended with trailers, not end_of_stream: the held answers are due now.
        if s.body_mode == _BodyMode.STREAMED and s.early_body:
            return [*self._answer_held(s), trailers]
        if s.body_mode == _BodyMode.FULL_DUPLEX_STREAMED:
            return [*self._answer_duplex(s), trailers]
        return [trailers]

    def _decide(self, s: _Stream, body: bytes, phase: str) -> pb.ProcessingResponse:
        t0 = time.perf_counter()
        cfg = self.settings
        if not self.serving:
            return self._reject(
                503, "the endpoint picker is draining", "draining", cfg.retry_after_s
            )
        if cfg.max_in_flight is not None and self.in_flight >= cfg.max_in_flight:
            return self._reject(
                429,
                f"too many requests in flight ({self.in_flight} of {cfg.max_in_flight})",
                "overloaded",
                cfg.retry_after_s,
            )
        routing, _ = parse_routing_headers(s.headers, cfg.trust_routing_headers)
        if routing.errors:
            return self._reject(400, "; ".join(routing.errors), "bad_routing_header")
        now = self.clock()
        kind = PATH_KINDS.get(s.path.split("?", 1)[0])
        inference: InferenceRequest | None = None
        if kind is not None and body:
            try:
                inference = parse_inference_request(kind, body)
            except RequestError as exc:
                return self._reject(400, exc.message, exc.code, routing=routing)
            hashes = block_hashes(
                inference.prompt_text, inference.model, cfg.cache_salt, cfg.block_size_bytes
            )
            pick = PickRequest.build(inference, routing, now, block_hashes=hashes)
        else:
            pick = _headers_only(routing)
        routes = self.router.order(pick, now)
        if s.subset is not None:
            routes = [r for r in routes if host_port(r.url) in s.subset]
        if not routes or all(r.reason == "no-eligible-endpoint" for r in routes):
            return self._reject(
                503, "no ready endpoint", "no_ready_endpoint", cfg.retry_after_s, routing=routing
            )
        chosen = tuple(routes[: 1 + cfg.fallbacks])
        value = ",".join(host_port(r.url) for r in chosen)
        self.router.started(chosen[0], s.rid, pick, now)
        s.route = chosen[0]
        s.counted = True
        self.in_flight += 1
        decided = time.perf_counter() - t0
        s.decision = Decision(value, chosen[0], pick, decided, chosen)
        self.decisions += 1
        if len(self.decision_s) < 100_000:
            self.decision_s.append(decided)
        if self.tracer is not None:
            s.span = self._start_span(kind, inference, routing, s.decision)
        if self.on_decision is not None:
            self.on_decision(s.decision)
        mutation = pb.HeaderMutation(set_headers=[_set_header(DESTINATION_HEADER, value)])
        if s.span is not None:
            _continue_trace(mutation, s.span, routing)
        common = pb.CommonResponse(
            header_mutation=mutation,
            # Envoy may have matched a route already (the header-less fallback one): without
            # this the new header never reaches route selection.
            clear_route_cache=True,
        )
        meta = struct_pb2.Struct()
        meta.update({METADATA_NAMESPACE: {DESTINATION_HEADER: value}})
        if phase == "request_headers":
            return pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta
            )
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(response=common), dynamic_metadata=meta
        )

    def _reject(
        self,
        status: int,
        message: str,
        code: str,
        retry_after_s: float | None = None,
        *,
        routing: RoutingHeaders | None = None,
    ) -> pb.ProcessingResponse:
        self.rejected[status] = self.rejected.get(status, 0) + 1
        if self.tracer is not None:
            self._reject_span(status, code, routing)
        return immediate(status, message, code, retry_after_s)

    # -- the response side --------------------------------------------------------------------

    def _on_response_headers(self, s: _Stream, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        hm = req.response_headers
        for h in hm.headers.headers:
            if h.key == ":status":
                v = _header_value(h)
                s.status = int(v) if v.isdigit() else 0
        if s.decision is not None and s.counted:
            served = _served_endpoint(req)
            if served is not None:
                self._charge_served(s, served)
            route = s.route
            if route is not None and s.status in (502, 503, 504):
                # Envoy's own local reply for a refused or reset upstream connection.
                self.router.connect_failed(route, s.rid, self.clock(), f"http {s.status}")
                self._end_span(s, ok=False)
                self._uncount(s)
            elif hm.end_of_stream:
                self._finish(s)
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())

    def _charge_served(self, s: _Stream, served: str) -> None:
        """Envoy went down the fallback list (retries): the endpoints it passed did not take
        the request; the one that served carries it from here."""
        d = s.decision
        current = s.route
        if d is None or current is None or host_port(current.url) == served:
            return
        now = self.clock()
        later = d.routes[d.routes.index(current) :] if current in d.routes else (current,)
        for r in later:
            if host_port(r.url) == served:
                self.router.started(r, s.rid, d.pick, now)
                s.route = r
                return
            if r is not current:
                self.router.started(r, s.rid, d.pick, now)
            self.router.connect_failed(r, s.rid, now, f"envoy retried on {served}")
        # Past the list: Envoy's own fallback policy chose `served`.
        spec = self._by_host.get(served)
        if spec is None:
            s.route = None  # not an endpoint we route to; nothing to charge
            self._uncount(s)
            return
        s.route = Route(spec.url, "envoy-fallback-policy")
        self.router.started(s.route, s.rid, d.pick, now)

    def _on_response_body(self, s: _Stream, body: pb.HttpBody) -> pb.ProcessingResponse:
        route = s.route
        if route is not None and s.counted:
            if not s.first_token and body.body:
                s.first_token = True
                self.router.first_token(route, s.rid, self.clock())
                if s.span is not None:
                    s.span.add_event(EVENT_FIRST_TOKEN)
            s.tail = (s.tail + body.body)[-RESPONSE_TAIL_BYTES:]
            if body.end_of_stream:
                self._finish(s)
        return pb.ProcessingResponse(response_body=pb.BodyResponse())

    def _finish(self, s: _Stream) -> None:
        d, route = s.decision, s.route
        assert d is not None
        found = _CACHED_TOKENS.findall(s.tail)
        cached = int(found[-1]) if found else None
        # A stream's output tokens time its decode (the router's decode calibration); a
        # body that came whole has no first token apart from its last, so it gives none.
        found = _COMPLETION_TOKENS.findall(s.tail) if b"data:" in s.tail else []
        completion = int(found[-1]) if found else None
        # Unknown status (response side not sent, or the client left first): neither a success
        # nor a failure for the breakers.
        ok = 0 < s.status < 500
        if route is not None:
            self.router.finished(
                route,
                s.rid,
                d.pick,
                self.clock(),
                ok=ok,
                cached_tokens=cached,
                completion_tokens=completion,
            )
        self._end_span(s, ok=ok, cached_tokens=cached)
        self._uncount(s)

    def _uncount(self, s: _Stream) -> None:
        if s.counted:
            s.counted = False
            self.in_flight -= 1

    def _close(self, s: _Stream) -> None:
        """The stream ended (request done, client gone, or Envoy reset it)."""
        if s.decision is not None and s.counted:
            self._finish(s)

    # -- spans (only with a tracer: `--otlp-endpoint`) -----------------------------------------

    def _start_span(
        self,
        kind: str | None,
        inference: InferenceRequest | None,
        routing: RoutingHeaders,
        d: Decision,
    ) -> Span:
        assert self.tracer is not None
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
        return self.tracer.start_span(
            span_name(kind or "route", model),
            context=context_from_trace(routing.trace),
            attributes=attrs,
        )

    def _end_span(self, s: _Stream, *, ok: bool, cached_tokens: int | None = None) -> None:
        span, s.span = s.span, None
        if span is None:
            return
        attrs: dict[str, Any] = {ATTR_OUTCOME: "ok" if ok else ("error" if s.status else "unknown")}
        if s.status:
            attrs[HTTP_STATUS] = s.status
        if s.route is not None:
            attrs[ATTR_SERVED] = host_port(s.route.url)
        if cached_tokens is not None:
            attrs[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached_tokens
        span.set_attributes(attrs)
        span.end()

    def _reject_span(self, status: int, code: str, routing: RoutingHeaders | None) -> None:
        assert self.tracer is not None
        parent = context_from_trace(routing.trace) if routing is not None else None
        span = self.tracer.start_span(
            span_name("route", None),
            context=parent,
            attributes={HTTP_STATUS: status, ERROR_TYPE: code, ATTR_OUTCOME: "rejected"},
        )
        span.end()


def _continue_trace(mutation: pb.HeaderMutation, span: Span, routing: RoutingHeaders) -> None:
    """Name the picker's span as the upstream request's parent (W3C traceparent, with the
    span's tracestate, else the client's), so the engine's work joins the trace under the
    decision. A tracestate that cannot go with the new traceparent is removed."""
    value = traceparent_of(span)
    if value is None:
        return
    mutation.set_headers.append(_set_header("traceparent", value))
    state = span.get_span_context().trace_state.to_header()
    if not state and routing.trace is not None and routing.trace.tracestate:
        state = routing.trace.tracestate
    if state:
        mutation.set_headers.append(_set_header("tracestate", state))
    else:
        mutation.remove_headers.append("tracestate")


def _served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint that served, as the data plane reports it: `envoy.lb` metadata first (the
    protocol's way), then the `upstream.address` response attribute."""
    md = req.metadata_context.filter_metadata
    if METADATA_NAMESPACE in md:
        fields = md[METADATA_NAMESPACE].fields
        if SERVED_KEY in fields:
            return fields[SERVED_KEY].string_value or None
    if ATTRIBUTES_NAMESPACE in req.attributes:
        fields = req.attributes[ATTRIBUTES_NAMESPACE].fields
        if UPSTREAM_ATTRIBUTE in fields:
            return fields[UPSTREAM_ATTRIBUTE].string_value or None
    return None


def _headers_only(routing: RoutingHeaders) -> PickRequest:
    """A request without an inference body (GET /v1/models, a STREAMED body): routed by load
    and workflow stickiness only."""
    return PickRequest(
        model="",
        tenant=routing.tenant,
        priority=routing.priority,
        context_key=routing.workflow_id or routing.session_id or routing.task_id,
    )


def _subset_hint(md: base_pb2.Metadata) -> frozenset[str] | None:
    ns = md.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    lv = ns.fields[SUBSET_KEY].list_value
    return frozenset(v.string_value for v in lv.values)


# -- gRPC health (grpc.health.v1) ---------------------------------------------------------------

SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


def _decode_health_request(data: bytes) -> str:
    """HealthCheckRequest{string service = 1}: the only field, so a tiny decoder suffices."""
    i, n = 0, len(data)
    service = ""
    while i < n:
        tag, i = _varint(data, i)
        wire = tag & 7
        if wire == 2:
            length, i = _varint(data, i)
            if tag >> 3 == 1:
                service = data[i : i + length].decode("utf-8", "replace")
            i += length
        elif wire == 0:
            _, i = _varint(data, i)
        else:
            raise ValueError("unexpected wire type in HealthCheckRequest")
    return service


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _encode_health_response(status: int) -> bytes:
    return bytes((0x08, status))  # field 1, varint; the statuses are < 128


class HealthService(grpc.GenericRpcHandler):
    """grpc.health.v1.Health/Check (Watch answers UNIMPLEMENTED, which the spec allows
    clients to treat as "use Check")."""

    def __init__(self, status: Callable[[str], int]) -> None:
        self._status = status

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method != "/grpc.health.v1.Health/Check":
            return None
        return grpc.unary_unary_rpc_method_handler(
            self._check,
            request_deserializer=_decode_health_request,
            response_serializer=_encode_health_response,
        )

    async def _check(self, service: str, context: grpc.aio.ServicerContext[Any, Any]) -> int:
        status = self._status(service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return status


# -- the server ----------------------------------------------------------------------------------


class PickerServer:
    """The grpc.aio server: ext_proc + health on one port."""

    def __init__(
        self,
        settings: PickerSettings,
        listen: str = "127.0.0.1:9002",
        *,
        router: PoolRouter | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.picker = EndpointPicker(settings, router=router, tracer=tracer)
        self.listen = listen
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def health(self, service: str) -> int:
        if service not in HEALTH_SERVICES:
            return SERVICE_UNKNOWN
        if service == "liveness":
            return SERVING
        return SERVING if self.picker.serving else NOT_SERVING

    async def start(self) -> int:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        server.add_generic_rpc_handlers((HealthService(self.health),))
        self.port = server.add_insecure_port(self.listen)
        if not self.port:
            raise OSError(f"cannot listen on {self.listen}")
        await server.start()
        self._server = server
        return self.port

    async def drain_and_stop(self, grace_s: float | None = None) -> None:
        """Readiness goes NOT_SERVING, new picks get 503; running streams get `grace_s`."""
        self.picker.serving = False
        if self._server is not None:
            grace = self.picker.settings.drain_grace_s if grace_s is None else grace_s
            await self._server.stop(grace)
            self._server = None

    async def kill(self) -> None:
        """Stop at once, cancelling every stream (tests: the picker dies mid-run)."""
        if self._server is not None:
            await self._server.stop(None)
            self._server = None


# -- CLI -----------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "picker",
        help="run the Envoy ext_proc endpoint picker",
        description="Serve Envoy's ext_proc API: pick the endpoint for each inference request "
        "and answer in the Gateway API Inference Extension's endpoint picker protocol "
        f"({DESTINATION_HEADER} header and {METADATA_NAMESPACE} metadata). Prints "
        '{"event": "ready", "listen": ...} once it listens; SIGTERM drains.',
    )
    p.add_argument("--listen", default="127.0.0.1:9002", help="gRPC address (default %(default)s)")
    p.add_argument(
        "--endpoint",
        action="append",
        required=True,
        type=endpoint_spec,
        metavar="HOST:PORT[=GPU]",
        help="an engine endpoint; repeat for each (GPU e.g. H100)",
    )
    p.add_argument("--policy", choices=POLICIES, default="meshd")
    p.add_argument("--max-in-flight", type=int, default=None, help="shed with 429 above this")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--fallbacks",
        type=int,
        default=0,
        help="fallback endpoints after the primary in the answer (0 for ORIGINAL_DST clusters)",
    )
    p.add_argument(
        "--trust-routing-headers",
        action="store_true",
        help="parse x-meshd-* headers from Envoy (only when Envoy strips them from clients)",
    )
    p.add_argument("--drain-grace-s", type=float, default=DEFAULT_DRAIN_GRACE_S)
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="export a span per decision over OTLP/gRPC (default: no spans at all)",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=1.0,
        help="share of new traces kept; a client's sampled flag is honoured (default 1.0)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = PickerSettings(
        endpoints=tuple(args.endpoint),
        policy=args.policy,
        trust_routing_headers=args.trust_routing_headers,
        max_body_bytes=args.max_body_bytes,
        max_in_flight=args.max_in_flight,
        fallbacks=args.fallbacks,
        drain_grace_s=args.drain_grace_s,
    )
    provider: TracerProvider | None = None
    if args.otlp_endpoint:
        from meshd.telemetry import setup_tracing

        provider = setup_tracing("meshd-picker", args.otlp_endpoint, args.trace_sample_ratio)
    try:
        tracer = provider.get_tracer("meshd.picker") if provider is not None else None
        return asyncio.run(_serve(settings, args.listen, tracer))
    finally:
        if provider is not None:
            provider.shutdown()  # flushes the spans still queued


async def _serve(settings: PickerSettings, listen: str, tracer: Tracer | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = PickerServer(settings, listen, tracer=tracer)
    port = await server.start()
    host = listen.rpartition(":")[0]
    print(json.dumps({"event": "ready", "listen": f"{host}:{port}"}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(json.dumps({"event": "draining", "in_flight": server.picker.in_flight}), flush=True)
    await server.drain_and_stop()
    return 0


__all__ = [
    "DESTINATION_HEADER",
    "Decision",
    "EndpointPicker",
    "PickerServer",
    "PickerSettings",
    "endpoint_spec",
    "immediate",
    "register",
]


def main(argv: list[str] | None = None) -> int:
    """`python -m meshd.extproc picker ...`, for use before the CLI lists this module."""
    parser = argparse.ArgumentParser(prog="meshd")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
