"""The typed settings tree that meshd's config loader (meshd/config.py) validates: one
pydantic model per section, frozen, unknown keys refused, every limit a named field with a
default and its bounds. Cross-field rules live on the model that holds both fields.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from filters.disagg import FASTER_WHOLE_MARGIN_S, FASTER_WHOLE_STALL_WEIGHT


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listener(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class TransparentListener(Listener):
    enabled: bool = False
    host: str = "0.0.0.0"
    port: int = Field(default=15006, ge=0, le=65535)


class ProbeListener(Listener):
    """Health probes only (`/healthz`, `/readyz`; `/metrics` when `metrics`), for a kubelet
    that probes the pod IP while the admin listener stays on loopback."""

    enabled: StrictBool = False
    host: str = "0.0.0.0"
    port: int = Field(default=15021, ge=0, le=65535)
    metrics: StrictBool = False  # also /metrics here (a Prometheus that scrapes pod IPs)


class Listeners(_Strict):
    """Where meshd listens. Admin (health, metrics, config) stays on loopback
    unless configured otherwise: it exposes the effective configuration."""

    outbound: Listener = Listener(host="127.0.0.1", port=15001)
    transparent: TransparentListener = TransparentListener()
    admin: Listener = Listener(host="127.0.0.1", port=15000)
    probes: ProbeListener = ProbeListener()
    # Once per streamed response, right after its first bytes go to the client, give the
    # CPU up (sched_yield): a client that shares meshd's CPU (an app in the same pod) then
    # reads its first token before meshd relays the rest of what the engine sent. Costs a
    # syscall where nothing else is waiting.
    yield_after_first_byte: bool = True


class KVEvents(_Strict):
    """Where to follow one engine's KV events (vLLM's ZMQ publisher). vLLM's rule: with
    `*` or ipc:// in its endpoint the engine binds and meshd connects; with a concrete
    tcp://host:port the engine connects, so meshd must bind (`bind: true`)."""

    endpoint: str = Field(pattern=r"^(tcp|ipc|inproc)://.+")
    replay: str | None = Field(default=None, pattern=r"^(tcp|ipc|inproc)://.+")
    topic: str = ""
    bind: bool = False


class Endpoint(_Strict):
    url: str
    gpu: str | None = None
    weight: float = Field(default=1.0, gt=0)
    kv_capacity_tokens: int | None = Field(default=None, ge=1)
    # The engine's resource name on the control plane (its agent's --name; the pod's name
    # where meshd's webhook injected the agent). When every endpoint names its engine the
    # sidecar subscribes to those engines alone instead of the whole fleet (a report still
    # counts for the endpoint whose host:port is the engine's published address).
    engine: str | None = Field(default=None, min_length=1, pattern=r"^[^*]+$")
    # The engine's KV events (vLLM --kv-events-config): its ZMQ PUB endpoint, and the
    # replay ROUTER for gaps. Read only when routing.tokenizers has the pool's model.
    kv_events: KVEvents | None = None
    # Prefill/decode disaggregation, SGLang's protocol (meshd/disagg.py): a prefill
    # engine's --disaggregation-bootstrap-port, which the decode engine joins to fetch the
    # KV. Unset: the port the engine's /server_info says (asked before its first pair, kept),
    # else the decode pool's disaggregation.bootstrap_port. Only on the endpoints of an
    # sglang prefill pool.
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"expected an http:// or https:// URL, got {v!r}")
        if not parts.hostname or parts.port is None:
            raise ValueError(f"expected scheme://host:port, got {v!r}")
        if parts.path not in ("", "/"):
            raise ValueError(f"endpoint URL must not carry a path, got {v!r}")
        return v.rstrip("/")


class Fallback(_Strict):
    """The next pool in a pool's fallback chain (a string is the pool's name alone): where a
    request goes when its pool cannot serve it in time, with the model rewritten to `model`
    (unset: the request's model is kept, e.g. the same model in another region)."""

    pool: str = Field(min_length=1)
    model: str | None = Field(default=None, min_length=1)


