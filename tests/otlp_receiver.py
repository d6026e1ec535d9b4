"""A real OTLP/gRPC trace receiver for tests: grpcio serving opentelemetry-proto's
TraceService (opentelemetry/proto/collector/trace/v1/trace_service.proto) on 127.0.0.1:0,
keeping every ExportTraceServiceRequest and offering its spans flattened for assertions.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    kind: int
    attributes: Mapping[str, Any]
    events: Sequence[tuple[str, Mapping[str, Any]]]
    service_name: str | None
    start_ns: int
    end_ns: int
    metadata: Mapping[str, str]


class OtlpReceiver:
    """Start with `start()`, point an exporter at `endpoint`, read `spans()`."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def _add(
        self, request: trace_service_pb2.ExportTraceServiceRequest, metadata: dict[str, str]
    ) -> None:
        spans = []
        for rs in request.resource_spans:
            res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            events=[
                                (e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in s.events
                            ],
                            service_name=res.get("service.name"),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            metadata=metadata,
                        )
                    )
        with self._cond:
            self.requests.append(request)
            self._spans.extend(spans)
            self._cond.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def wait_for(self, n: int, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """Block until `n` spans arrived (an event, not a sleep); returns what arrived."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._spans) >= n, timeout_s)
            return list(self._spans)

    def by_name(self) -> dict[str, list[ReceivedSpan]]:
        out: dict[str, list[ReceivedSpan]] = {}
        for s in self.spans():
            out.setdefault(s.name, []).append(s)
        return out


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        metadata = {k: str(v) for k, v in context.invocation_metadata()}
        self._receiver._add(request, metadata)
        return trace_service_pb2.ExportTraceServiceResponse()
