"""OpenTelemetry tracing for meshd processes: an OTLP/gRPC tracer provider with parent-based
ratio sampling, the GenAI semantic-convention attribute names, and W3C trace context carried
from a client's `traceparent` (parsed by filters/routing_headers.py) to the engine.

Attribute names follow the OpenTelemetry GenAI semantic conventions as of their move to
open-telemetry/semantic-conventions-genai (model/gen-ai/registry.yaml, main, 2026; earlier
in open-telemetry/semantic-conventions v1.37-v1.40, schema 1.44.0 of opentelemetry-semantic-
conventions 0.66b2 marks them "moved"): `gen_ai.provider.name` replaced `gen_ai.system`
(v1.37.0), `gen_ai.usage.input_tokens`/`output_tokens` replaced `prompt_tokens`/
`completion_tokens`. Span names are "{gen_ai.operation.name} {gen_ai.request.model}".
Wire format of traceparent: w3c/trace-context spec/20-http_request_header_format.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from filters.routing_headers import TraceContext
from xds.spans import (
    ATTR_XDS_CHANGED,
    ATTR_XDS_DELTA,
    ATTR_XDS_NACK,
    ATTR_XDS_NODE,
    ATTR_XDS_NONCE,
    ATTR_XDS_PEER,
    ATTR_XDS_REMOVED,
    ATTR_XDS_RESOURCES,
    ATTR_XDS_TYPE_URL,
    ATTR_XDS_UNANSWERED,
    ATTR_XDS_VERSION,
    EVENT_XDS_NACK,
    SPAN_XDS_PUBLISH,
    SPAN_XDS_PUSH,
)

if TYPE_CHECKING:  # the SDK loads only when a tracer is built (~3 MB of a sidecar's RSS)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = [
    "ATTR_XDS_CHANGED",
    "ATTR_XDS_DELTA",
    "ATTR_XDS_NACK",
    "ATTR_XDS_NODE",
    "ATTR_XDS_NONCE",
    "ATTR_XDS_PEER",
    "ATTR_XDS_REMOVED",
    "ATTR_XDS_RESOURCES",
    "ATTR_XDS_TYPE_URL",
    "ATTR_XDS_UNANSWERED",
    "ATTR_XDS_VERSION",
    "EVENT_XDS_NACK",
    "GEN_AI_CONVERSATION_ID",
    "GEN_AI_OPERATION_NAME",
    "GEN_AI_PROVIDER_NAME",
    "GEN_AI_REQUEST_MAX_TOKENS",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_REQUEST_STREAM",
    "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_RESPONSE_MODEL",
    "GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK",
    "GEN_AI_SYSTEM",
    "GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS",
    "GEN_AI_USAGE_INPUT_TOKENS",
    "GEN_AI_USAGE_OUTPUT_TOKENS",
    "OPERATION_BY_KIND",
    "SPAN_ADMISSION",
    "SPAN_ATTEMPT",
    "SPAN_PICK",
    "SPAN_QUEUE",
    "SPAN_STREAM",
    "SPAN_XDS_PUBLISH",
    "SPAN_XDS_PUSH",
    "Status",
    "StatusCode",
    "context_from_trace",
    "genai_request_attributes",
    "genai_response_attributes",
    "inject_trace_headers",
    "setup_tracing",
    "span_name",
    "traceparent_of",
]

# GenAI semantic conventions (semantic-conventions-genai model/gen-ai/registry.yaml).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_SYSTEM = "gen_ai.system"  # deprecated name of provider.name; emitted only on request
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
# General semconv (stable): the failure class of an operation, and the peer.
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"

# meshd's route kinds (filters/request.py PATH_KINDS) as GenAI operation names.
OPERATION_BY_KIND: dict[str, str] = {
    "chat": "chat",
    "completion": "text_completion",
    "embedding": "embeddings",
}
# Engines are vLLM/SGLang behind an OpenAI-compatible API; the registry has no value for a
# self-hosted engine, and "openai" names the API flavour, which is what the value is for.
DEFAULT_PROVIDER = "openai"

# meshd's own child spans and attributes (meshd.* namespace, as semconv asks for custom keys).
SPAN_ADMISSION = "meshd.admission"
SPAN_QUEUE = "meshd.queue"
SPAN_PICK = "meshd.pick"
SPAN_ATTEMPT = "meshd.upstream"
SPAN_STREAM = "meshd.stream"
EVENT_FIRST_TOKEN = "meshd.first_token"
EVENT_RESUME = "meshd.resume"  # a mid-stream failover (outcome: resumed, refused, failed)
ATTR_TENANT = "meshd.tenant"
ATTR_TASK_ID = "meshd.task_id"
ATTR_WORKFLOW_ID = "meshd.workflow_id"
ATTR_REQUEST_ID = "meshd.request_id"
ATTR_POOL = "meshd.pool"
ATTR_ENDPOINT = "meshd.endpoint"
ATTR_GPU = "meshd.gpu"
ATTR_PREDICTED_CACHED_TOKENS = "meshd.pick.predicted_cached_tokens"
ATTR_PREDICTED_TTFT_S = "meshd.pick.predicted_ttft_s"
ATTR_RUNNER_UP = "meshd.pick.runner_up"
ATTR_RUNNER_UP_REASON = "meshd.pick.runner_up_reason"
ATTR_PICK_REASON = "meshd.pick.reason"
ATTR_CANDIDATES = "meshd.pick.candidates"
ATTR_ATTEMPT = "meshd.attempt"
ATTR_ATTEMPTS = "meshd.attempts"
ATTR_RETRY_REASON = "meshd.attempt.retry_reason"
ATTR_OUTCOME = "meshd.outcome"
ATTR_COST_USD = "meshd.cost_usd"
ATTR_FALLBACK_FROM = "meshd.fallback.from"
ATTR_FALLBACK_TO = "meshd.fallback.to"
ATTR_FALLBACK_REASON = "meshd.fallback.reason"
EVENT_FALLBACK = "meshd.fallback"
ATTR_RESPONSE_CACHE = "meshd.response_cache"  # hit, coalesced, miss, refresh
ATTR_AVOIDED_GPU_S = "meshd.response_cache.avoided_gpu_seconds"
ATTR_GPU_SECONDS = "meshd.gpu_seconds"
# A split request's decode leg (meshd/disagg.py): the predicted seconds of its KV transfer.
ATTR_KV_TRANSFER_S = "meshd.pd.kv_transfer_s"
ATTR_QUEUE_S = "meshd.queue_s"
ATTR_TTFT_S = "meshd.ttft_s"
ATTR_TOKENS_SENT = "meshd.tokens_sent"
ATTR_REASON = "meshd.reason"

# The engine agent (meshd/agent.py).
SPAN_AGENT_PUBLISH = "meshd.agent.publish"  # a scrape that published state and/or digest
SPAN_AGENT_KV_REPLAY = "meshd.agent.kv_replay"
SPAN_AGENT_EPOCH = "meshd.agent.new_epoch"
ATTR_ENGINE = "meshd.engine"
ATTR_EPOCH = "meshd.epoch"
ATTR_HEALTHY = "meshd.healthy"
ATTR_STATE_PUBLISHED = "meshd.state_published"
ATTR_REQUESTS_RUNNING = "meshd.requests_running"
ATTR_REQUESTS_WAITING = "meshd.requests_waiting"
ATTR_KV_USAGE = "meshd.kv_usage"
ATTR_DIGEST_SEQ = "meshd.digest.seq"
ATTR_DIGEST_FULL = "meshd.digest.full"
ATTR_DIGEST_ADDED = "meshd.digest.added"
ATTR_DIGEST_REMOVED = "meshd.digest.removed"
ATTR_REPLAY_FROM = "meshd.replay.from_seq"
ATTR_REPLAYED = "meshd.replay.batches"
ATTR_REPLAY_LOST = "meshd.replay.lost"

# The control plane's span names: xds/spans.py (imported above, re-exported).

_KNOWN_FLAGS = 0x03


def _check_otlp_protos() -> None:
    """xds-protos bundles old copies of opentelemetry-proto's modules; installed after it,
    they shadow the ones the OTLP exporter needs. Say so instead of an ImportError deep in
    the exporter."""
    from opentelemetry.proto.common.v1 import common_pb2

    if not hasattr(common_pb2, "InstrumentationScope"):
        import importlib.metadata

        version = importlib.metadata.version("opentelemetry-proto")
        raise RuntimeError(
            "opentelemetry-proto's modules are shadowed by older copies (xds-protos ships "
            "some); repair with: pip install --force-reinstall --no-deps "
            f"opentelemetry-proto=={version}"
        )


def setup_tracing(
    service_name: str,
    endpoint: str | None,
    sampler_ratio: float = 1.0,
    *,
    headers: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
    insecure: bool = True,
    exporter: SpanExporter | None = None,
    resource_attributes: Mapping[str, str] | None = None,
    schedule_delay_ms: int = 1000,
    max_queue_size: int = 2048,
    set_global: bool = False,
) -> TracerProvider:
    """A TracerProvider exporting over OTLP/gRPC to `endpoint` ("host:port" or a URL).

    Sampling is ParentBased(TraceIdRatioBased(sampler_ratio)): a client's sampled flag is
    honoured, a new trace is kept with probability `sampler_ratio`. Spans go through a
    BatchSpanProcessor (bounded queue `max_queue_size`; spans beyond it are dropped, never
    blocking a request). `endpoint=None` and no `exporter`: spans are made (so trace ids
    propagate) but exported nowhere. `set_global` also installs it as the process default.
    Raises ValueError for a ratio outside [0, 1].
    """
    if not 0.0 <= sampler_ratio <= 1.0:
        raise ValueError(f"sampler_ratio must be in [0, 1], got {sampler_ratio}")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": service_name, **(resource_attributes or {})})
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(sampler_ratio))
    )
    if exporter is None and endpoint is not None:
        _check_otlp_protos()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers or ())
        exporter = OTLPSpanExporter(
            endpoint=endpoint, insecure=insecure, headers=tuple(pairs) or None
        )
    if exporter is not None:
        provider.add_span_processor(
            BatchSpanProcessor(
                exporter, schedule_delay_millis=schedule_delay_ms, max_queue_size=max_queue_size
            )
        )
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def span_name(kind: str, model: str | None) -> str:
    """ "{gen_ai.operation.name} {gen_ai.request.model}", as the GenAI span conventions name
    an inference span; just the operation when the model is unknown."""
    op = OPERATION_BY_KIND.get(kind, kind)
    return f"{op} {model}" if model else op


def genai_request_attributes(
    kind: str,
    model: str | None,
    *,
    stream: bool | None = None,
    max_tokens: int | None = None,
    provider: str = DEFAULT_PROVIDER,
    conversation_id: str | None = None,
    legacy_system: bool = False,
) -> dict[str, Any]:
    """Request-side GenAI attributes; `legacy_system` adds the deprecated gen_ai.system too
    (for backends that still key on it)."""
    attrs: dict[str, Any] = {
        GEN_AI_OPERATION_NAME: OPERATION_BY_KIND.get(kind, kind),
        GEN_AI_PROVIDER_NAME: provider,
    }
    if legacy_system:
        attrs[GEN_AI_SYSTEM] = provider
    if model:
        attrs[GEN_AI_REQUEST_MODEL] = model
    if stream is not None:
        attrs[GEN_AI_REQUEST_STREAM] = stream
    if max_tokens is not None:
        attrs[GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    if conversation_id:
        attrs[GEN_AI_CONVERSATION_ID] = conversation_id
    return attrs


def genai_response_attributes(
    *,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    cached_tokens: int | None = None,
    finish_reasons: Iterable[str] = (),
    response_model: str | None = None,
    ttft_s: float | None = None,
) -> dict[str, Any]:
    """Response-side GenAI attributes; absent figures are left out, not zeroed."""
    attrs: dict[str, Any] = {}
    if input_tokens is not None:
        attrs[GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
    if output_tokens is not None:
        attrs[GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
    if cached_tokens is not None:
        attrs[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached_tokens
    reasons = [r for r in finish_reasons if r]
    if reasons:
        attrs[GEN_AI_RESPONSE_FINISH_REASONS] = reasons
    if response_model:
        attrs[GEN_AI_RESPONSE_MODEL] = response_model
    if ttft_s is not None:
        attrs[GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = ttft_s
    return attrs


def context_from_trace(parent: TraceContext | None) -> Context | None:
    """The OpenTelemetry context continuing a client's traceparent (None: start a new trace).
    Pass it as `context=` to the server span."""
    if parent is None:
        return None
    state = TraceState.from_header([parent.tracestate]) if parent.tracestate else TraceState()
    span_context = SpanContext(
        trace_id=int(parent.trace_id, 16),
        span_id=int(parent.parent_id, 16),
        is_remote=True,
        # Sampled (0x01) and random (0x02, trace-context level 2) are the defined bits;
        # unknown ones are zeroed, as the spec asks of a forwarder.
        trace_flags=TraceFlags(parent.flags & _KNOWN_FLAGS),
        trace_state=state,
    )
    return trace.set_span_in_context(NonRecordingSpan(span_context))


def traceparent_of(span: Span) -> str | None:
    """`traceparent` naming `span` as the parent (None for an invalid span context)."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return None
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def inject_trace_headers(
    headers: list[tuple[str, str]], span: Span, parent: TraceContext | None = None
) -> list[tuple[str, str]]:
    """`headers` with traceparent/tracestate replaced by ones naming `span` (the upstream
    attempt) as the engine's parent. Without a valid span (tracing off) the client's own
    trace context passes through unchanged, so the engine still joins the client's trace."""
    value = traceparent_of(span)
    if value is None:
        return headers
    out = [(k, v) for k, v in headers if k.lower() not in ("traceparent", "tracestate")]
    out.append(("traceparent", value))
    state = span.get_span_context().trace_state.to_header()
    if not state and parent is not None and parent.tracestate:
        state = parent.tracestate
    if state:
        out.append(("tracestate", state))
    return out