class PoolAutoscaling(_Strict):
    """What the pool's desired-replicas figure aims for (docs/autoscaling.md)."""

    # TTFT the pool should keep at p90; unset: the figure follows demand and queue alone.
    slo_ttft_s: float | None = Field(default=None, gt=0)
    # Busy share of a replica's capacity the figure aims at (headroom for bursts).
    target_utilization: float = Field(default=0.7, gt=0, le=1)
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=100, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> PoolAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas is over max_replicas")
        return self


class Disaggregation(_Strict):
    """A decode pool's prefill side (meshd/disagg.py): where a request's prefill step runs,
    how the two legs speak (`protocol`), and when a request is worth splitting at all."""

    prefill_pool: str = Field(min_length=1)  # a pool of role prefill (or both)
    # vllm-nixl: the prefill step, then the decode step with the prefill's
    # kv_transfer_params (vLLM's NIXL connector). sglang: SGLang's bootstrap protocol, the
    # request with bootstrap_host/port/room sent to a prefill and a decode engine at once;
    # SGLang's decode engines serve nothing whole, so every request is split (and
    # min_prefill_tokens does not apply).
    protocol: Literal["vllm-nixl", "sglang"] = "vllm-nixl"
    # sglang: the bootstrap port of a prefill endpoint that neither sets its own
    # (endpoints[].bootstrap_port) nor says it (/server_info's disaggregation_bootstrap_port).
    # Unset: 8998, SGLang's --disaggregation-bootstrap-port default.
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    # Uncached prompt tokens (the prefill pool's predicted prefix hit taken off) under which
    # a request is served whole on the decode pool: a short prefill is not worth a transfer.
    min_prefill_tokens: int = Field(default=256, ge=0)
    # A request the decider would split is served whole on this pool instead when the
    # decode engine it would take is predicted to give its first token sooner than the
    # split (the prefill pool's queue and prefill, the transfer and the decode leg's wait)
    # by more than margin_s + stall_weight x the streams decoding there x its predicted
    # TTFT there (the stall its prefill puts into each); filters/disagg.py rule 4. A null
    # margin: never for that reason.
    faster_whole_margin_s: float | None = Field(default=FASTER_WHOLE_MARGIN_S, ge=0)
    faster_whole_stall_weight: float = Field(default=FASTER_WHOLE_STALL_WEIGHT, ge=0)
    # The KV link between this pool's engines and its prefill pool's (the pair of pools), in
    # gigaBYTES per second (one 400 Gb/s RDMA NIC per GPU, as on a DGX H100, moves 50 GB/s):
    # a transfer takes prompt tokens x kv_bytes_per_token / this, counted in the decider
    # and in a split request's predicted TTFT.
    kv_link_gb_per_s: float = Field(default=50.0, gt=0)
    # KV bytes one token of the served model occupies. Unset: the prefill engine's GPU
    # profile's (filters/gpu.py), its reference model's: Llama-3-8B in bf16, 32 layers x 8
    # KV heads x 128 x 2 (K and V) x 2 bytes = 131,072.
    kv_bytes_per_token: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _protocol(self) -> Disaggregation:
        fields = type(self).model_fields
        for name in ("min_prefill_tokens", "faster_whole_margin_s", "faster_whole_stall_weight"):
            if self.protocol == "sglang" and getattr(self, name) != fields[name].default:
                raise ValueError(
                    f"{name}: not with protocol sglang (SGLang's decode engines refuse a "
                    "request without a bootstrap room, so every request is split)"
                )
        if self.protocol != "sglang" and self.bootstrap_port is not None:
            raise ValueError("bootstrap_port: only with protocol sglang")
        return self


