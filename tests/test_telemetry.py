"""meshd/telemetry.py against a real OTLP/gRPC receiver (tests/otlp_receiver.py): a streamed
request with one retry arrives as server -> pick, upstream x2 -> stream spans with GenAI
attributes; sampling off exports nothing; a client's traceparent is continued."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode
from otlp_receiver import OtlpReceiver

from filters.routing_headers import TraceContext
from meshd import telemetry as t

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def fake_request(provider: TracerProvider, parent: TraceContext | None) -> list[tuple[str, str]]:
    """What the sidecar does for one streamed chat request that is retried once; returns the
    headers the second (successful) attempt sent upstream."""
    tracer = provider.get_tracer("meshd.sidecar")
    sent: list[tuple[str, str]] = []
    server = tracer.start_span(
        t.span_name("chat", "llama-3-8b"),
        context=t.context_from_trace(parent),
        kind=SpanKind.SERVER,
        attributes={
            **t.genai_request_attributes("chat", "llama-3-8b", stream=True, max_tokens=64),
            t.ATTR_TENANT: "acme",
        },
    )
    ctx = trace.set_span_in_context(server)
    with tracer.start_as_current_span(t.SPAN_PICK, context=ctx) as pick:
        pick.set_attributes(
            {
                t.ATTR_ENDPOINT: "http://a:8000",
                t.ATTR_PREDICTED_CACHED_TOKENS: 512,
                t.ATTR_PREDICTED_TTFT_S: 0.05,
                t.ATTR_RUNNER_UP: "http://b:8000",
                t.ATTR_RUNNER_UP_REASON: "fewer cached tokens",
            }
        )
    first = tracer.start_span(t.SPAN_ATTEMPT, context=ctx, kind=SpanKind.CLIENT)
    first.set_attributes({t.ATTR_ATTEMPT: 0, t.ATTR_ENDPOINT: "http://a:8000"})
    first.set_attribute(t.ERROR_TYPE, "connect_error")
    first.set_status(Status(StatusCode.ERROR, "connection refused"))
    first.end()
    second = tracer.start_span(t.SPAN_ATTEMPT, context=ctx, kind=SpanKind.CLIENT)
    second.set_attributes(
        {t.ATTR_ATTEMPT: 1, t.ATTR_ENDPOINT: "http://b:8000", t.ATTR_RETRY_REASON: "connect_error"}
    )
    sent = t.inject_trace_headers(
        [("x-request-id", "r1"), ("traceparent", "stale")], second, parent
    )
    stream = tracer.start_span(t.SPAN_STREAM, context=trace.set_span_in_context(second))
    stream.add_event(t.EVENT_FIRST_TOKEN, {"meshd.ttft_s": 0.07})
    stream.end()
    second.end()
    server.set_attributes(
        t.genai_response_attributes(
            input_tokens=600,
            output_tokens=64,
            cached_tokens=512,
            finish_reasons=["length"],
            ttft_s=0.07,
        )
    )
    server.end()
    return sent


def test_spans_arrive_with_structure_and_genai_attributes(receiver: OtlpReceiver) -> None:
    provider = t.setup_tracing(
        "meshd-sidecar", receiver.endpoint, 1.0, headers={"x-tenant-key": "k1"}
    )
    sent = fake_request(provider, None)
    assert provider.force_flush(10_000)
    spans = receiver.wait_for(5)
    provider.shutdown()
    by = receiver.by_name()
    assert sorted(by) == sorted(["chat llama-3-8b", t.SPAN_PICK, t.SPAN_ATTEMPT, t.SPAN_STREAM])
    (server,) = by["chat llama-3-8b"]
    assert server.parent_span_id == ""
    assert server.kind == 2  # SPAN_KIND_SERVER
    assert server.service_name == "meshd-sidecar"
    assert server.metadata["x-tenant-key"] == "k1"
    assert {s.trace_id for s in spans} == {server.trace_id}
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert server.attributes["gen_ai.provider.name"] == "openai"
    assert server.attributes["gen_ai.request.model"] == "llama-3-8b"
    assert server.attributes["gen_ai.request.stream"] is True
    assert server.attributes["gen_ai.usage.input_tokens"] == 600
    assert server.attributes["gen_ai.usage.output_tokens"] == 64
    assert server.attributes["gen_ai.usage.cache_read.input_tokens"] == 512
    assert server.attributes["gen_ai.response.finish_reasons"] == ["length"]
    (pick,) = by[t.SPAN_PICK]
    assert pick.parent_span_id == server.span_id
    assert pick.attributes[t.ATTR_RUNNER_UP_REASON] == "fewer cached tokens"
    attempts = sorted(by[t.SPAN_ATTEMPT], key=lambda s: s.attributes[t.ATTR_ATTEMPT])
    assert [a.parent_span_id for a in attempts] == [server.span_id] * 2
    assert [a.kind for a in attempts] == [3, 3]  # SPAN_KIND_CLIENT
    assert attempts[0].attributes[t.ERROR_TYPE] == "connect_error"
    assert attempts[1].attributes[t.ATTR_RETRY_REASON] == "connect_error"
    (stream,) = by[t.SPAN_STREAM]
    assert stream.parent_span_id == attempts[1].span_id
    assert [e[0] for e in stream.events] == [t.EVENT_FIRST_TOKEN]
    # The engine is told the successful attempt is its parent; the stale header is gone.
    (value,) = [v for k, v in sent if k == "traceparent"]
    assert value[:52] == f"00-{server.trace_id}-{attempts[1].span_id}"
    assert int(value[-2:], 16) & 1  # sampled (the SDK also sets level 2's random bit)


def test_sampling_off_exports_nothing(receiver: OtlpReceiver) -> None:
    provider = t.setup_tracing("meshd-sidecar", receiver.endpoint, 0.0)
    sent = fake_request(provider, None)
    assert provider.force_flush(10_000)
    provider.shutdown()
    assert receiver.spans() == []
    assert receiver.requests == []
    # The engine is still told the trace, marked not sampled, so it does not sample either.
    (value,) = [v for k, v in sent if k == "traceparent"]
    assert int(value[-2:], 16) & 1 == 0


def test_client_traceparent_is_continued_even_at_ratio_zero(receiver: OtlpReceiver) -> None:
    # Parent-based: the client's sampled flag wins over the local ratio.
    parent = TraceContext(CLIENT_TRACE, CLIENT_PARENT, 1, "rojo=00f067aa0ba902b7")
    provider = t.setup_tracing("meshd-sidecar", receiver.endpoint, 0.0)
    sent = fake_request(provider, parent)
    assert provider.force_flush(10_000)
    spans = receiver.wait_for(5)
    provider.shutdown()
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    (server,) = receiver.by_name()["chat llama-3-8b"]
    assert server.parent_span_id == CLIENT_PARENT
    assert ("tracestate", "rojo=00f067aa0ba902b7") in sent


def test_unsampled_client_parent_is_not_exported_but_propagated(receiver: OtlpReceiver) -> None:
    parent = TraceContext(CLIENT_TRACE, CLIENT_PARENT, 0, None)
    provider = t.setup_tracing("meshd-sidecar", receiver.endpoint, 1.0)
    sent = fake_request(provider, parent)
    assert provider.force_flush(10_000)
    provider.shutdown()
    assert receiver.spans() == []
    (value,) = [v for k, v in sent if k == "traceparent"]
    assert value.startswith(f"00-{CLIENT_TRACE}-") and int(value[-2:], 16) & 1 == 0


def test_setup_rejects_bad_ratio_and_names() -> None:
    with pytest.raises(ValueError):
        t.setup_tracing("x", None, 1.5)
    assert t.span_name("completion", "m") == "text_completion m"
    assert t.span_name("other", None) == "other"
    attrs = t.genai_request_attributes("embedding", None, legacy_system=True)
    assert attrs == {
        "gen_ai.operation.name": "embeddings",
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
    }
    assert t.context_from_trace(None) is None
