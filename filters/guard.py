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
   accepts (anything but an overload refusal counts as accepted, a stream at its first
   token, and an answer the client left before it ended still counts).
4. `tick(now)` on a timer: breaker transitions, ejections and unejections, deadline
   expiry of queued requests; the driver applies them and answers refused waiters.
5. `GuardEvents.flags` (from `pump` and `tick`): what the router must know before it
   chooses, per endpoint whose view changed: breaker open, ejected until, and the
   slow-start ramp. An endpoint ramps (filters/slow_start.py) from the moment the guard
   sees it healthy again: its breaker closed after half-open probes, its ejection ended,
   or it joined the pool after start-up (`add(..., now=)`) or restarted (`restarted`);
   while open, half-open or ejected its weight is the ramp's minimum. While a ramp is in
   progress every `tick` reports its new weight (in steps of RAMP_STEP), so the driver
   only has to apply what comes out: `router.set_flags(f.url, breaker_open=..., ...)`.
   `screen` shrinks a ramping endpoint's in-flight limits by the same weight.

A failure is counted once per attempt, by the detector that owns its kind: connect
failures, resets, timeouts and 5xx go to both breaker and outlier detector (the breaker
opens fast on consecutive failures; ejection is Envoy's slower, percentage-bounded
judgement), 429 goes to neither (the engine is healthy and says it is busy), a 503 goes
to neither while it is a moment's refusal but to both once an endpoint has answered
REFUSALS_AS_FAILURE consecutive 503s (an engine that only ever says 503 is unhealthy to
its clients, whatever it calls it: it would stay the first pick forever), and an
attempt the client abandoned far slower than the pool's typical pace goes to the outlier
detector only (`slow_abandon_factor`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

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
from filters.slow_start import SlowStart, SlowStartConfig
from filters.throttle import AdaptiveThrottle, AdaptiveThrottleConfig
from filters.token_breaker import (
    BreakerState,
    BreakerTransition,
    Limits,
    TokenBreaker,
    TokenBreakerConfig,
)

__all__ = [
    "EndpointFlags",
    "GuardConfig",
    "GuardEvents",
    "PoolGuard",
    "Screened",
    "Throttled",
]

# HTTP statuses by which an engine says "busy", not "broken".
OVERLOAD_STATUSES = frozenset({429, 503})
# Consecutive 503s from one endpoint after which they count as failures (module docstring).
REFUSALS_AS_FAILURE = 5
# A ramping endpoint's weight is re-published when it moved this much (or reached 1):
# each publication makes the picker rebuild that endpoint's view.
RAMP_STEP = 0.02
_new_tuple = tuple.__new__
# EndpointFlags' fields for a healthy endpoint (EndpointFlags(url)'s defaults): an attempt's
# end marks its endpoint for publishing, and most are healthy and were published so
# (two EndpointFlags built and compared per request, ~20 us each with cold caches).
_HEALTHY = (False, None, 1.0)
# The pool's typical seconds per expected token: a streaming median estimate (relative
# step per sample), trusted after this many successful attempts.
PACE_STEP = 0.05
PACE_MIN_SAMPLES = 8
# Attempts in flight whose start the guard keeps for that judgement (the breaker's own
# bound, TokenBreakerConfig.max_in_flight); beyond it new attempts are not judged.
MAX_TRACKED_FLIGHTS = 65_536


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
    slow_start: SlowStartConfig | None = field(default_factory=SlowStartConfig)
    # An attempt whose client gave up (closed the stream) after more than this many times
    # the pool's typical seconds per expected token counts as a failure for outlier
    # ejection: an engine that decodes at a tenth of the speed sends its first token in
    # time and is then abandoned by every client, which says nothing to the breaker
    # (a cancel is no verdict) unless someone notices. Percentage-bounded ejection, not
    # the breaker, hears it: a client's timeout is a weaker signal than a 5xx. None: off.
    slow_abandon_factor: float | None = 3.0


@dataclass(frozen=True, slots=True)
class EndpointFlags:
    """The guard's view of one endpoint, for PoolRouter.set_flags. `breaker_open` is
    False while half-open (the router may send the probe; `screen` allows one);
    `ejected_until` is None when not ejected; `ramp` is the slow-start weight in (0, 1]
    (while open, half-open or ejected: the ramp's minimum, what it comes back at)."""

    url: str
    breaker_open: bool = False
    ejected_until: float | None = None
    ramp: float = 1.0

    @property
    def healthy(self) -> bool:
        return not self.breaker_open and self.ejected_until is None and self.ramp >= 1.0


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


class Screened(NamedTuple, Generic[R]):
    """The routes that may be tried now, in the router's order, and why the others may
    not. `full`: nothing left because every remaining endpoint is at its in-flight
    limits (wait for capacity); otherwise an empty `routes` means every endpoint is
    open or ejected. A NamedTuple, built by `screen` with tuple.__new__: one a request
    on the way to the upstream send, ~9 us with cold caches against ~24 us for the
    frozen dataclass it was (loadtest/admission_bench.py)."""

    routes: list[R]
    skipped: list[tuple[str, str]]  # (url, reason)
    full: bool = False


@dataclass(slots=True)
class GuardEvents:
    breaker: list[BreakerTransition] = field(default_factory=list)
    outlier: list[OutlierEvent] = field(default_factory=list)
    rejected: list[Reject] = field(default_factory=list)  # queued requests refused
    dispatch: list[AdmissionItem] = field(default_factory=list)  # queued requests to wake
    flags: list[EndpointFlags] = field(default_factory=list)  # for router.set_flags


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
    for f in ev.flags: router.set_flags(f.url, breaker_open=f.breaker_open,
                                        ejected_until=f.ejected_until, ramp=f.ramp, now=now)
    """

    def __init__(
        self,
        config: GuardConfig,
        endpoints: Iterable[str] = (),
        *,
        endpoint_limits: dict[str, Limits] | None = None,
        pool_wait: Callable[[float, float], float | None] | None = None,
    ) -> None:
        """`pool_wait`: the router's PoolRouter.pool_wait, for admission's knee."""
        self.config = config
        self.throttle = AdaptiveThrottle(config.throttle) if config.throttle else None
        self.admission = (
            Admission(config.admission, wait_source=pool_wait) if config.admission else None
        )
        self.breaker = TokenBreaker(config.breaker) if config.breaker else None
        self.outlier = OutlierDetector(config.outlier) if config.outlier else None
        self.slow_start = SlowStart(config.slow_start) if config.slow_start else None
        # Flags as last published, for endpoints whose flags are not all clear; and the
        # endpoints whose flags may have changed since (published by the next pump/tick).
        self._published: dict[str, EndpointFlags] = {}
        self._dirty: set[str] = set()
        self._sick: set[str] = set()  # last seen open, half-open or ejected
        self._accepted: set[Hashable] = set()  # attempts the throttle counted at first token
        self._refusals: dict[str, int] = {}  # url -> consecutive 503s it answered
        # Slow abandonment: (start, expected tokens) per attempt in flight, and the pool's
        # typical pace (seconds per expected token) of attempts that succeeded.
        self._flights: dict[Hashable, tuple[float, int]] = {}
        self._pace: float | None = None
        self._pace_samples = 0
        self._judges_abandons = config.slow_abandon_factor is not None and self.outlier is not None
        self.slow_abandons = 0
        # Endpoints of the pool at start-up do not ramp: they all start cold together,
        # and a ramp for all is a ramp for none.
        for url in endpoints:
            self.add(url, (endpoint_limits or {}).get(url))

    # -- membership ------------------------------------------------------------------------

    def add(self, url: str, limits: Limits | None = None, *, now: float | None = None) -> None:
        """An endpoint joins; with `now` (it joined a running pool) it ramps from then."""
        if self.outlier is not None:
            self.outlier.add(url)
        if self.breaker is not None and limits is not None:
            self.breaker.set_limits(url, limits)
        if now is not None:
            self.restarted(url, now)

    def kv_capacity(self, url: str, tokens: int) -> None:
        """The endpoint's KV capacity as the router learnt it: the breaker's token limit
        follows it (TokenBreakerConfig.kv_tokens_factor)."""
        if self.breaker is not None:
            self.breaker.kv_capacity(url, tokens)

    def remove(self, url: str) -> None:
        if self.outlier is not None:
            self.outlier.remove(url)
        if self.breaker is not None:
            self.breaker.remove(url)
        if self.slow_start is not None:
            self.slow_start.forget(url)
        self._published.pop(url, None)
        self._dirty.discard(url)
        self._sick.discard(url)

    def restarted(self, url: str, now: float) -> None:
        """The endpoint's engine came back with an empty cache (a new report epoch, a
        restart): what failed is gone, so an ejection ends and an open breaker goes
        half-open now (its probes decide; an engine ejected again is out longer, Envoy's
        multiplier), and it ramps from `now`. (Issue #21's campaign: a killed engine,
        restarted at once, stayed out for the ejection's 30 s.)"""
        if self.outlier is not None:
            self.outlier.uneject(url, now, "restarted")
        if self.breaker is not None:
            self.breaker.probe_now(url, now)
        if self.slow_start is not None:
            self.slow_start.became_healthy(url, now)
        self._dirty.add(url)

    # -- arrival -----------------------------------------------------------------------------

    def gate(
        self, item: AdmissionItem, now: float, rng: RandomSource
    ) -> Admit | Queue | Reject | Throttled:
        # The throttle's calm (no refusal in its window) asked here: its call is ~5 us
        # with cold caches, for a yes in the common case (filters/throttle.py).
        throttle = self.throttle
        if throttle is not None and now < throttle.calm_from and not throttle.allow(now, rng):
            return Throttled(throttle.p_reject(now))
        if self.admission is None:
            return ADMIT
        return self.admission.offer(item, now)

    def expected_tokens(self, model: str | None, prompt_tokens: int, max_tokens: int | None) -> int:
        if self.breaker is None:
            return prompt_tokens + (max_tokens or 0)
        return self.breaker.expected_tokens(model, prompt_tokens, max_tokens)

    def screen(
        self,
        routes: Sequence[R],
        tokens: int,
        priority: int | None,
        now: float,
        *,
        continuation: bool = False,
        limit: int | None = None,
    ) -> Screened[R]:
        """`continuation`: the attempt resumes a stream that already sent tokens (sunk
        cost, and a client waiting mid-answer): in-flight limits do not hold it back, only
        an open, half-open or ejected endpoint does. `limit`: stop once that many routes
        are kept (a driver that tries only the first asks nothing of the rest: ~13 us a
        route with cold caches, loadtest/admission_bench.py); the routes after them are
        neither kept nor skipped."""
        kept: list[R] = []
        skipped: list[tuple[str, str]] = []
        full = False
        ramps = self.slow_start
        for r in routes:
            url = r.url
            if self.outlier is not None and self.outlier.ejected(url, now):
                skipped.append((url, "ejected"))
                continue
            if self.breaker is not None:
                scale = ramps.weight(url, now) if ramps is not None else 1.0
                d = self.breaker.admit(url, tokens, priority, now, scale=scale)
                if continuation and d.reason.startswith(("endpoint-", "pool-")):
                    kept.append(r)
                    if len(kept) == limit:
                        break
                    continue
                if d.verdict == "queue":
                    # The pool as a whole is at its limits: no route will do better.
                    return Screened([], [*skipped, (url, d.reason)], full=True)
                if d.verdict == "elsewhere":
                    skipped.append((url, d.reason))
                    full = full or d.reason.startswith("endpoint-")
                    continue
            kept.append(r)
            if len(kept) == limit:
                break
        # Full only when nothing is kept and at least one endpoint is merely busy: a
        # busy endpoint frees up; a pool whose every endpoint is open or ejected does not.
        return _new_tuple(Screened, (kept, skipped, not kept and full))

    # -- attempts ----------------------------------------------------------------------------

    def started(
        self, url: str, rid: Hashable, tokens: int, now: float, *, model: str | None = None
    ) -> None:
        if self.breaker is not None:
            self.breaker.start(url, rid, tokens, now, model=model)
        if self._judges_abandons and len(self._flights) < MAX_TRACKED_FLIGHTS:
            self._flights[rid] = (now, tokens if tokens > 1 else 1)

    def first_token(
        self, rid: Hashable, now: float, *, predicted_ttft_s: float | None = None
    ) -> None:
        if self.breaker is not None:
            self.breaker.first_token(rid, now, predicted_ttft_s=predicted_ttft_s)
        if self.throttle is not None and rid not in self._accepted:
            # A stream is accepted when it starts, not when it ends: counted at the end,
            # every stream in flight would read as a refusal (p_reject near 1 at start-up).
            self._accepted.add(rid)
            self.throttle.accepted(now)

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
        if status == 503 and not local_failure:
            streak = self._refusals[url] = self._refusals.get(url, 0) + 1
            if streak >= REFUSALS_AS_FAILURE:
                overloaded = False  # a 503 storm: a failure, for the breaker and ejection
                if streak == REFUSALS_AS_FAILURE and self.outlier is not None:
                    for _ in range(streak - 1):  # the streak's earlier ones, now judged
                        self.outlier.record(url, now, status=status, local_failure=False)
        elif self._refusals and not cancelled and (status is not None or local_failure):
            self._refusals.pop(url, None)
        failed = local_failure or (status is not None and status >= 500 and not overloaded)
        self._dirty.add(url)  # the breaker or the ejection may have moved: see pump()
        if self.breaker is not None:
            verdict = None if cancelled or overloaded else not failed
            self.breaker.finish(rid, now, ok=verdict, completion_tokens=completion_tokens)
        # The pool accepted it if it answered with anything but an overload refusal, even
        # if the client left afterwards (a client's timeout is not the pool's refusal); it
        # refused it with an overload status (a 503 storm too) or no connection. A client
        # that left before any answer gives no verdict.
        early = rid in self._accepted
        if early:
            self._accepted.discard(rid)
        elif self.throttle is not None:
            refusal = status in OVERLOAD_STATUSES and not local_failure
            if status is not None and not refusal:
                self.throttle.accepted(now)
            elif refusal or (local_failure and not cancelled):
                self.throttle.refused(now)
        flight = self._flights.pop(rid, None)
        if cancelled:
            if flight is not None and status is not None and not overloaded:
                self._judge_abandoned(url, flight, now)
            return
        if flight is not None and not failed and not overloaded:
            # The pool's pace, a streaming median (PACE_STEP), in line: once an attempt.
            pace = (now - flight[0]) / flight[1]
            m = self._pace
            self._pace = pace if m is None else m * (1 + PACE_STEP if pace > m else 1 - PACE_STEP)
            self._pace_samples += 1
        if self.outlier is not None and not overloaded:
            self.outlier.record(
                url, now, status=None if local_failure else status, local_failure=local_failure
            )

    def _judge_abandoned(self, url: str, flight: tuple[float, int], now: float) -> None:
        factor, typical = self.config.slow_abandon_factor, self._pace
        if factor is None or typical is None or self._pace_samples < PACE_MIN_SAMPLES:
            return
        if (now - flight[0]) / flight[1] > factor * typical and self.outlier is not None:
            self.slow_abandons += 1
            self.outlier.record(url, now, local_failure=True)

    # -- queue -------------------------------------------------------------------------------

    def routed(self, item_id: Hashable, now: float) -> GuardEvents | None:
        """The router placed admitted item `item_id`: when it was the one let past
        admission's knee gate, the next held request may be judged now (the pump's
        events), else None."""
        if self.admission is None or not self.admission.routed(item_id):
            return None
        return self.pump(now)

    def step_succeeded(self, task_id: str) -> None:
        """A step of the task (its context key: workflow, session or task id) succeeded:
        its later steps are a started task's (admission's sunk-cost band)."""
        if self.admission is not None:
            self.admission.record_step(task_id)

    def release(self, item_id: Hashable, now: float) -> None:
        if self.admission is not None:
            self.admission.release(item_id, now)

    def requeue(self, item_id: Hashable, now: float) -> None:
        if self.admission is not None:
            self.admission.requeue(item_id, now)

    def cancel(self, item_id: Hashable) -> bool:
        return self.admission.cancel(item_id) if self.admission is not None else False

    def pump(self, now: float) -> GuardEvents:
        """Queued requests that may go now, queued requests refused, and the flags of
        endpoints whose view changed since the last pump or tick."""
        ev = GuardEvents()
        if self._dirty:
            ev.flags = self._publish(self._dirty, now)
            self._dirty = set()
        adm = self.admission
        if adm is None:
            return ev
        while (item := adm.next(now)) is not None:
            ev.dispatch.append(item)
        ev.rejected = adm.take_rejected()
        return ev

    def tick(self, now: float) -> GuardEvents:
        # Expiry first: it refuses what is late and lets one held new task past the knee.
        late = self.admission.expire(now) if self.admission is not None else []
        ev = self.pump(now)
        ev.rejected[:0] = late
        if self.breaker is not None:
            ev.breaker = self.breaker.tick(now)
        if self.outlier is not None:
            ev.outlier = self.outlier.tick(now)
        # Whatever moved, and every endpoint not yet back at full weight (its ramp).
        urls = {t.endpoint for t in ev.breaker} | {o.endpoint for o in ev.outlier}
        urls.update(self._published)
        ev.flags.extend(self._publish(urls, now))
        return ev

    # -- flags -------------------------------------------------------------------------------

    def flags(self, url: str, now: float) -> EndpointFlags:
        """The guard's view of `url` now (see EndpointFlags)."""
        return EndpointFlags(url, *self._view(url, now))

    def _view(
        self,
        url: str,
        now: float,
        state: BreakerState | None = None,
        ejected: bool | None = None,
    ) -> tuple[bool, float | None, float]:
        """flags' fields: (breaker open, ejected until, ramp); `state` and `ejected`: the
        breaker's state and the ejection now, when the caller has asked already."""
        if state is None:
            state = self.breaker.state(url, now) if self.breaker is not None else "closed"
        if ejected is None:
            ejected = self.outlier is not None and self.outlier.ejected(url, now)
        until = None
        if ejected and self.outlier is not None:
            until = self.outlier.ejected_until(url)
        ramps = self.slow_start
        ramp = 1.0
        if ramps is not None:
            if state == "closed" and until is None:
                ramp = ramps.weight(url, now)
            else:
                # Open, half-open or ejected: the weight it will come back at, so that the
                # router has it from the first moment (an ejection ends by the clock).
                ramp = ramps.config.min_weight_percent / 100.0 or RAMP_STEP
        return state == "open", until, ramp

    def _publish(self, urls: Iterable[str], now: float) -> list[EndpointFlags]:
        """The flags of `urls` that differ from what was last published (a ramp's weight
        only once it moved by RAMP_STEP). An endpoint seen open, half-open or ejected
        loses its ramp; seen healthy after that, it starts one."""
        out: list[EndpointFlags] = []
        ramps, breaker, outlier = self.slow_start, self.breaker, self.outlier
        published, sick = self._published, self._sick
        for url in urls:
            # Each asked once here, for the ramp and the view both (~5 us a call with cold
            # caches, once per attempt's end).
            ejected = outlier is not None and outlier.ejected(url, now)
            state = breaker.state(url, now) if breaker is not None else "closed"
            if (
                state == "closed"
                and not ejected
                and url not in published
                and url not in sick
                and (ramps is None or ramps.weight(url, now) == 1.0)
            ):
                # Healthy, not ramping, and last published so (the end of most attempts):
                # _publish_one would observe nothing and find its view the one published.
                continue
            flags = self._publish_one(url, now, state, ejected)
            if flags is not None:
                out.append(flags)
        return out

    def _publish_one(
        self, url: str, now: float, state: BreakerState, ejected: bool
    ) -> EndpointFlags | None:
        """_publish for one endpoint: its flags if they are to be published (and noted
        as published), else None."""
        ramps = self.slow_start
        if ramps is not None:
            self._observe(url, ramps, now, ejected or state != "closed")
        view = self._view(url, now, state, ejected)
        old = self._published.get(url)
        if old is None:
            if view == _HEALTHY:
                return None  # healthy, and last published so: nothing to build or send
            old = EndpointFlags(url)
        new = EndpointFlags(url, *view)
        if new == old:
            return None
        if (
            new.breaker_open == old.breaker_open
            and new.ejected_until == old.ejected_until
            and new.ramp < 1.0
            and abs(new.ramp - old.ramp) < RAMP_STEP
        ):
            return None
        if new.healthy:
            self._published.pop(url, None)
        else:
            self._published[url] = new
        return new

    def _observe(self, url: str, ramps: SlowStart, now: float, sick: bool) -> None:
        """`sick`: ejected, or its breaker not closed."""
        if sick:
            ramps.forget(url)
            self._sick.add(url)
        elif url in self._sick:
            self._sick.discard(url)
            ramps.became_healthy(url, now)

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