class Pool(_Strict):
    """A set of interchangeable engines serving the same models."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    models: tuple[str, ...] = ("*",)
    endpoints: tuple[Endpoint, ...] = Field(min_length=1)
    # response_cache (when enabled): which of this pool's answers may be replayed:
    # deterministic ones (temperature 0 or a seed, n 1) and opted-in ones, opted-in only, or none.
    response_cache: Literal["deterministic", "opt-in", "off"] = "deterministic"
    fallbacks: tuple[Fallback, ...] = ()
    # Dollars a request may be predicted to cost here before it goes to the first fallback
    # (a request's x-meshd-max-cost-usd, from a trusted peer, wins); unset: no cap.
    max_cost_usd: float | None = Field(default=None, gt=0)
    autoscaling: PoolAutoscaling = PoolAutoscaling()
    # Prefill/decode disaggregation: `both` serves whole requests (the default); a
    # `prefill` pool only runs decode pools' prefill steps (no model is routed to it); a
    # `decode` pool names its prefill pool in `disaggregation`.
    role: Literal["both", "prefill", "decode"] = "both"
    disaggregation: Disaggregation | None = None

    @model_validator(mode="after")
    def _role(self) -> Pool:
        if self.role == "decode" and self.disaggregation is None:
            raise ValueError("role decode: set disaggregation.prefill_pool")
        if self.role != "decode" and self.disaggregation is not None:
            raise ValueError("disaggregation is for a pool of role decode")
        return self

    @field_validator("fallbacks", mode="before")
    @classmethod
    def _fallbacks_from_strings(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            return [{"pool": f} if isinstance(f, str) else f for f in v]
        return v

    @field_validator("endpoints", mode="before")
    @classmethod
    def _endpoints_from_strings(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            return [{"url": e} if isinstance(e, str) else e for e in v]
        return v

    def serves(self, model: str) -> bool:
        from fnmatch import fnmatchcase

        return any(fnmatchcase(model, pattern) for pattern in self.models)


class Upstream(_Strict):
    """The client side: one aiohttp pool shared by every endpoint."""

    connect_timeout_s: float = Field(default=5.0, gt=0)
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    idle_timeout_s: float = Field(default=60.0, gt=0)
    request_timeout_s: float = Field(default=900.0, gt=0)
    max_connections_per_endpoint: int = Field(default=512, ge=1)
    keepalive_timeout_s: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(default=3, ge=1, le=10)


class Limits(_Strict):
    """Hard bounds on what a client may send; each has an error status and a test."""

    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_header_count: int = Field(default=100, ge=8, le=1000)
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1024 * 1024)
    max_concurrent_streams: int = Field(default=1024, ge=1)
    client_header_timeout_s: float = Field(default=30.0, gt=0)
    client_body_timeout_s: float = Field(default=30.0, gt=0)
    keepalive_timeout_s: float = Field(default=75.0, gt=0)


class Trust(_Strict):
    """The trust boundary: x-meshd-* routing headers are honoured only from these
    source networks and stripped from everyone else."""

    routing_header_sources: tuple[str, ...] = ("127.0.0.0/8", "::1/128")

    @field_validator("routing_header_sources")
    @classmethod
    def _check_networks(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as exc:
                raise ValueError(f"{net!r} is not an IP network ({exc})") from None
        return v

    def networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return tuple(ipaddress.ip_network(n, strict=False) for n in self.routing_header_sources)


class PickerSettings(_Strict):
    """meshd's picker (routing.policy: meshd); the model is in filters/picker.py."""

    lambda_usd_per_s: float = Field(default=1e-2, ge=0)
    # A first token within this many seconds anyway values a second of TTFT in proportion
    # (lambda x best-case TTFT / knee, rounded up to a power of two); null: lambda always.
    lambda_knee_s: float | None = Field(default=0.05, gt=0)
    epsilon: float = Field(default=0.25, ge=0)
    # Bounded load's extra headroom for an endpoint holding C of a prompt's P tokens:
    # its cap x (1 + cached_headroom x C / P).
    cached_headroom: float = Field(default=1.0, ge=0)
    load_metric: Literal["requests", "tokens"] = "requests"
    # reference: every endpoint's decode priced at a batch of 64 (a fixed fleet: latency
    # first, cost between equals); batch: the request's share of the batch it joins (packs
    # running batches, so an elastic pool can hand GPUs back).
    decode_pricing: Literal["batch", "reference"] = "reference"
    # A second of decode (the request's own output at the step of the batch it joins, and
    # the delay it adds to the streams there) valued as this many seconds of TTFT.
    decode_weight: float = Field(default=0.05, ge=0)
    # The delay a request's prefill adds to the streams decoding where it goes, valued as
    # this many seconds of TTFT (0: off; filters/picker.py has what it cost and bought).
    prefill_delay_weight: float = Field(default=0.0, ge=0)
    # GPU-seconds saved are money (an autoscaler hands idle GPUs back): cost weighs in full.
    # false, a fixed fleet: latency and success first, cost between near-equals.
    elastic: bool = False
    # Age limit of what the prefix index learnt from this sidecar's own routing (None: none;
    # entries leave by the engine's KV capacity, LRU, and when an engine answers with fewer
    # cached tokens than predicted). A hedge for engines shared by many sidecars without KV
    # events, whose indexes each see part of the traffic that evicts the engine's cache.
    prefix_ttl_s: float | None = Field(default=None, gt=0)
    # Affinity (filters/picker.py): a prompt at least this share cached at one endpoint (a
    # follow-up step) stays there, unless its load is over affinity_imbalance x its fair
    # share, it would miss the deadline, or another endpoint is predicted faster by more
    # than max(affinity_margin_s, the seconds it would spend recomputing the prefix x
    # (affinity_redo_weight + requests waiting there)).
    affinity_min_fraction: float = Field(default=0.3, gt=0, le=1)
    affinity_imbalance: float = Field(default=3.0, ge=1)
    affinity_margin_s: float = Field(default=0.05, ge=0)
    affinity_redo_weight: float = Field(default=8.0, ge=0)
    # A cold prompt (a new session's first step) counts against the endpoint it was sent
    # to, home_weight per prompt decaying over home_window_s, when the next cold prompt
    # picks among comparable endpoints: the follow-ups it will bring.
    home_weight: float = Field(default=1.0, ge=0)
    home_window_s: float = Field(default=30.0, gt=0)


