"""Token-aware circuit breaker: limits on what is in flight per endpoint and per pool,
counted in tokens (prompt + expected output) as well as requests, and a failure breaker
per endpoint (closed / open / half-open). Sans-I/O: time comes in, decisions go out.

Why tokens: an engine's KV cache fills with tokens, not requests; ten 100k-token prompts
and ten 100-token prompts are not the same load. Expected output is max_tokens capped by
history: `output_estimate_factor` x an EWMA of the completion tokens this model actually
produced, so a client that always asks for max_tokens=32k is not counted as 32k.

Breaker (after Hystrix/resilience4j, with Finagle's FailureAccrualFactory for consecutive
failures): closed -> open when `consecutive_failures` attempts fail in a row, or when the
error rate over `error_window_s` reaches `error_rate` with at least `error_min_requests`
(10 buckets on a fixed grid, each holding both counts, so a failure leaves with its outcome);
open for open_base_s x 2^k (k: trips since it last stayed closed for backoff_reset_s),
capped at open_max_s; then half-open: up to `half_open_probes` requests at a time are let
through, `half_open_successes` successes close it, one failure re-opens it. A first token
far slower than the pool's median (`ttft_outlier_factor` x, and at least
`ttft_outlier_min_s`) counts as a failure: a degraded engine is as bad as a failing one.

Per-priority headroom: a request of priority p may fill a limit only up to
share(p) x limit (`priority_shares`: priority >= 7 gets 100%, 3..6 gets 90%, below 3 gets
80%), so the last 10% stays free for high-priority traffic. An idle endpoint (or pool)
always takes one request, however large, so nothing is refused forever.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Literal

from filters.retry_budget import WindowedSum

__all__ = [
    "OK",
    "BreakerTransition",
    "Decision",
    "Limits",
    "TokenBreaker",
    "TokenBreakerConfig",
]

# The error-rate window's two sums, side by side in one ring so that a failure leaves the
# window with its outcome (they were two rings, each begun at its first use, and a failure
# could outlive its outcome by up to a slot: 11 failed of 20 read where 1 of 20 failed).
_OUTCOMES, _FAILED = 0, 1

BreakerState = Literal["closed", "open", "half-open"]
Verdict = Literal["ok", "elsewhere", "queue"]
DEFAULT_PRIORITY = 5


@dataclass(frozen=True, slots=True)
class Decision:
    """`ok`: send it here. `elsewhere`: this endpoint cannot take it, try the next route.
    `queue`: the pool as a whole is full; wait for capacity (filters/admission.py)."""

    verdict: Verdict
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


OK = Decision("ok")


@dataclass(frozen=True, slots=True)
class Limits:
    """None means unlimited."""

    max_tokens: int | None = None  # prompt + expected output tokens in flight
    max_requests: int | None = None  # requests in flight
    max_pending: int | None = None  # in flight without a first token yet (prefill queue)


@dataclass(frozen=True, slots=True)
class TokenBreakerConfig:
    # Per endpoint unless set_limits() says otherwise: vLLM's default max_num_seqs is 256;
    # 256k tokens is about an H100's KV cache for an 8B model.
    endpoint_limits: Limits = Limits(max_tokens=262_144, max_requests=256, max_pending=128)
    # Where an endpoint's KV capacity is known (kv_capacity()), its max_tokens is this many
    # times that capacity instead (None: endpoint_limits always). Over 1: tokens in flight
    # count each request's whole prompt and expected output, while the engine's KV holds
    # a shared prefix once and an answer only as far as it has got.
    kv_tokens_factor: float | None = 2.0
    pool_limits: Limits = Limits()  # the sum of endpoint limits already bounds the pool
    priority_shares: tuple[tuple[int, float], ...] = ((7, 1.0), (3, 0.9), (0, 0.8))
    # Output estimate.
    default_output_tokens: int = 512  # no max_tokens and no history yet
    output_estimate_factor: float = 2.0
    output_ewma_alpha: float = 0.1
    max_models: int = 1024
    # Failure accrual.
    consecutive_failures: int = 5
    error_rate: float = 0.5
    error_window_s: float = 10.0
    error_min_requests: int = 20
    # Open and half-open.
    open_base_s: float = 5.0
    open_max_s: float = 120.0
    backoff_reset_s: float = 300.0
    half_open_probes: int = 1
    half_open_successes: int = 2
    # Degradation: TTFT against the pool's running median.
    ttft_outlier_factor: float = 5.0
    ttft_outlier_min_s: float = 1.0
    ttft_median_step: float = 0.05  # relative step of the streaming median estimate
    # Bounds on memory.
    max_endpoints: int = 4096
    max_in_flight: int = 65_536

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1 or self.half_open_probes < 1:
            raise ValueError("consecutive_failures and half_open_probes must be >= 1")
        if not 0 < self.error_rate <= 1:
            raise ValueError("error_rate must be in (0, 1]")
        if not 0 < self.open_base_s <= self.open_max_s:
            raise ValueError("need 0 < open_base_s <= open_max_s")
        shares = [p for p, _ in self.priority_shares]
        if shares != sorted(shares, reverse=True) or not shares or shares[-1] > 0:
            raise ValueError("priority_shares must be sorted by priority, high first, down to 0")


@dataclass(frozen=True, slots=True)
class BreakerTransition:
    endpoint: str
    old: BreakerState
    new: BreakerState
    at: float
    reason: str


@dataclass(slots=True)
class _Usage:
    tokens: int = 0
    requests: int = 0
    pending: int = 0


@dataclass(slots=True)
class _Endpoint:
    limits: Limits
    window_s: float
    usage: _Usage = field(default_factory=_Usage)
    state: BreakerState = "closed"
    consecutive_failures: int = 0
    outcomes: WindowedSum = field(init=False)  # the verdicts (_OUTCOMES), the failed ones
    open_until: float = 0.0
    level: int = 0  # trips since it last stayed closed for backoff_reset_s
    closed_at: float | None = None
    probes: int = 0  # half-open probes in flight
    probe_successes: int = 0
    trips: int = 0
    degraded: int = 0

    def __post_init__(self) -> None:
        self.reset_window()

    def reset_window(self) -> None:
        self.outcomes = WindowedSum(self.window_s, counts=2)


@dataclass(slots=True)
class _Flight:
    endpoint: str
    tokens: int
    model: str | None
    started_at: float
    pending: bool = True
    probe: bool = False
    judged: bool = False  # its outcome already counted (a slow first token)


class TokenBreaker:
    """One per pool. Driver protocol per attempt::

        tokens = breaker.expected_tokens(model, prompt_tokens, max_tokens)
        d = breaker.admit(url, tokens, priority, now)        # ok / elsewhere / queue
        breaker.start(url, rid, tokens, now, model=model)    # when actually sent
        breaker.first_token(rid, now)                        # streams
        breaker.finish(rid, now, ok=True|False|None, completion_tokens=usage or None)
        for t in breaker.tick(now): state.set_flags(breaker_open=t.new == "open")

    Every call is O(1) except `tick`, which is O(log n) per transition it reports.
    Counters: `trips`, `rejected_elsewhere`, `rejected_queue`, `degraded`.
    """

    def __init__(
        self,
        config: TokenBreakerConfig | None = None,
        *,
        on_transition: Callable[[BreakerTransition], None] | None = None,
    ) -> None:
        self.config = config or TokenBreakerConfig()
        self._on_transition = on_transition
        self._endpoints: OrderedDict[str, _Endpoint] = OrderedDict()
        self._flights: dict[Hashable, _Flight] = {}
        self._pool = _Usage()
        self._outputs: OrderedDict[str, float] = OrderedDict()
        self._median: dict[bool, float] = {}  # normalised? -> running median TTFT sample
        self._timers: list[tuple[float, int, str]] = []
        self._timer_seq = 0
        self._events: list[BreakerTransition] = []
        self.trips = 0
        self.rejected_elsewhere = 0
        self.rejected_queue = 0
        self.degraded = 0

    # -- endpoints -------------------------------------------------------------------------

    def set_limits(self, endpoint: str, limits: Limits) -> None:
        self._endpoint(endpoint).limits = limits

    def kv_capacity(self, endpoint: str, tokens: int) -> bool:
        """The endpoint's engine holds `tokens` of KV (its report, its /metrics, the
        config): its token limit follows (kv_tokens_factor). Whether the limits changed."""
        factor = self.config.kv_tokens_factor
        if factor is None or tokens <= 0:
            return False
        ep = self._endpoint(endpoint)
        limits = replace(ep.limits, max_tokens=max(1, int(factor * tokens)))
        if limits == ep.limits:
            return False
        ep.limits = limits
        return True

    def remove(self, endpoint: str) -> None:
        """Forget an endpoint that left the pool (its in-flight requests still finish)."""
        self._endpoints.pop(endpoint, None)

    def _endpoint(self, name: str) -> _Endpoint:
        ep = self._endpoints.get(name)
        if ep is not None:
            return ep
        if len(self._endpoints) >= self.config.max_endpoints:
            for old, e in self._endpoints.items():
                if e.usage.requests == 0 and e.state == "closed":
                    del self._endpoints[old]
                    break
            else:
                raise ValueError(f"more than max_endpoints ({self.config.max_endpoints}) busy")
        ep = _Endpoint(self.config.endpoint_limits, self.config.error_window_s)
        self._endpoints[name] = ep
        return ep

    # -- estimates ---------------------------------------------------------------------------

    def expected_output(self, model: str | None, max_tokens: int | None) -> int:
        cfg = self.config
        avg = self._outputs.get(model) if model is not None else None
        if avg is None:
            return max_tokens if max_tokens is not None else cfg.default_output_tokens
        estimate = math.ceil(cfg.output_estimate_factor * avg)
        # Conditionals, not min()/max() (~750 instructions a builtin call): the same values.
        if max_tokens is None:
            return estimate
        return estimate if estimate < max_tokens else max_tokens

    def expected_tokens(self, model: str | None, prompt_tokens: int, max_tokens: int | None) -> int:
        return (prompt_tokens if prompt_tokens > 1 else 1) + self.expected_output(model, max_tokens)

    def observe_output(self, model: str, completion_tokens: int) -> None:
        outputs = self._outputs
        avg = outputs.pop(model, None)  # and set again: the most recent model last
        x = completion_tokens + 0.0 if completion_tokens > 0 else 0.0
        if avg is not None:
            outputs[model] = avg + self.config.output_ewma_alpha * (x - avg)
            return
        outputs[model] = x
        while len(outputs) > self.config.max_models:
            outputs.popitem(last=False)

    # -- decisions -------------------------------------------------------------------------

    def share(self, priority: int | None) -> float:
        p = DEFAULT_PRIORITY if priority is None else priority
        for least, share in self.config.priority_shares:
            if p >= least:
                return share
        return self.config.priority_shares[-1][1]

    def state(self, endpoint: str, now: float) -> BreakerState:
        ep = self._endpoints.get(endpoint)
        if ep is None:
            return "closed"
        if ep.state == "open":  # (_refresh moves only an open breaker: no call otherwise)
            self._refresh(endpoint, ep, now)
        return ep.state

    def admit(
        self, endpoint: str, tokens: int, priority: int | None, now: float, *, scale: float = 1.0
    ) -> Decision:
        """May a request of `tokens` (expected_tokens) at `priority` go to `endpoint` now?
        `scale` shrinks the endpoint's limits (a slow-start weight). Pure: nothing is
        reserved until `start`."""
        ep = self._endpoints.get(endpoint)
        if ep is None:
            ep = self._endpoint(endpoint)
        if ep.state != "closed":
            self._refresh(endpoint, ep, now)
            if ep.state == "open":
                return self._elsewhere("breaker-open")
            if ep.state == "half-open" and ep.probes >= self.config.half_open_probes:
                return self._elsewhere("breaker-half-open")
        # An idle pool and endpoint take anything (_over): no share to look up, no call
        # (each costs ~5 us with cold caches on the way to the upstream send).
        pool, usage = self._pool, ep.usage
        if pool.requests == 0 and usage.requests == 0:
            return OK
        share = self.share(priority)
        over = _over(pool, self.config.pool_limits, tokens, share)
        if over is not None:
            self.rejected_queue += 1
            return Decision("queue", f"pool-{over}")
        over = _over(usage, ep.limits, tokens, share * scale)
        if over is not None:
            return self._elsewhere(f"endpoint-{over}")
        return OK

    def _elsewhere(self, reason: str) -> Decision:
        self.rejected_elsewhere += 1
        return Decision("elsewhere", reason)

    # -- request lifecycle -------------------------------------------------------------------

    def start(
        self, endpoint: str, rid: Hashable, tokens: int, now: float, *, model: str | None = None
    ) -> None:
        flights = self._flights
        if rid in flights:
            raise ValueError(f"request {rid!r} already started")
        if len(flights) >= self.config.max_in_flight:
            raise ValueError(f"more than max_in_flight ({self.config.max_in_flight}) requests")
        # Each call costs ~5 us with cold caches, once per attempt: the endpoint looked up
        # (made only if new), _refresh only for an open breaker, the two usages in line.
        ep = self._endpoints.get(endpoint)
        if ep is None:
            ep = self._endpoint(endpoint)
        if ep.state == "open":
            self._refresh(endpoint, ep, now)
        f = _Flight(endpoint, tokens, model, now)
        if ep.state == "half-open":
            f.probe = True
            ep.probes += 1
        flights[rid] = f
        u = ep.usage
        u.tokens += tokens
        u.requests += 1
        u.pending += 1
        u = self._pool
        u.tokens += tokens
        u.requests += 1
        u.pending += 1

    def first_token(
        self, rid: Hashable, now: float, *, predicted_ttft_s: float | None = None
    ) -> float | None:
        """The first token arrived. Returns the TTFT (None for an unknown id). With the
        picker's prediction, the outlier test runs on observed / predicted, which discounts
        long prompts; without, on the raw TTFT. Use one or the other per pool."""
        f = self._flights.get(rid)
        if f is None or not f.pending:
            return None
        f.pending = False
        ep = self._endpoints.get(f.endpoint)
        self._pool.pending -= 1
        if ep is not None:
            ep.usage.pending -= 1
        ttft = now - f.started_at
        normalised = predicted_ttft_s is not None and predicted_ttft_s > 0
        sample = ttft / predicted_ttft_s if normalised and predicted_ttft_s else ttft
        cfg = self.config
        median = self._median.get(normalised)
        slow = (
            median is not None
            and sample > cfg.ttft_outlier_factor * median
            and ttft >= cfg.ttft_outlier_min_s
        )
        # Frugal streaming median (Ma, Muthukrishnan, Sandler, "Frugal Streaming for
        # Estimating Quantiles", 2013), multiplicative so it fits any scale: O(1) memory.
        if median is None:
            self._median[normalised] = sample
        elif sample > median:
            self._median[normalised] = median * (1 + cfg.ttft_median_step)
        elif sample < median:
            self._median[normalised] = median * (1 - cfg.ttft_median_step)
        if slow and ep is not None:
            f.judged = True
            ep.degraded += 1
            self.degraded += 1
            self._outcome(f.endpoint, ep, f, False, now, "ttft-outlier")
        return ttft

    def finish(
        self,
        rid: Hashable,
        now: float,
        *,
        ok: bool | None,
        completion_tokens: int | None = None,
    ) -> None:
        """The attempt ended: ok True (success), False (failure: 5xx, reset, timeout) or
        None (no verdict: the client cancelled). Unknown ids are ignored."""
        f = self._flights.pop(rid, None)
        if f is None:
            return
        ep = self._endpoints.get(f.endpoint)
        pending = 1 if f.pending else 0
        u = self._pool
        u.tokens -= f.tokens
        u.requests -= 1
        u.pending -= pending
        if ep is not None:
            u = ep.usage
            u.tokens -= f.tokens
            u.requests -= 1
            u.pending -= pending
        if ok and completion_tokens is not None and f.model is not None:
            self.observe_output(f.model, completion_tokens)
        if ep is None:
            return
        if f.probe:
            ep.probes -= 1
        if ok is not None and not f.judged:
            if ok and ep.state == "closed":  # _outcome's common case, without the call
                ep.outcomes.add(now, 1, _OUTCOMES)
                ep.consecutive_failures = 0
            else:
                self._outcome(f.endpoint, ep, f, ok, now, "failures")

    # -- state machine -----------------------------------------------------------------------

    def _outcome(
        self, name: str, ep: _Endpoint, f: _Flight, ok: bool, now: float, why: str
    ) -> None:
        if ep.state == "open":  # (_refresh moves only an open breaker: no call otherwise)
            self._refresh(name, ep, now)
        cfg = self.config
        if ep.state == "half-open":
            if not f.probe:
                return  # sent before the trip: says nothing about recovery
            if not ok:
                self._trip(name, ep, now, f"probe-{why}")
                return
            ep.probe_successes += 1
            if ep.probe_successes >= cfg.half_open_successes:
                ep.state = "closed"
                ep.consecutive_failures = 0
                ep.closed_at = now
                ep.reset_window()
                self._emit(name, "half-open", "closed", now, "probes-succeeded")
            return
        if ep.state == "open":
            return
        outcomes = ep.outcomes
        outcomes.add(now, 1, _OUTCOMES)
        if ok:
            ep.consecutive_failures = 0
            return
        outcomes.add(now, 1, _FAILED)
        ep.consecutive_failures += 1
        if ep.consecutive_failures >= cfg.consecutive_failures:
            self._trip(name, ep, now, f"consecutive-{why}")
            return
        total, failed = outcomes.totals(now)
        if total >= cfg.error_min_requests and failed >= cfg.error_rate * total:
            self._trip(name, ep, now, "error-rate")

    def _trip(self, name: str, ep: _Endpoint, now: float, reason: str) -> None:
        cfg = self.config
        if ep.closed_at is not None and now - ep.closed_at >= cfg.backoff_reset_s:
            ep.level = 0
        duration = min(cfg.open_max_s, cfg.open_base_s * 2.0**ep.level)
        ep.level += 1
        old = ep.state
        ep.state = "open"
        ep.open_until = now + duration
        ep.probe_successes = 0
        ep.trips += 1
        self.trips += 1
        self._timer_seq += 1
        heapq.heappush(self._timers, (ep.open_until, self._timer_seq, name))
        if len(self._timers) > 2 * len(self._endpoints) + 64:
            self._compact_timers()
        self._emit(name, old, "open", now, reason)

    def probe_now(self, endpoint: str, now: float) -> bool:
        """An open breaker goes half-open now, not when its open time ends (its engine
        restarted: what failed is gone; the probes still decide). Whether it was open."""
        ep = self._endpoints.get(endpoint)
        if ep is None or ep.state != "open":
            return False
        ep.open_until = now  # its timer no longer matches: _refresh already moved it
        self._refresh(endpoint, ep, now)
        return True

    def _refresh(self, name: str, ep: _Endpoint, now: float) -> None:
        if ep.state == "open" and now >= ep.open_until:
            ep.state = "half-open"
            ep.probe_successes = 0
            self._emit(name, "open", "half-open", ep.open_until, "open-time-elapsed")

    def _compact_timers(self) -> None:
        eps = self._endpoints
        self._timers = [
            t for t in self._timers if (e := eps.get(t[2])) is not None and e.state == "open"
        ]
        heapq.heapify(self._timers)

    def _emit(self, name: str, old: BreakerState, new: BreakerState, at: float, why: str) -> None:
        t = BreakerTransition(name, old, new, at, why)
        self._events.append(t)
        if len(self._events) > 4 * self.config.max_endpoints:
            del self._events[: len(self._events) // 2]  # nobody is calling tick()
        if self._on_transition is not None:
            self._on_transition(t)

    def tick(self, now: float) -> list[BreakerTransition]:
        """Move breakers whose open time has passed to half-open; return every transition
        since the last call, oldest first (apply them to EndpointState.set_flags: open
        means breaker_open=True; half-open and closed mean False, so the picker may send
        the probe)."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, name = heapq.heappop(timers)
            ep = self._endpoints.get(name)
            if ep is not None:
                self._refresh(name, ep, now)
        events, self._events = self._events, []
        return events

    def snapshot(self, now: float) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for name, ep in self._endpoints.items():
            self._refresh(name, ep, now)
            out.append(
                {
                    "endpoint": name,
                    "state": ep.state,
                    "tokens_in_flight": ep.usage.tokens,
                    "requests_in_flight": ep.usage.requests,
                    "pending": ep.usage.pending,
                    "consecutive_failures": ep.consecutive_failures,
                    "trips": ep.trips,
                    "degraded": ep.degraded,
                    "open_until": ep.open_until if ep.state == "open" else None,
                }
            )
        return out

    @property
    def pool_usage(self) -> tuple[int, int, int]:
        """(tokens, requests, pending) in flight across the pool."""
        return self._pool.tokens, self._pool.requests, self._pool.pending


def _over(usage: _Usage, limits: Limits, tokens: int, share: float) -> str | None:
    """Which limit this request would break at this share, or None. An idle usage takes
    anything: a request larger than a whole limit must still run somewhere."""
    if usage.requests == 0:
        return None
    if limits.max_requests is not None and usage.requests + 1 > share * limits.max_requests:
        return "requests"
    if limits.max_pending is not None and usage.pending + 1 > share * limits.max_pending:
        return "pending"
    if limits.max_tokens is not None and usage.tokens + tokens > share * limits.max_tokens:
        return "tokens"
    return None
