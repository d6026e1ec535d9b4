"""Prometheus metrics of the data plane, in a registry per sidecar (so several
sidecars in one test process keep apart). Served by the admin listener."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# TTFT of LLM streams spans milliseconds (cache hit, short prompt) to minutes
# (100k-token prefill behind a queue).
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class DataPlaneMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "meshd_requests",
            "Client requests finished, by route kind, pool and outcome",
            ["kind", "pool", "outcome"],
            registry=r,
        )
        self.upstream_attempts = Counter(
            "meshd_upstream_attempts",
            "Upstream attempts by endpoint and result",
            ["pool", "endpoint", "result"],
            registry=r,
        )
        self.retries = Counter(
            "meshd_retries",
            "Upstream attempts after the first, by the failure that caused them",
            ["pool", "reason"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "meshd_retry_budget_exhausted",
            "Retries not made because the pool's retry budget was spent",
            ["pool"],
            registry=r,
        )
        self.request_duration = Histogram(
            "meshd_request_duration_seconds",
            "Time from request accepted to the last byte sent to the client",
            ["kind", "pool"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "meshd_time_to_first_token_seconds",
            "Time from request accepted to the first token event relayed",
            ["pool", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stream_tokens = Counter(
            "meshd_stream_tokens",
            "Token-bearing SSE events relayed to clients",
            ["pool"],
            registry=r,
        )
        self.active_streams = Gauge(
            "meshd_active_requests", "Requests being served now", registry=r
        )
        self.rejected = Counter(
            "meshd_rejected_requests",
            "Requests meshd answered itself with an error, by reason",
            ["reason"],
            registry=r,
        )
        self.stripped_headers = Counter(
            "meshd_stripped_routing_headers",
            "x-meshd-* headers removed because the client is outside the trust boundary",
            registry=r,
        )
        self.client_disconnects = Counter(
            "meshd_client_disconnects",
            "Requests whose client went away before the response finished",
            ["pool"],
            registry=r,
        )