class Tokenizer(_Strict):
    """The precise prefix path for one model: its tokenizer.json (and chat template) so a
    request's tokens, and so the engine's own KV block hashes, are known before routing.
    Must match the engines: --prefix-caching-hash-algo, --block-size, PYTHONHASHSEED."""

    path: str = Field(min_length=1)  # a directory holding tokenizer.json, or the file
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    hash_seed: str | None = None  # the engines' PYTHONHASHSEED, when set
    block_size: int = Field(default=16, ge=1, le=4096)
    content_format: Literal["auto", "string", "openai"] = "auto"
    max_blocks: int | None = Field(default=None, ge=1)  # hash at most this many blocks


class EngineMetricsProbe(_Strict):
    """The sidecar reads each endpoint's own /metrics (vLLM's or SGLang's) for its KV
    capacity, KV in use and restarts, when no control plane reports the engines
    (filters/engine_probe.py). An endpoint without the page is asked again after a
    backoff; requests never wait on it."""

    enabled: StrictBool = True
    path: str = "/metrics"
    interval_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    max_backoff_s: float = Field(default=60.0, gt=0)

    @model_validator(mode="after")
    def _backoff(self) -> EngineMetricsProbe:
        if self.max_backoff_s < self.interval_s:
            raise ValueError("max_backoff_s must be >= interval_s")
        return self


class Routing(_Strict):
    block_size_bytes: int = Field(default=64, ge=8, le=65536)
    cache_salt: str = ""
    policy: Literal["meshd", "least-request", "round-robin", "cache-aware"] = "meshd"
    picker: PickerSettings = PickerSettings()
    unhealthy_after_failures: int = Field(default=3, ge=1)
    unhealthy_cooldown_s: float = Field(default=10.0, gt=0)
    # Learn each model's characters per prompt token from responses' usage.prompt_tokens
    # (filters/chars_per_token.py) for the picker's prompt and block token estimates.
    learn_chars_per_token: StrictBool = False
    # model -> tokenizer: turns on precise prefix routing for that model (policy meshd),
    # fed by the KV events of the endpoints that set `kv_events`.
    tokenizers: dict[str, Tokenizer] = Field(default_factory=dict)
    engine_metrics: EngineMetricsProbe = EngineMetricsProbe()


