"""The picker proper: `EndpointPicker`, Envoy's ExternalProcessor, one `Process` stream per
HTTP request. It reads the request (headers, then the body as the body mode brings it), asks
the router for an order, answers with the destination, and charges the response to the endpoint
that served. The protocol notes (body modes, fallbacks) are in meshd/extproc.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from filters.deadline import late_refusal
from filters.disagg import PD_HEADER, PREFILL_HEADERS, PdServed, Split, parse_pd_header
from filters.guard import OVERLOAD_STATUSES
from filters.hotpath import block_hashes, parse_routing_headers
from filters.picker import PickRequest
from filters.pool_router import EndpointSpec, Policy, PoolRouter, Route, make_router
from filters.request import PATH_KINDS, InferenceRequest, RequestError, parse_inference_request
from filters.routing_headers import RoutingHeaders
from meshd.extproc_messages import (
    DESTINATION_HEADER,
    METADATA_NAMESPACE,
    header_value,
    host_port,
    immediate,
    served_endpoint,
    set_header,
    subset_hint,
)
from meshd.extproc_pd import PdSettings, PrefillPlanner
from meshd.extproc_spans import continue_trace, end_span, reject_span, start_span
from meshd.telemetry import ATTR_KV_TRANSFER_S, EVENT_FIRST_TOKEN

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

# Tail of a response body kept to find `usage` in (the last SSE event, or a JSON body).
RESPONSE_TAIL_BYTES = 8192
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # matches the bootstrap's buffer limit
DEFAULT_DRAIN_GRACE_S = 10.0
_BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode


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
    # A new task's request predicted to end after its deadline: 429 (filters/deadline.py).
    refuse_predicted_late: bool = True
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S
    # Prefill/decode (meshd/extproc_pd.py): the prefill side; `endpoints` are then the
    # decode endpoints. None: an aggregated pool.
    pd: PdSettings | None = None

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one endpoint")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1 or None")
        if self.fallbacks < 0 or self.max_body_bytes < 1:
            raise ValueError("fallbacks must be >= 0 and max_body_bytes >= 1")


@dataclass(frozen=True, slots=True)
class Decision:
    """What the picker answered for one request, kept for observation and tests."""

    destination: str  # the header value: primary first
    route: Route  # the primary
    pick: PickRequest
    decided_s: float  # time spent deciding (parse + hash + order)
    routes: tuple[Route, ...] = ()  # primary, then the fallbacks, as in `destination`
    # Prefill/decode: the decider's answer and the prefill endpoints named (() when whole).
    pd: Split | None = None
    prefill: tuple[Route, ...] = ()


# The decision span's P/D attributes (only for a disaggregated pool): split, or
# whole:<the decider's reason> (the access log's `pd`); the prefill endpoints named, first
# to try first; the prefill engine's predicted TTFT; and the predicted KV transfer.
ATTR_PD = "meshd.pd"
ATTR_PD_PREFILL_ENDPOINTS = "meshd.pd.prefill_endpoints"
ATTR_PD_PREFILL_TTFT_S = "meshd.pd.prefill_predicted_ttft_s"
# What the decode endpoint's proxy did (its x-meshd-pd, when it is a meshd that trusts
# Envoy): split or whole:<why>, and the prefill engine that served the prefill step.
ATTR_PD_SERVED = "meshd.pd.served"
ATTR_PD_SERVED_PREFILL = "meshd.pd.served_prefill_endpoint"
# At most this many distinct outcomes are counted apart (EndpointPicker.pd_served); later
# ones count as `whole:other`.
MAX_PD_OUTCOMES = 32


def pd_attributes(split: Split, prefill: tuple[Route, ...]) -> dict[str, Any]:
    """The span attributes of a P/D decision: what was decided and, split, where the
    prefill goes and what it is predicted to take."""
    if not prefill:
        return {ATTR_PD: f"whole:{split.reason}"}
    attrs: dict[str, Any] = {
        ATTR_PD: "split",
        ATTR_PD_PREFILL_ENDPOINTS: [host_port(r.url) for r in prefill],
        ATTR_KV_TRANSFER_S: split.transfer_s,
    }
    if split.prefill_ttft_s is not None:
        attrs[ATTR_PD_PREFILL_TTFT_S] = split.prefill_ttft_s
    return attrs


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
    # Prefill/decode: the prefill route charged with this request until the answer's head.
    prefill: Route | None = None
    prefill_pick: PickRequest | None = None
    # What the decode endpoint's proxy said it did (x-meshd-pd); None: it said nothing.
    pd_served: PdServed | None = None


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ExternalProcessor: one `Process` stream per HTTP request. Not thread-safe; runs on
    one asyncio loop (grpc.aio), like the router objects it drives."""

    def __init__(
        self,
        settings: PickerSettings,
        *,
        router: PoolRouter | None = None,
        prefill_router: PoolRouter | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        self.router = router or make_router(settings.policy, settings.endpoints)
        self.pd = (
            PrefillPlanner(settings.pd, settings.endpoints, settings.policy, router=prefill_router)
            if settings.pd is not None
            else None
        )
        self.clock = clock
        # None: no spans at all (the default; costs one attribute test per decision).
        self.tracer = tracer
        self.in_flight = 0
        self.serving = True
        self.decisions = 0
        self.rejected: dict[int, int] = {}
        self.decision_s: list[float] = []  # bounded sample for benchmarks
        # P/D: what the decode endpoints' proxies said they did (x-meshd-pd), by the access
        # log's name (split, whole:<why>); the decisions are in `on_decision`'s Decision.
        self.pd_served: dict[str, int] = {}
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
            s.subset = subset_hint(req.metadata_context)
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
            value = header_value(h)
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
        plan = None
        if self.pd is not None and inference is not None:
            plan = self.pd.plan(pick, now, self.router, 1 + cfg.fallbacks)
        if plan is not None and plan.split.split and self.pd is not None:
            routes = self.pd.order_decode(self.router, pick, plan.split, now)
        else:
            routes = self.router.order(pick, now)
        if s.subset is not None:
            routes = [r for r in routes if host_port(r.url) in s.subset]
        if not routes or all(r.reason == "no-eligible-endpoint" for r in routes):
            return self._reject(
                503, "no ready endpoint", "no_ready_endpoint", cfg.retry_after_s, routing=routing
            )
        if plan is None or not plan.split.split:
            late = self._late(pick, routing, routes[0], now)
            if late is not None:
                return self._reject(
                    429, late, "deadline_unmeetable", cfg.retry_after_s, routing=routing
                )
        chosen = tuple(routes[: 1 + cfg.fallbacks])
        value = ",".join(host_port(r.url) for r in chosen)
        self.router.started(chosen[0], s.rid, pick, now)
        s.route = chosen[0]
        s.counted = True
        self.in_flight += 1
        prefill: tuple[Route, ...] = ()
        if plan is not None and plan.prefill and self.pd is not None:
            prefill = plan.prefill
            self.pd.router.started(prefill[0], s.rid, plan.pick, now)
            s.prefill, s.prefill_pick = prefill[0], plan.pick
        decided = time.perf_counter() - t0
        s.decision = Decision(
            value, chosen[0], pick, decided, chosen, plan.split if plan else None, prefill
        )
        self.decisions += 1
        if len(self.decision_s) < 100_000:
            self.decision_s.append(decided)
        if self.tracer is not None:
            s.span = start_span(self.tracer, kind, inference, routing, s.decision)
            if plan is not None:
                s.span.set_attributes(pd_attributes(plan.split, prefill))
        if self.on_decision is not None:
            self.on_decision(s.decision)
        mutation = pb.HeaderMutation(set_headers=[set_header(DESTINATION_HEADER, value)])
        if prefill:
            named = ",".join(host_port(r.url) for r in prefill)
            mutation.set_headers.extend(set_header(h, named) for h in PREFILL_HEADERS)
        elif self.pd is not None:  # served whole: nobody else may name a prefill endpoint
            mutation.remove_headers.extend(PREFILL_HEADERS)
        if s.span is not None:
            continue_trace(mutation, s.span, routing)
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

    def _late(
        self, pick: PickRequest, routing: RoutingHeaders, best: Route, now: float
    ) -> str | None:
        """Why a request served whole is refused as late, as the sidecar's Attempts._late:
        a new task's (not a step past 0, not a prompt extending one routed before) whose
        best route is predicted to end after its deadline; None: route it."""
        if not self.settings.refuse_predicted_late or pick.deadline_s is None:
            return None
        started = (routing.step or 0) >= 1 or self.router.follow_up(pick, now)
        return late_refusal(self.router, best, pick, now, "default", started=started)

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
            reject_span(self.tracer, status, code, routing)
        return immediate(status, message, code, retry_after_s)

    # -- the response side --------------------------------------------------------------------

    def _on_response_headers(self, s: _Stream, req: pb.ProcessingRequest) -> pb.ProcessingResponse:
        hm = req.response_headers
        said: str | None = None
        for h in hm.headers.headers:
            if h.key == ":status":
                v = header_value(h)
                s.status = int(v) if v.isdigit() else 0
            elif h.key == PD_HEADER:
                said = header_value(h)
        ok = 0 < s.status < 500
        if said is not None and self.pd is not None and s.decision is not None:
            s.pd_served = parse_pd_header(said)
            if s.pd_served is not None:
                ok = self._record_pd(s, s.pd_served) and ok
        self._prefill_over(s, ok=ok)
        if s.decision is not None and s.counted:
            served = served_endpoint(req)
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
        if said is not None and not self.settings.trust_routing_headers:
            # Where the request went inside the mesh is not the client's to see.
            mutation = pb.HeaderMutation(remove_headers=[PD_HEADER])
            return pb.ProcessingResponse(
                response_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(header_mutation=mutation)
                )
            )
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())

    def _record_pd(self, s: _Stream, served: PdServed) -> bool:
        """The decode endpoint's proxy said how it served the request (x-meshd-pd): counted,
        on the decision's span, and whether the prefill engine this picker named first did
        the prefill step (False when the request went whole, or was prefilled elsewhere:
        its charge there ends as not served)."""
        key = served.record
        if key not in self.pd_served and len(self.pd_served) >= MAX_PD_OUTCOMES:
            key = "split" if served.split else "whole:other"
        self.pd_served[key] = self.pd_served.get(key, 0) + 1
        if s.span is not None:
            s.span.set_attribute(ATTR_PD_SERVED, served.record)
            if served.prefill:
                s.span.set_attribute(ATTR_PD_SERVED_PREFILL, served.prefill)
        named = s.prefill
        if named is None:
            return True
        return served.split and served.prefill in (None, host_port(named.url))

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
            if s.status in OVERLOAD_STATUSES:
                self.router.refused(route, self.clock(), None)
        self._end_span(s, ok=ok, cached_tokens=cached)
        self._uncount(s)

    def _uncount(self, s: _Stream) -> None:
        if s.counted:
            s.counted = False
            self.in_flight -= 1

    def _close(self, s: _Stream) -> None:
        """The stream ended (request done, client gone, or Envoy reset it)."""
        self._prefill_over(s, ok=False)
        if s.decision is not None and s.counted:
            self._finish(s)

    def _prefill_over(self, s: _Stream, *, ok: bool) -> None:
        """A split request's prefill leg is over: the decode answer's head came (the decode
        endpoint's proxy sends the decode step once the prefill step answered), or the
        request ended before it (extproc_pd.py)."""
        route, pick = s.prefill, s.prefill_pick
        if route is None or pick is None or self.pd is None:
            return
        s.prefill = None
        self.pd.router.finished(route, s.rid, pick, self.clock(), ok=ok)

    def _end_span(self, s: _Stream, *, ok: bool, cached_tokens: int | None = None) -> None:
        span, s.span = s.span, None
        if span is None:
            return
        end_span(span, s.status, s.route, ok=ok, cached_tokens=cached_tokens)


def _headers_only(routing: RoutingHeaders) -> PickRequest:
    """A request without an inference body (GET /v1/models, a STREAMED body): routed by load
    and workflow stickiness only."""
    return PickRequest(
        model="",
        tenant=routing.tenant,
        priority=routing.priority,
        context_key=routing.workflow_id or routing.session_id or routing.task_id,
    )
