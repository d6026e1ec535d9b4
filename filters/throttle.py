"""Adaptive client-side throttling: when a pool keeps rejecting (429/503 overload), reject a
share of requests locally before they cost the pool anything, and back off as it recovers.
Sans-I/O: time and randomness come in.

Google SRE book, "Handling Overload", section "Client-Side Throttling" (Beyer et al., Site
Reliability Engineering, O'Reilly 2016, chapter 21): each client keeps, over the last two
minutes, `requests` (attempted by the application, including those this throttle rejected
locally) and `accepts` (accepted by the backend), and rejects locally with probability

    p_reject = max(0, (requests - K x accepts) / (requests + 1))

K = 2 by default: the backend sees up to twice the traffic it accepts, which keeps it
informed (it may recover) while capping the waste. The window is a ring of buckets
(filters/retry_budget.py WindowedSum), so memory is O(slots) and each call O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

from filters.retry_budget import RandomSource, WindowedSum

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

    Counters: `requests`, `accepts`, `throttled` (rejected locally).
    """

    __slots__ = ("_accepts", "_requests", "accepts", "config", "requests", "throttled")

    def __init__(self, config: AdaptiveThrottleConfig | None = None) -> None:
        cfg = config or AdaptiveThrottleConfig()
        self.config = cfg
        self._requests = WindowedSum(cfg.window_s, cfg.slots)
        self._accepts = WindowedSum(cfg.window_s, cfg.slots)
        self.requests = 0
        self.accepts = 0
        self.throttled = 0

    def p_reject(self, now: float) -> float:
        requests = self._requests.total(now)
        if requests < self.config.min_requests:
            return 0.0
        accepts = self._accepts.total(now)
        return max(0.0, (requests - self.config.k * accepts) / (requests + 1))

    def allow(self, now: float, rng: RandomSource) -> bool:
        """Decide: True send it (counted when the pool's verdict comes), False reject it here
        (answer 429/503 without contacting the pool; counted now). A fresh throttle always
        allows."""
        p = self.p_reject(now)
        if p > 0 and rng.random() < p:
            self._requests.add(now, 1)
            self.requests += 1
            self.throttled += 1
            return False
        return True

    def accepted(self, now: float) -> None:
        """The pool took a request."""
        self._requests.add(now, 1)
        self.requests += 1
        self._accepts.add(now, 1)
        self.accepts += 1

    def refused(self, now: float) -> None:
        """The pool turned a request away (an overload status, or no connection)."""
        self._requests.add(now, 1)
        self.requests += 1