class Service(_Strict):
    """An inference service address that transparent mode intercepts."""

    address: str
    pool: str

    @field_validator("address")
    @classmethod
    def _check_address(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected IP:PORT, got {v!r}")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError(f"expected an IP address before the port, got {host!r}") from None
        return v

    def key(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return (str(ipaddress.ip_address(host.strip("[]"))), int(port))


class Transparent(_Strict):
    services: tuple[Service, ...] = ()
    passthrough_connect_timeout_s: float = Field(default=5.0, gt=0)


class RetrySettings(_Strict):
    """The retry budget (filters/retry_budget.py): retries allowed while they stay under
    `ratio` of the requests of the last `window_s`, plus `min_retries_per_s`."""

    ratio: float = Field(default=0.2, ge=0, le=1000)
    min_retries_per_s: float = Field(default=10.0, ge=0)
    window_s: float = Field(default=10.0, gt=0)
    backoff_base_s: float = Field(default=0.025, ge=0)
    backoff_max_s: float = Field(default=1.0, ge=0)

    @model_validator(mode="after")
    def _backoff_order(self) -> RetrySettings:
        if self.backoff_base_s > self.backoff_max_s:
            raise ValueError("backoff_base_s must not exceed backoff_max_s")
        return self


class BreakerSettings(_Strict):
    """The token-aware circuit breaker (filters/token_breaker.py): in-flight limits per
    endpoint counted in tokens (prompt + expected output) and requests, and a failure
    breaker per endpoint (closed / open / half-open)."""

    enabled: bool = True
    max_tokens_per_endpoint: int = Field(default=262_144, ge=1)
    # Where an engine's KV capacity is known (its report or /metrics, or the endpoint's
    # kv_capacity_tokens), its token limit is this many times that capacity instead of
    # max_tokens_per_endpoint (null: max_tokens_per_endpoint everywhere).
    max_tokens_kv_factor: float | None = Field(default=2.0, gt=0)
    max_requests_per_endpoint: int = Field(default=256, ge=1)
    max_pending_per_endpoint: int = Field(default=128, ge=1)
    consecutive_failures: int = Field(default=5, ge=1)
    error_rate: float = Field(default=0.5, gt=0, le=1)
    error_window_s: float = Field(default=10.0, gt=0)
    error_min_requests: int = Field(default=20, ge=1)
    open_base_s: float = Field(default=5.0, gt=0)
    open_max_s: float = Field(default=120.0, gt=0)
    half_open_successes: int = Field(default=2, ge=1)
    ttft_outlier_factor: float = Field(default=5.0, gt=1)
    ttft_outlier_min_s: float = Field(default=1.0, ge=0)

    @model_validator(mode="after")
    def _open_order(self) -> BreakerSettings:
        if self.open_base_s > self.open_max_s:
            raise ValueError("open_base_s must not exceed open_max_s")
        return self


class OutlierSettings(_Strict):
    """Outlier ejection (filters/outlier.py), Envoy's semantics: consecutive 5xx or a
    success rate far below the pool's takes an endpoint out for a growing while."""

    enabled: bool = True
    consecutive_5xx: int = Field(default=5, ge=1)
    interval_s: float = Field(default=10.0, gt=0)
    base_ejection_time_s: float = Field(default=30.0, gt=0)
    max_ejection_time_s: float = Field(default=300.0, gt=0)
    max_ejection_percent: float = Field(default=10.0, ge=0, le=100)
    always_eject_one_host: bool = True

    @model_validator(mode="after")
    def _ejection_order(self) -> OutlierSettings:
        if self.base_ejection_time_s > self.max_ejection_time_s:
            raise ValueError("base_ejection_time_s must not exceed max_ejection_time_s")
        return self


class TenantSettings(_Strict):
    weight: float = Field(default=1.0, gt=0)
    max_priority: int = Field(default=9, ge=0, le=9)
    max_queued: int | None = Field(default=None, ge=0)
    max_in_flight: int | None = Field(default=None, ge=1)
    # Predicted dollars a request of this tenant may cost on its pool before it goes to the
    # pool's first fallback (over pools[].max_cost_usd; x-meshd-max-cost-usd wins).
    max_cost_usd: float | None = Field(default=None, gt=0)


# Admission slots per endpoint when reliability.admission.max_in_flight is null: vLLM's
# default max_num_seqs, past which an engine only queues.
ADMISSION_SLOTS_PER_ENDPOINT = 256


class AdmissionSettings(_Strict):
    """Admission control with deadline-aware queueing (filters/admission.py), per pool:
    up to `max_in_flight` requests go upstream at once, the rest wait in priority /
    fair-share / deadline order, or get 429 with Retry-After."""

    enabled: bool = True
    # Per pool; null: ADMISSION_SLOTS_PER_ENDPOINT per endpoint of the pool (a fixed 512
    # held a 64-engine pool to 8 requests per engine: TTFT p90 16-19x the peers' on the
    # robustness matrix's 64-engine cells).
    max_in_flight: int | None = Field(default=None, ge=1)
    max_queued: int = Field(default=1024, ge=0)
    max_queued_per_tenant: int = Field(default=256, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    # The pool's knee (filters/admission.py): once every engine has more than this many
    # seconds of work queued (the router's prediction), a new task's request waits here
    # while a started task's goes on; null: off (so with routing policies that predict
    # nothing: round-robin, least-request, cache-aware).
    knee_wait_s: float | None = Field(default=2.0, ge=0)
    knee_max_wait_s: float = Field(default=10.0, gt=0)
    # A request with a deadline (x-meshd-deadline-ms) that the pool's best endpoint is
    # predicted to finish after is refused before its first attempt (429
    # deadline_unmeetable; filters/deadline.py); the meshd routing policy only.
    refuse_predicted_late: bool = True
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)


class FailoverSettings(_Strict):
    """Mid-stream failover (filters/failover.py): when an engine dies after tokens have
    streamed, resume on another endpoint with the text already sent as the continuation."""

    enabled: bool = True
    max_resumes: int = Field(default=2, ge=0, le=10)


class ThrottleSettings(_Strict):
    """Client-side adaptive throttling (the SRE book's): refuse locally a share of requests
    while the pool keeps refusing with 429/503."""

    enabled: bool = True
    k: float = Field(default=2.0, ge=1)
    window_s: float = Field(default=120.0, gt=0)


class SlowStartSettings(_Strict):
    """A recovered or newly added endpoint's weight ramps from min_weight_percent to full
    over window_s (Envoy's slow start: (elapsed / window) ** (1 / aggression)), so traffic
    shed onto it does not flatten a cache that must rewarm. The ramp gives way while the
    pool queues: once no endpoint at full weight could start a new prefill within
    yield_queue_s, a ramping one takes up to its full share where the picker predicts it
    faster (null: the ramp always binds, as in Envoy)."""

    enabled: bool = True
    window_s: float = Field(default=60.0, gt=0)
    aggression: float = Field(default=1.0, gt=0)
    min_weight_percent: float = Field(default=10.0, ge=0, le=100)
    yield_queue_s: float | None = Field(default=0.1, gt=0)


class Reliability(_Strict):
    retry: RetrySettings = RetrySettings()
    breaker: BreakerSettings = BreakerSettings()
    outlier: OutlierSettings = OutlierSettings()
    admission: AdmissionSettings = AdmissionSettings()
    failover: FailoverSettings = FailoverSettings()
    throttle: ThrottleSettings = ThrottleSettings()
    slow_start: SlowStartSettings = SlowStartSettings()
    # An attempt the client abandons while it runs this many times slower than the pool's
    # typical seconds per expected token counts against the endpoint (outlier ejection);
    # null: abandonment is never held against an endpoint.
    slow_abandon_factor: float | None = Field(default=3.0, gt=1)


class TracingSettings(_Strict):
    """OpenTelemetry traces over OTLP/gRPC; no endpoint: trace ids still propagate."""

    otlp_endpoint: str | None = None  # host:port or http(s)://host:port
    insecure: bool = True
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    service_name: str = Field(default="meshd-sidecar", min_length=1)
    headers: dict[str, str] = Field(default_factory=dict)


class AccessLogSettings(_Strict):
    """The JSON-lines access log that `meshd cost` reads (docs/access-log.md)."""

    path: str | None = None
    max_bytes: int | None = Field(default=100 * 1024 * 1024, ge=1)
    backups: int = Field(default=5, ge=0)


class MetricsSettings(_Strict):
    """Caps on client-given label values (meshd/observe.py BoundedLabels): the first N
    distinct tenants/models keep their name, later ones read "other". Tenants named in
    reliability.admission.tenants and the pools' models always keep theirs, over the cap."""

    # Same defaults as meshd/observe.py DEFAULT_MAX_TENANT_LABELS / DEFAULT_MAX_MODEL_LABELS.
    max_tenant_labels: int = Field(default=16, ge=0, le=10_000)
    max_model_labels: int = Field(default=32, ge=0, le=10_000)


class Telemetry(_Strict):
    tracing: TracingSettings = TracingSettings()
    access_log: AccessLogSettings = AccessLogSettings()
    metrics: MetricsSettings = MetricsSettings()
    # Dollars per GPU-hour by GPU name, over the built-in table (filters/cost_ledger.py).
    prices_usd_per_gpu_hour: dict[str, float] = Field(default_factory=dict)


class ControlPlaneTLS(_Strict):
    ca_file: str | None = None  # verify the control plane against this CA
    cert_file: str | None = None  # client certificate for mTLS
    key_file: str | None = None

    @model_validator(mode="after")
    def _pair(self) -> ControlPlaneTLS:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (mTLS needs both)")
        return self


class ControlPlane(_Strict):
    """The xDS control channel (`meshd control-plane`): engine state and prefix digests
    for this sidecar's pools. Unset: routing uses only what this sidecar observes."""

    # host:port of each control-plane replica; the sidecar uses one, fails over to the next.
    addresses: tuple[str, ...] = ()
    # Or shards (meshd/shards.py: each engine's agent publishes to one, by a hash of its
    # name): each shard its replicas' host:port; the sidecar follows every shard (one of
    # its replicas at a time) and merges what they hold.
    shards: tuple[tuple[str, ...], ...] = ()
    node_id: str = ""  # default: the host name
    tls: ControlPlaneTLS | None = None  # None: plaintext (loopback or a trusted network)
    stale_after_s: float = Field(default=10.0, gt=0)
    # EndpointState responses ACKed at most this often (meshd/control_feed.py): the control
    # plane sends one with every engine changed meanwhile. 0: each ACKed at once.
    ack_pace_s: float = Field(default=0.02, ge=0, le=1.0)
    # Follow over the frames port a control plane advertises (xds/publish_frames.py: the
    # same messages without gRPC, a fraction of the sidecar's CPU a response); back to
    # gRPC where that port fails. False: gRPC only.
    frames: bool = True

    @model_validator(mode="after")
    def _one_way(self) -> ControlPlane:
        if self.addresses and self.shards:
            raise ValueError("addresses and shards: give one (addresses is a single shard)")
        for i, shard in enumerate(self.shards):
            if not shard:
                raise ValueError(f"shards.{i}: a shard needs at least one replica address")
        return self

    def shard_list(self) -> list[tuple[str, ...]]:
        """Every shard's replicas (`addresses` is one shard); empty: no control plane."""
        return list(self.shards) if self.shards else [self.addresses] if self.addresses else []


class Drain(_Strict):
    grace_period_s: float = Field(default=30.0, ge=0)


class ResponseCacheRedis(_Strict):
    """A Redis every sidecar shares. Unreachable or slow: the cache is bypassed (the request
    goes to the engine), never a failed request."""

    url: str = Field(pattern=r"^(redis|rediss|unix)://.+")
    key_prefix: str = "meshd:rc:"
    timeout_s: float = Field(default=0.05, gt=0)  # per command
    retry_after_s: float = Field(default=5.0, gt=0)  # after an error, bypass Redis this long


class ResponseCache(_Strict):
    """Exact-match cache of whole answers (filters/response_cache.py): which requests may be
    replayed is each pool's `response_cache`; Cache-Control request directives are honoured."""

    enabled: StrictBool = False
    store: Literal["memory", "redis"] = "memory"
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)  # memory store, all entries
    max_entry_bytes: int = Field(default=1024 * 1024, ge=256)  # larger answers: not stored
    ttl_s: float = Field(default=600.0, gt=0)
    # Concurrent identical requests: one goes to the engine, up to max_waiters wait for it.
    coalesce: StrictBool = True
    max_waiters: int = Field(default=64, ge=0)
    # Request headers whose values are part of the key besides the tenant (an API key: one
    # caller never gets another's answer even without x-meshd-tenant).
    partition_headers: tuple[str, ...] = ("authorization",)
    redis: ResponseCacheRedis | None = None

    @model_validator(mode="after")
    def _store(self) -> ResponseCache:
        if self.store == "redis" and self.redis is None:
            raise ValueError("store is redis: set redis.url")
        return self


class Config(_Strict):
    listeners: Listeners = Listeners()
    pools: tuple[Pool, ...] = Field(min_length=1)
    upstream: Upstream = Upstream()
    limits: Limits = Limits()
    trust: Trust = Trust()
    routing: Routing = Routing()
    transparent: Transparent = Transparent()
    reliability: Reliability = Reliability()
    telemetry: Telemetry = Telemetry()
    control_plane: ControlPlane = ControlPlane()
    drain: Drain = Drain()
    response_cache: ResponseCache = ResponseCache()
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        names = [p.name for p in self.pools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pools: duplicate pool name(s) {', '.join(dupes)}")
        for i, pool in enumerate(self.pools):
            for j, fb in enumerate(pool.fallbacks):
                where = f"pools[{i}].fallbacks[{j}].pool"
                if fb.pool == pool.name:
                    raise ValueError(f"{where}: a pool cannot fall back to itself")
                if fb.pool not in names:
                    raise ValueError(
                        f"{where}: unknown pool {fb.pool!r} (pools are: {', '.join(names)})"
                    )
        for i, pool in enumerate(self.pools):
            pd = pool.disaggregation
            if pd is None:
                continue
            where = f"pools[{i}].disaggregation.prefill_pool"
            other = next((p for p in self.pools if p.name == pd.prefill_pool), None)
            if other is None or other is pool:
                raise ValueError(
                    f"{where}: {pd.prefill_pool!r} is not another pool (pools are: "
                    f"{', '.join(names)})"
                )
            if other.role == "decode":
                raise ValueError(f"{where}: {pd.prefill_pool!r} is a decode pool")
        sglang_prefill = {
            p.disaggregation.prefill_pool
            for p in self.pools
            if p.disaggregation is not None and p.disaggregation.protocol == "sglang"
        }
        for i, pool in enumerate(self.pools):
            for j, ep in enumerate(pool.endpoints):
                if ep.bootstrap_port is not None and pool.name not in sglang_prefill:
                    raise ValueError(
                        f"pools[{i}].endpoints[{j}].bootstrap_port: pool {pool.name!r} is "
                        "not the prefill_pool of a decode pool with protocol sglang"
                    )
        for i, svc in enumerate(self.transparent.services):
            if svc.pool not in names:
                raise ValueError(
                    f"transparent.services[{i}].pool: unknown pool {svc.pool!r} "
                    f"(pools are: {', '.join(names)})"
                )
        return self

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)
