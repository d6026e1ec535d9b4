"""The records a request carries through the sidecar's layers (docs/architecture.md), and
the state those layers share. Plain data: the layers own the behaviour."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from filters.disagg import Split
from filters.hotpath import RoutingHeaders
from filters.picker import PickRequest
from filters.pool_router import PoolRouter, Route
from filters.request import InferenceRequest
from filters.retry_budget import RetryBudget
from meshd.config import Config
from meshd.metrics import DataPlaneMetrics
from meshd.observe import AttemptTrace, RequestObserver, RequestTrace
from meshd.upstream import UpstreamResponse

if TYPE_CHECKING:
    from filters.guard import PoolGuard
    from meshd.disagg import PairPlan
    from meshd.response_cache import CachePlan, ResponseCache
    from meshd.upstream import UpstreamPool


@dataclass(frozen=True, slots=True)
class RequestSettings:
    """The config values every request's way reads, as plain attributes: an attribute of
    the config's pydantic models goes through their __getattr__ hook, which keeps the
    interpreter's attribute cache off (~450 instructions a read, 25 reads a request; a
    slot's is a few dozen). Made from the Config (frozen) by Plane whenever its config
    is set (issue #22)."""

    max_concurrent_streams: int  # limits.
    routing_policy: str  # routing.policy
    cache_salt: str  # routing.
    block_size_bytes: int  # routing.
    request_timeout_s: float  # upstream.
    first_byte_timeout_s: float  # upstream.
    max_attempts: int  # upstream.
    refuse_predicted_late: bool  # reliability.admission: enabled and refuse_predicted_late
    failover_enabled: bool  # reliability.failover.enabled
    max_resumes: int  # reliability.failover.
    cache_max_entry_bytes: int  # response_cache.max_entry_bytes

    @classmethod
    def of(cls, config: Config) -> RequestSettings:
        admission = config.reliability.admission
        failover = config.reliability.failover
        routing, upstream = config.routing, config.upstream
        return cls(
            max_concurrent_streams=config.limits.max_concurrent_streams,
            routing_policy=routing.policy,
            cache_salt=routing.cache_salt,
            block_size_bytes=routing.block_size_bytes,
            request_timeout_s=upstream.request_timeout_s,
            first_byte_timeout_s=upstream.first_byte_timeout_s,
            max_attempts=upstream.max_attempts,
            refuse_predicted_late=bool(admission.enabled and admission.refuse_predicted_late),
            failover_enabled=failover.enabled,
            max_resumes=failover.max_resumes,
            cache_max_entry_bytes=config.response_cache.max_entry_bytes,
        )


@dataclass(eq=False)
class Plane:
    """What every layer of one sidecar shares: its config, metrics and the pools' decision
    objects (routers, guards, retry budgets), and the relays the reaper watches.
    `settings`: the config's values a request reads, remade whenever `config` is set."""

    config: Config
    metrics: DataPlaneMetrics
    routers: dict[str, PoolRouter]
    guards: dict[str, PoolGuard]
    retry_budgets: dict[str, RetryBudget]
    observer: RequestObserver
    rng: random.Random = field(default_factory=random.Random)
    ids: Iterator[int] = field(default_factory=itertools.count)
    watches: set[Watch] = field(default_factory=set)
    upstream: UpstreamPool | None = None
    cache: ResponseCache | None = None  # response_cache.enabled
    settings: RequestSettings = field(init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "config":
            object.__setattr__(self, "settings", RequestSettings.of(value))


@dataclass(slots=True, eq=False)
class Watch:
    """A response being relayed, watched by the reaper for silence and deadline."""

    upstream: UpstreamResponse
    last_activity: float
    deadline: float
    expired: str | None = None


@dataclass(slots=True, eq=False)
class Attempt:
    """One try of a request on one endpoint, and what the router, the guard and the trace
    are told about it (once, by Attempts.settle)."""

    router: PoolRouter
    route: Route
    rid: int
    pool: str
    pick: PickRequest
    guard: PoolGuard | None
    trace: AttemptTrace
    ok: bool = False
    status: int = 0
    local_failure: bool = False  # no connection, reset, timeout, broken stream
    cancelled: bool = False  # the client left: no verdict on the endpoint
    retry_after_s: float | None = None  # a refusal's Retry-After, when it said one
    outcome: str = ""
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    settled: bool = False
    inference: InferenceRequest | None = None  # the prompt usage.prompt_tokens counts
    counted: bool = True  # the router and the guard count it in flight (Attempts.count)

    def engine_first_token(self, now: float) -> None:
        """The engine's first token came (a stream's, or a prefill step's whole answer):
        the router and the guard are told (the picker's queue model moves on, a TTFT
        calibration sample, the token breaker's outlier test)."""
        self.router.first_token(self.route, self.rid, now)
        if self.guard is not None:
            self.guard.first_token(self.rid, now, predicted_ttft_s=self.route.predicted_ttft_s)


@dataclass(slots=True)
class RequestContext:
    """One client request, as the request layer built it and the later layers filled in."""

    kind: str
    pool: str
    started: float
    trusted: bool
    method: str = "POST"
    target: str = "/"  # path and query, as the client sent them
    inference: InferenceRequest | None = None
    routing: RoutingHeaders | None = None
    block_hashes: list[int] = field(default_factory=list)
    tokens_per_block: int | None = None  # engine token blocks (precise path), else text
    request_id: str = ""
    obs: RequestTrace | None = None
    body: bytes = b""
    upstream_headers: list[tuple[str, str]] = field(default_factory=list)
    deadline: float = math.inf  # loop clock: the whole request, all tries
    # Loop clock: the client's latency budget (x-meshd-deadline-ms) for the answer's head;
    # no attempt or retry waits past it (the stream, once started, is bounded by `deadline`).
    head_by: float = math.inf
    pick: PickRequest | None = None
    tokens: int = 0  # expected prompt + output tokens (the token breaker's unit)
    item_id: int | None = None  # admission item while admitted
    # Admission judged it a step of a task under way (AdmissionItem.started): its task's
    # earlier steps are spent, so a predicted-late refusal (Attempts._late) spares it.
    continues_task: bool = False
    tried: set[str] = field(default_factory=set)
    cache: CachePlan | None = None  # a cacheable request: its key, rule and flight
    # Fallback (meshd/fallback.py): while the pool has a fallback left, a refusal is held
    # here instead of answered, so the request can go on to the next pool.
    hold_refusal: bool = False
    refused: tuple[int, str, str, dict[str, Any]] | None = None
    max_cost_usd: float | None = None  # the cost cap that sends it to a cheaper pool
    fallback: tuple[str, str, str] | None = None  # (from pool, to pool, why) once moved
    shed: bool = False  # admission or the throttle refused it (counted as unmet demand)
    # Prefill/decode (meshd/disagg.py): the decider's answer, and the prefill's transfer
    # params while the body is the decode step's (vLLM's protocol), or the plan of a
    # request whose tries are prefill/decode pairs (SGLang's).
    pd: Split | None = None
    pd_params: dict[str, Any] | None = None
    pd_pair: PairPlan | None = None
    # Each decode endpoint's predicted KV transfer (what its prefix cache lacks), for the
    # attempt made there; absent: `pd.transfer_s`.
    pd_transfers: dict[str, float] = field(default_factory=dict)

    @property
    def trace(self) -> RequestTrace:
        assert self.obs is not None, "the request has not begun"
        return self.obs
