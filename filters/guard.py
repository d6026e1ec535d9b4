"""A pool's reliability gate: client-side throttling, admission with deadline-aware
queueing, the token-aware circuit breaker and outlier ejection, composed into the few
calls a driver makes per request. Sans-I/O: time comes in; the driver owns the waiting.

Each part is its own module and is documented there; this one fixes the order in which
they speak and what each outcome means to the others:

1. `gate(item, now)` at arrival: the adaptive throttle first (a pool that refuses most of
   what it gets should not also be sent the rest), then admission (in-flight slots,
   then a queue ordered by priority band, tenant fair share and deadline).
2. `screen(routes, ...)` once admitted: each route the router proposed is kept unless the
   outlier detector ejected it, or the breaker says its endpoint is open, half-open with
   its probe out, or full (tokens, requests or pending prefills in flight). The verdict
   says whether the pool is *full* (wait for capacity: `requeue`) or *broken* (every
   endpoint open or ejected: fail fast, the breaker's point).
3. `started` / `first_token` / `finished` per attempt: the breaker's flights and failure
   accrual, the outlier detector's 5xx and success-rate counts, and the throttle's
   accepts (anything but an overload refusal counts as accepted).
4. `tick(now)` on a timer: breaker transitions, ejections and unejections, deadline
   expiry of queued requests; the driver applies them and answers refused waiters.

A failure is counted once per attempt, by the detector that owns its kind: connect
failures, resets, timeouts and 5xx go to both breaker and outlier detector (the breaker
opens fast on consecutive failures; ejection is Envoy's slower, percentage-bounded
judgement), 429 goes to neither (the engine is healthy and says it is busy).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from filters.admission import (
    ADMIT,
    Admission,
    AdmissionConfig,
    AdmissionItem,
    Admit,
    Queue,
    Reject,
)
from filters.outlier import OutlierConfig, OutlierDetector, OutlierEvent
from filters.retry_budget import RandomSource
from filters.throttle import AdaptiveThrottle, AdaptiveThrottleConfig
from filters.token_breaker import BreakerTransition, Limits, TokenBreaker, TokenBreakerConfig

__all__ = [
    "GuardConfig",
    "GuardEvents",
    "PoolGuard",
    "Screened",
    "Throttled",
]

# HTTP statuses by which an engine says "busy", not "broken".
OVERLOAD_STATUSES = frozenset({429, 503})


class _HasUrl(Protocol):
    @property
    def url(self) -> str: ...


R = TypeVar("R", bound=_HasUrl)


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """None turns a part off."""

    throttle: AdaptiveThrottleConfig | None = field(default_factory=AdaptiveThrottleConfig)
    admission: AdmissionConfig | None = field(default_factory=AdmissionConfig)
    breaker: TokenBreakerConfig | None = field(default_factory=TokenBreakerConfig)
    outlier: OutlierConfig | None = field(default_factory=OutlierConfig)


@dataclass(frozen=True, slots=True)
class Throttled:
    """Refused here by the adaptive throttle: the pool is refusing most requests."""

    p_reject: float
    retry_after_s: float = 1.0

    @property
    def code(self) -> str:
        return "throttled"

    @property
    def message(self) -> str:
        return (
            f"the pool is refusing most requests; {self.p_reject:.0%} are refused here "
            "before they reach it (client-side throttling)"
        )


@dataclass(frozen=True, slots=True)
class Screened(Generic[R]):
    """The routes that may be tried now, in the router's order, and why the others may
    not. `full`: nothing left because every remaining endpoint is at its in-flight
    limits (wait for capacity); otherwise an empty `routes` means every endpoint is
    open or ejected."""

    routes: list[R]
    skipped: list[tuple[str, str]]  # (url, reason)
    full: bool = False


@dataclass(slots=True)
class GuardEvents:
    breaker: list[BreakerTransition] = field(default_factory=list)
    outlier: list[OutlierEvent] = field(default_factory=list)
    rejected: list[Reject] = field(default_factory=list)  # queued requests refused
    dispatch: list[AdmissionItem] = field(default_factory=list)  # queued requests to wake


class PoolGuard:
    """One per pool. Driver protocol::

    d = guard.gate(item, now)              # Admit | Queue | Reject | Throttled
    ... Queue: wait until tick()/pump() hands item out in `dispatch`, or refuses it
    s = guard.screen(routes, tokens, priority, now)
    ... s.full: guard.requeue(item.id, now) and wait again; no routes: fail fast
    guard.started(url, rid, tokens, now, model=...)
    guard.first_token(rid, now, predicted_ttft_s=...)
    guard.finished(url, rid, now, status=..., local_failure=..., completion_tokens=...)
    guard.release(item.id, now)            # once per admitted request, any outcome
    ev = guard.pump(now)                   # after release/requeue: who may go next
    ev = guard.tick(now)                   # on a timer
    """

    def __init__(
        self,
        config: GuardConfig,
        endpoints: Iterable[str] = (),
        *,
        endpoint_limits: dict[str, Limits] | None = None,
    ) -> None:
        self.config = config
        self.throttle = AdaptiveThrottle(config.throttle) if config.throttle else None
        self.admission = Admission(config.admission) if config.admission else None
        self.breaker = TokenBreaker(config.breaker) if config.breaker else None
        self.outlier = OutlierDetector(config.outlier) if config.outlier else None
        for url in endpoints:
            self.add(url, (endpoint_limits or {}).get(url))

    # -- membership ------------------------------------------------------------------------

    def add(self, url: str, limits: Limits | None = None) -> None:
        if self.outlier is not None:
            self.outlier.add(url)
        if self.breaker is not None and limits is not None:
            self.breaker.set_limits(url, limits)

    def remove(self, url: str) -> None:
        if self.outlier is not None:
            self.outlier.remove(url)
        if self.breaker is not None:
            self.breaker.remove(url)

    # -- arrival -----------------------------------------------------------------------------

    def gate(
        self, item: AdmissionItem, now: float, rng: RandomSource
    ) -> Admit | Queue | Reject | Throttled:
        if self.throttle is not None and not self.throttle.allow(now, rng):
            return Throttled(self.throttle.p_reject(now))
        if self.admission is None:
            return ADMIT
        return self.admission.offer(item, now)

    def expected_tokens(self, model: str | None, prompt_tokens: int, max_tokens: int | None) -> int:
        if self.breaker is None:
            return prompt_tokens + (max_tokens or 0)
        return self.breaker.expected_tokens(model, prompt_tokens, max_tokens)

    def screen(
        self, routes: Sequence[R], tokens: int, priority: int | None, now: float
    ) -> Screened[R]:
        kept: list[R] = []
        skipped: list[tuple[str, str]] = []
        full = False
        for r in routes:
            url = r.url
            if self.outlier is not None and self.outlier.ejected(url, now):
                skipped.append((url, "ejected"))
                continue
            if self.breaker is not None:
                d = self.breaker.admit(url, tokens, priority, now)
                if d.verdict == "queue":
                    # The pool as a whole is at its limits: no route will do better.
                    return Screened([], [*skipped, (url, d.reason)], full=True)
                if d.verdict == "elsewhere":
                    skipped.append((url, d.reason))
                    full = full or d.reason.startswith("endpoint-")
                    continue
            kept.append(r)
        # Full only when nothing is kept and at least one endpoint is merely busy: a
        # busy endpoint frees up; a pool whose every endpoint is open or ejected does not.
        return Screened(kept, skipped, full=not kept and full)

    # -- attempts ----------------------------------------------------------------------------

    def started(
        self, url: str, rid: Hashable, tokens: int, now: float, *, model: str | None = None
    ) -> None:
        if self.breaker is not None:
            self.breaker.start(url, rid, tokens, now, model=model)

    def first_token(
        self, rid: Hashable, now: float, *, predicted_ttft_s: float | None = None
    ) -> None:
        if self.breaker is not None:
            self.breaker.first_token(rid, now, predicted_ttft_s=predicted_ttft_s)

    def finished(
        self,
        url: str,
        rid: Hashable,
        now: float,
        *,
        status: int | None = None,
        local_failure: bool = False,
        cancelled: bool = False,
        completion_tokens: int | None = None,
    ) -> None:
        """One attempt ended: with the HTTP `status` it answered (and, for a stream that
        broke after its headers, `local_failure` too), or `local_failure` alone (no
        connection, reset, timeout), or `cancelled` (the client left: no verdict)."""
        overloaded = status in OVERLOAD_STATUSES and not local_failure
        failed = local_failure or (status is not None and status >= 500 and not overloaded)
        if self.breaker is not None:
            verdict = None if cancelled or overloaded else not failed
            self.breaker.finish(rid, now, ok=verdict, completion_tokens=completion_tokens)
        if cancelled:
            return
        if self.outlier is not None and not overloaded:
            self.outlier.record(
                url, now, status=None if local_failure else status, local_failure=local_failure
            )
        if self.throttle is not None and status is not None and not overloaded:
            self.throttle.accepted(now)

    # -- queue -------------------------------------------------------------------------------

    def release(self, item_id: Hashable, now: float) -> None:
        if self.admission is not None:
            self.admission.release(item_id, now)

    def requeue(self, item_id: Hashable, now: float) -> None:
        if self.admission is not None:
            self.admission.requeue(item_id, now)

    def cancel(self, item_id: Hashable) -> bool:
        return self.admission.cancel(item_id) if self.admission is not None else False

    def pump(self, now: float) -> GuardEvents:
        """Queued requests that may go now, and queued requests refused."""
        ev = GuardEvents()
        adm = self.admission
        if adm is None:
            return ev
        while (item := adm.next(now)) is not None:
            ev.dispatch.append(item)
        ev.rejected = adm.take_rejected()
        return ev

    def tick(self, now: float) -> GuardEvents:
        ev = self.pump(now)
        if self.admission is not None:
            ev.rejected.extend(self.admission.expire(now))
        if self.breaker is not None:
            ev.breaker = self.breaker.tick(now)
        if self.outlier is not None:
            ev.outlier = self.outlier.tick(now)
        return ev

    # -- views -------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self.admission.queued if self.admission is not None else 0

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight if self.admission is not None else 0

    def tokens_in_flight(self) -> int:
        return self.breaker.pool_usage[0] if self.breaker is not None else 0

    def endpoint_view(self, url: str, now: float) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.breaker is not None:
            out["breaker"] = self.breaker.state(url, now)
        if self.outlier is not None:
            out["ejected_until"] = self.outlier.ejected_until(url)
        return out
