# ruff: noqa: F811  (the `rig` fixture, imported from test_extproc, is each test's parameter)
"""The picker's span per decision (meshd picker --otlp-endpoint): made only with a tracer,
named and attributed by the GenAI conventions, continuing the client's trace, through a real
Envoy."""

from __future__ import annotations

import argparse

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_extproc import (
    RigFactory,
    envoy_only,
    rig,  # noqa: F401  (the fixture; tests take it as a parameter)
)

from meshd.extproc import register
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
