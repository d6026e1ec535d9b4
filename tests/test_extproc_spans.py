# ruff: noqa: F811  (the `rig` fixture, imported from test_extproc, is each test's parameter)
"""The picker's span per decision (meshd picker --otlp-endpoint): made only with a tracer,
named and attributed by the GenAI conventions, continuing the client's trace, and passed on
to the engine in the traceparent the picker's answer sets, through a real Envoy."""

from __future__ import annotations

import argparse
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_extproc import (
    RigFactory,
    envoy_only,
    rig,  # noqa: F401  (the fixture; tests take it as a parameter)
)

from meshd.extproc import endpoint_spec, register
from meshd.extproc_messages import DESTINATION_HEADER
from meshd.extproc_picker import EndpointPicker, PickerSettings, _Stream
from meshd.telemetry import setup_tracing

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


@envoy_only
async def test_a_decision_is_a_span_in_the_clients_trace(rig: RigFactory) -> None:
    exporter = InMemorySpanExporter()
    provider = setup_tracing("meshd-picker", None, exporter=exporter)
    r = await rig(tracer=provider.get_tracer("test"), response_body_mode="STREAMED")
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
    status, _, _ = await r.complete("trace me", stream=True, headers=headers)
    assert status == 200
    body = b"{not json"
    async with r.session.post(
        r.base + "/v1/completions", data=body, headers={"content-type": "application/json"}
    ) as resp:
        assert resp.status == 400
    await r.session.close()
    r.envoy.stop()  # the streams close: every span ends
    await r.picker.kill()
    provider.force_flush()
    spans = exporter.get_finished_spans()
    by_outcome = {s.attributes["meshd.outcome"]: s for s in spans if s.attributes}
    ok = by_outcome["ok"]
    assert ok.name == "text_completion tiny"
    assert ok.context.trace_id == int(TRACE_ID, 16)
    assert ok.parent is not None and ok.parent.span_id == int(PARENT, 16)
    attrs = dict(ok.attributes or {})
    chosen = r.decisions[-1].destination
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "tiny" and attrs["gen_ai.request.stream"] is True
    assert attrs["meshd.endpoint"] == chosen and attrs["meshd.pick.served"] == chosen
    assert attrs["http.response.status_code"] == 200
    assert [e.name for e in ok.events] == ["meshd.first_token"]
    rejected = by_outcome["rejected"]
    assert rejected.attributes is not None
    assert rejected.attributes["http.response.status_code"] == 400
    assert rejected.attributes["error.type"] == "invalid_request"


def test_spans_are_off_unless_an_endpoint_is_given() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["picker", "--endpoint", "127.0.0.1:8000"])
    assert args.otlp_endpoint is None
    args = parser.parse_args(
        ["picker", "--endpoint", "127.0.0.1:8000", "--otlp-endpoint", "127.0.0.1:4317"]
    )
    assert args.otlp_endpoint == "127.0.0.1:4317" and args.trace_sample_ratio == 1.0


# -- trace context in the answer (the engine continues the picker's span) ---------------------

STATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def _answer(p: EndpointPicker, headers: list[tuple[str, str]]) -> Any:
    """The picker's answer to a headers-only request: its header mutation."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode())
            for k, v in [(":path", "/v1/models"), *headers]
        ]
    )
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=True))
    (resp,) = p._handle(_Stream(rid=next(p._rids)), req)
    return resp.request_headers.response.header_mutation


def _set(mutation: Any) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def _picker(tracer: Any) -> EndpointPicker:
    return EndpointPicker(
        PickerSettings(endpoints=(endpoint_spec("10.0.0.1:8000"),)), tracer=tracer
    )


def test_the_answer_carries_the_trace_and_the_clients_tracestate() -> None:
    provider = setup_tracing("meshd-picker", None, exporter=InMemorySpanExporter())
    p = _picker(provider.get_tracer("test"))
    m = _answer(p, [("traceparent", f"00-{TRACE_ID}-{PARENT}-01"), ("tracestate", STATE)])
    sent = _set(m)
    assert sent[DESTINATION_HEADER] == "10.0.0.1:8000"
    version, trace_id, parent, flags = sent["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")  # same trace, still sampled
    assert parent != PARENT  # the picker's span, not the client's
    assert sent["tracestate"] == STATE and list(m.remove_headers) == []


def test_the_decision_span_is_the_parent_in_the_answer() -> None:
    exporter = InMemorySpanExporter()
    provider = setup_tracing("meshd-picker", None, exporter=exporter)
    p = _picker(provider.get_tracer("test"))
    s = _Stream(rid=1)
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models"),
            base_pb2.HeaderValue(
                key="traceparent", raw_value=f"00-{TRACE_ID}-{PARENT}-01".encode()
            ),
        ]
    )
    (resp,) = p._handle(
        s, pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=True))
    )
    p._close(s)  # the stream ends: the decision's span ends
    provider.force_flush()
    (span,) = exporter.get_finished_spans()
    sent = _set(resp.request_headers.response.header_mutation)
    assert sent["traceparent"] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
    assert span.parent is not None and span.parent.span_id == int(PARENT, 16)
    # No tracestate came in, none goes with the picker's traceparent.
    assert "tracestate" not in sent
    assert list(resp.request_headers.response.header_mutation.remove_headers) == ["tracestate"]


def test_a_new_trace_drops_the_old_tracestate_and_unsampled_stays_unsampled() -> None:
    provider = setup_tracing("meshd-picker", None, 1.0, exporter=InMemorySpanExporter())
    p = _picker(provider.get_tracer("test"))
    # An invalid traceparent restarts the trace: its tracestate must not ride along.
    m = _answer(p, [("traceparent", "00-garbage"), ("tracestate", STATE)])
    sent = _set(m)
    assert sent["traceparent"].split("-")[1] != TRACE_ID
    assert "tracestate" not in sent and list(m.remove_headers) == ["tracestate"]
    # The client sampled this trace out: the engine is told so too (flags 00), same trace.
    m = _answer(p, [("traceparent", f"00-{TRACE_ID}-{PARENT}-00")])
    _, trace_id, _, flags = _set(m)["traceparent"].split("-")
    assert (trace_id, flags) == (TRACE_ID, "00")


def test_without_a_tracer_the_clients_trace_context_passes_untouched() -> None:
    m = _answer(
        _picker(None), [("traceparent", f"00-{TRACE_ID}-{PARENT}-01"), ("tracestate", STATE)]
    )
    assert set(_set(m)) == {DESTINATION_HEADER}
    assert list(m.remove_headers) == []


@envoy_only
async def test_the_engine_continues_the_pickers_span_through_envoy(rig: RigFactory) -> None:
    exporter = InMemorySpanExporter()
    provider = setup_tracing("meshd-picker", None, exporter=exporter)
    r = await rig(tracer=provider.get_tracer("test"))
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01", "tracestate": STATE}
    status, _, _ = await r.complete("follow the trace", headers=headers)
    assert status == 200
    (seen,) = [b.requests[-1] for b in r.backends if b.requests]
    await r.session.close()
    r.envoy.stop()
    await r.picker.kill()
    provider.force_flush()
    (span,) = exporter.get_finished_spans()
    assert seen.headers["traceparent"] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
    assert seen.headers["tracestate"] == STATE
