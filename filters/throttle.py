"""Adaptive client-side throttling: when a pool keeps rejecting (429/503 overload), reject a
share of requests locally before they cost the pool anything, and back off as it recovers.
Sans-I/O: time and randomness come in.

Google SRE book, "Handling Overload", section "Client-Side Throttling" (Beyer et al., Site
Reliability Engineering, O'Reilly 2016, chapter 21): each client keeps, over the last two
minutes, `requests` (attempted by the application, including those this throttle rejected
locally) and `accepts` (accepted by the backend), and rejects locally with probability

    p_reject = max(0, (requests - K x accepts) / (requests + 1))

K = 2 by default: the backend sees up to twice the traffic it accepts, which keeps it
informed (it may recover) while capping the waste. The window is one ring of buckets for
both counts, so memory is O(slots) and each call O(1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from filters.retry_budget import RandomSource

__all__ = ["AdaptiveThrottle", "AdaptiveThrottleConfig"]


@dataclass(frozen=True, slots=True)
class AdaptiveThrottleConfig:
    k: float = 2.0  # the SRE book's multiplier; lower is more aggressive
    window_s: float = 120.0  # "the last two minutes"
    slots: int = 24  # 5 s buckets
    # Departure from the book: no local rejection until the window holds this many
    # requests, so one refusal at start-up (1 request, 0 accepts: p = 0.5) is not a verdict.
    min_requests: int = 20

    def __post_init__(self) -> None:
        if not self.k > 0:
            raise ValueError(f"k must be > 0, got {self.k}")


class AdaptiveThrottle:
    """One per pool (or per endpoint): `allow` before each request, then the pool's verdict
    on each try: `accepted` when the backend took it (any answer that is not an overload
    rejection: a 200, a 400, even a 500 means it was accepted for processing), `refused`
    when it did not (429/503, no connection).

    Departure from the book, for requests that last seconds: a request counts when its
    verdict comes, not when it is sent. Counted when sent, every request in flight reads as
    a refusal until it ends: a burst of long requests at a fresh pool (40 in flight, none
    answered yet) would be throttled at p = 40/41. A request the throttle rejects counts at
    once (its verdict is that rejection), as the book says.

    The window: `slots` buckets of window_s / slots seconds on a fixed grid (bucket number
    now // slot: where a bucket starts depends on no call), each holding the accepts and
    the refusals (the pool's and this throttle's own) counted in it, so both leave the
    window together, between window_s x (1 - 1/slots) and window_s after they came; the
    window's requests are its accepts plus its refusals. (The two counts were two rings
    that began at their first use, so a request's accept could leave up to a slot before
    the request itself: 100 accepts of 2 minutes ago read as p = 100/101.) A clock that
    goes back counts in the current bucket.

    `calm_from`: from that time on no refusal is left in the window, and with k >= 1 a
    window of accepts alone never rejects (requests = accepts <= k x accepts), so `allow`
    says yes without looking at the window (one compare: it is asked before every
    request; a driver may make the compare itself and call `allow` only before it). It
    moves to a slot past the end of the newest refusal's bucket at each refusal; +inf
    while k < 1 (accepts alone give p > 0).

    Counters: `requests`, `accepts`, `throttled` (rejected locally).
    """

    __slots__ = (
        "_accepts_in",
        "_bucket",
        "_index",
        "_refusals_in",
        "_slot_s",
        "_window_accepts",
        "_window_refusals",
        "accepts",
        "calm_from",
        "config",
        "requests",
        "throttled",
    )

    def __init__(self, config: AdaptiveThrottleConfig | None = None) -> None:
        cfg = config or AdaptiveThrottleConfig()
        if not cfg.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {cfg.window_s}")
        if cfg.slots < 1:
            raise ValueError(f"slots must be >= 1, got {cfg.slots}")
        self.config = cfg
        self._slot_s = cfg.window_s / cfg.slots
        self._accepts_in = [0] * cfg.slots
        self._refusals_in = [0] * cfg.slots
        self._bucket = -math.inf  # the current bucket's number (now // slot)
        self._index = 0  # and its place in the ring
        self._window_accepts = 0
        self._window_refusals = 0
        self.calm_from = -math.inf if cfg.k >= 1 else math.inf
        self.requests = 0
        self.accepts = 0
        self.throttled = 0

    def _advance(self, bucket: float) -> None:
        """Make `bucket` (> the current one) current: the buckets between leave the window."""
        accepts, refusals = self._accepts_in, self._refusals_in
        n = len(accepts)
        if bucket - self._bucket >= n:
            accepts[:] = refusals[:] = [0] * n
            self._window_accepts = self._window_refusals = 0
        else:
            for i in range(int(self._bucket) + 1, int(bucket) + 1):
                j = i % n
                self._window_accepts -= accepts[j]
                self._window_refusals -= refusals[j]
                accepts[j] = refusals[j] = 0
        self._bucket = bucket
        self._index = int(bucket) % n

    def p_reject(self, now: float) -> float:
        bucket = now // self._slot_s
        if bucket > self._bucket:
            self._advance(bucket)
        accepts = self._window_accepts
        requests = accepts + self._window_refusals
        if requests < self.config.min_requests:
            return 0.0
        return max(0.0, (requests - self.config.k * accepts) / (requests + 1))

    def allow(self, now: float, rng: RandomSource) -> bool:
        """Decide: True send it (counted when the pool's verdict comes), False reject it here
        (answer 429/503 without contacting the pool; counted now). A fresh throttle always
        allows."""
        if now >= self.calm_from:
            return True
        p = self.p_reject(now)
        if p > 0 and rng.random() < p:
            self.refused(now)
            self.throttled += 1
            return False
        return True

    def accepted(self, now: float) -> None:
        """The pool took a request."""
        bucket = now // self._slot_s
        if bucket > self._bucket:
            self._advance(bucket)
        self._accepts_in[self._index] += 1
        self._window_accepts += 1
        self.requests += 1
        self.accepts += 1

    def refused(self, now: float) -> None:
        """The pool turned a request away (an overload status, or no connection)."""
        bucket = now // self._slot_s
        if bucket > self._bucket:
            self._advance(bucket)
        self._refusals_in[self._index] += 1
        self._window_refusals += 1
        self.requests += 1
        if self.calm_from != math.inf:
            # The current bucket leaves the window once now // slot reaches its number +
            # slots; a slot more spares the compare the float division's rounding.
            self.calm_from = (self._bucket + len(self._refusals_in) + 1) * self._slot_s
