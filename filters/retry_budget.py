"""Retry budget: retries are allowed only while they stay under a ratio of recent requests
plus a small floor, so a failing pool sees at most (1 + ratio) x its traffic, never 3x.
Also which failures may be retried at all, and how long to back off. Sans-I/O: time is in.

Provenance: Finagle's RetryBudget (twitter/finagle:
finagle-core/src/main/scala/com/twitter/finagle/service/RetryBudget.scala,
`RetryBudget(ttl, minRetriesPerSec, percentCanRetry)`, a leaky token bucket whose deposits
expire after `ttl`), tower's retry::budget (tower-rs/tower:
tower/src/retry/budget/tps_budget.rs, `TpsBudget::new(ttl, min_per_sec, retry_percent)`,
defaults 10 s, 10/s, 0.2, a ring of 10 slots per ttl), and Envoy's retry budgets
(envoyproxy/envoy: api/envoy/config/cluster/v3/circuit_breaker.proto, `RetryBudget
{budget_percent, min_retry_concurrency}`, which bounds concurrent retries rather than a
rate). meshd follows Finagle/tower: over any `window_s` the retries withdrawn are at most
``retry_ratio x requests + min_retries_per_s x window_s``.
Withdrawals are recorded as negative amounts in the same ring as deposits, so both expire
together, exactly as in tower's TpsBucket; so are the counts the storm test below compares
(requests, retry asks, failed retries, granted retries): one ring on a fixed grid for all.

The floor is for rare failures: it lets a quiet client retry its odd refusal, which the
ratio of a few requests could not fund. It is not for a pool where most requests fail:
there a rate floor (or Envoy's concurrency floor, since a refused attempt is over in
milliseconds) funds every retry of every request at any rate under the floor's, so a 503
storm at 2 req/s went upstream 3.0x (issue #21). So the floor stops counting while the
window's retry asks are a storm: more than a lone request can make (it still gets all its
attempts), and either as many as the window's requests, or more than STORM_SHARE of the
window's granted retries failed too (their requests asked again: another endpoint refused
as well, so the pool, not one endpoint, is failing). Then only the ratio funds retries,
and attempts stay within (1 + retry_ratio) x requests once the window has turned over.
One endpoint of three refusing, even one the picker favours (a fast refusal looks idle),
asks for fewer than all requests and its retries succeed elsewhere: the floor keeps
funding them. Measured on every request failing
(tests/test_retry_budget.py, 300 s at the defaults): attempts / requests 3.0 -> 1.2 at
0.5-5 req/s, 1.7 -> 1.2 at 20 req/s; below max_attempts requests a window (0.3 req/s) a
storm still gets the floor, at under one attempt a second.

Backoff is "full jitter" (Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog,
2015): sleep = uniform(0, min(max, base x 2^(attempt-1))), and never less than a
`Retry-After` the upstream sent (RFC 9110 section 10.2.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Protocol

__all__ = [
    "RETRYABLE_STATUSES",
    "RandomSource",
    "RetryBudget",
    "RetryBudgetConfig",
    "WindowedSum",
    "parse_retry_after",
]

# Statuses that say "this endpoint did not do the work, try elsewhere": bad gateway,
# unavailable, gateway timeout, too many requests. 500 is excluded on purpose: an engine
# that crashed on this prompt will likely crash on the next endpoint too.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


class RandomSource(Protocol):
    """What backoff needs from an RNG (random.Random fits); injected so tests are exact."""

    def random(self) -> float: ...


class WindowedSum:
    """Sums of integer amounts added over the last `window_s` seconds, kept in `slots`
    buckets (tower's TpsBucket, Finagle's WindowedAdder); `counts` sums side by side, each
    bucket holding an amount for each. An amount leaves its sum between
    window_s x (1 - 1/slots) and window_s after it was added. O(1) amortised per call
    (at most `slots` buckets are cleared however long the gap), memory O(slots x counts).

    The buckets lie on a fixed grid: bucket number now // (window_s / slots), whatever the
    calls, and the sums of one ring leave it together. Sums that are compared (requests
    and their failures, say) belong in one ring: two rings that began at their first use
    (the budget's and the breaker's did) let an amount leave one sum up to a slot before
    its fellow left the other. A clock that goes back counts in the current bucket.

    Integers, not floats, so a long run of +d/-w never drifts away from zero.
    """

    __slots__ = ("_bucket", "_buckets", "_current", "_slot_s", "_sums")

    def __init__(self, window_s: float, slots: int = 10, counts: int = 1) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if counts < 1:
            raise ValueError(f"counts must be >= 1, got {counts}")
        self._slot_s = window_s / slots
        self._buckets = [[0] * counts for _ in range(slots)]
        self._bucket = -math.inf  # the current bucket's number (now // slot)
        self._current = self._buckets[0]  # and its amounts
        self._sums = [0] * counts

    def _advance(self, bucket: float) -> None:
        """Make `bucket` (> the current one) current: the buckets between leave the sums."""
        buckets, sums = self._buckets, self._sums
        n, counts = len(buckets), len(sums)
        if bucket - self._bucket >= n:
            for j in range(n):
                buckets[j] = [0] * counts
            sums[:] = [0] * counts
        else:
            for i in range(int(self._bucket) + 1, int(bucket) + 1):
                j = i % n
                for k, amount in enumerate(buckets[j]):
                    sums[k] -= amount
                buckets[j] = [0] * counts
        self._bucket = bucket
        self._current = buckets[int(bucket) % n]

    # add and total ask _advance only when `now` is past the current bucket: most calls
    # fall in it, and a call costs ~5 us with cold caches (several a request, on the way to
    # the upstream send: the retry budget's deposit, the breaker's outcome).
    def add(self, now: float, amount: int, count: int = 0) -> None:
        bucket = now // self._slot_s
        if bucket > self._bucket:
            self._advance(bucket)
        self._current[count] += amount
        self._sums[count] += amount

    def total(self, now: float, count: int = 0) -> int:
        bucket = now // self._slot_s
        if bucket > self._bucket:
            self._advance(bucket)
        return self._sums[count]

    def totals(self, now: float) -> tuple[int, ...]:
        """Every sum, read at one time."""
        bucket = now // self._slot_s
        if bucket > self._bucket:
            self._advance(bucket)
        return tuple(self._sums)


@dataclass(frozen=True, slots=True)
class RetryBudgetConfig:
    """Defaults are tower's TpsBudget::default() and Finagle's RetryBudget() (10 s, 10/s,
    20%) plus meshd's per-request cap and backoff."""

    window_s: float = 10.0  # how long a request's deposit (and a retry's withdrawal) counts
    retry_ratio: float = 0.2  # retries allowed per recent request
    min_retries_per_s: float = 10.0  # floor for quiet clients: min_retries_per_s x window_s
    slots: int = 10  # ring buckets per window (tower uses 10)
    max_attempts: int = 3  # per request, the first try included
    backoff_base_s: float = 0.025  # ceiling of the first retry's jittered sleep
    backoff_max_s: float = 1.0  # largest ceiling, however many attempts
    # A Retry-After longer than this is not waited for: the response goes to the client.
    retry_after_max_s: float = 10.0
    retryable_statuses: frozenset[int] = RETRYABLE_STATUSES

    def __post_init__(self) -> None:
        if not 0 <= self.retry_ratio <= 1000:
            raise ValueError(f"retry_ratio must be in [0, 1000], got {self.retry_ratio}")
        if self.min_retries_per_s < 0:
            raise ValueError(f"min_retries_per_s must be >= 0, got {self.min_retries_per_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.backoff_base_s <= self.backoff_max_s:
            raise ValueError("need 0 <= backoff_base_s <= backoff_max_s")


# The share of the window's requests that asked for a retry past which the failures are a
# storm, not rare: the floor stops counting (module docstring).
STORM_SHARE = 0.5

# The budget's sums, side by side in one ring (WindowedSum counts): the balance in
# thousandths of a retry (deposits less withdrawals), then what the storm test compares.
_BALANCE, _REQUESTS, _ASKS, _FAILED_RETRIES, _GRANTED = range(5)

# Amounts in thousandths of a retry: a ratio like 0.3 is exact, where tower's
# withdraw = int(1 / 0.3) = 3 would allow 33%.
_SCALE = 1000


class RetryBudget:
    """One budget per pool (or per client): `deposit` for every request's first attempt,
    `withdraw` before every retry (and every mid-stream failover). Not thread-safe: one
    event loop owns it.

    Counters (monotonic, for metrics): `requests` (deposits), `attempts` (first tries and
    granted retries), `retries` (granted), `exhausted` (refused: budget empty), `capped`
    (refused: the request reached max_attempts). `ratio` is retries / requests.
    """

    __slots__ = (
        "_deposit",
        "_reserve",
        "_window",
        "_withdraw",
        "attempts",
        "capped",
        "config",
        "exhausted",
        "requests",
        "retries",
    )

    def __init__(self, config: RetryBudgetConfig | None = None) -> None:
        cfg = config or RetryBudgetConfig()
        self.config = cfg
        # The balance and, for the storm test, the requests, the retry asks (granted or
        # not), the failed retries and the granted ones: one ring, so all leave together
        # (they were five rings, each begun at its first use, and an ask could outlive its
        # request by up to a slot: 3 asks of 1 request read where the window held 0 of 1).
        self._window = WindowedSum(cfg.window_s, cfg.slots, counts=5)
        self._deposit = round(cfg.retry_ratio * _SCALE)
        self._withdraw = _SCALE
        self._reserve = round(cfg.min_retries_per_s * cfg.window_s * _SCALE)
        self.requests = 0
        self.attempts = 0
        self.retries = 0
        self.exhausted = 0
        self.capped = 0

    @property
    def ratio(self) -> float:
        return self.retries / self.requests if self.requests else 0.0

    def deposit(self, now: float) -> None:
        """A new request (its first attempt) was sent."""
        self.requests += 1
        self.attempts += 1
        window = self._window
        window.add(now, 1, _REQUESTS)
        if self._deposit:
            window.add(now, self._deposit, _BALANCE)

    def _floor(self, sums: tuple[int, ...]) -> int:
        """The floor's reserve, or 0 while the window's retry asks are a storm (module
        docstring): at least as many as one request alone can make, and either as many as
        the window's requests, or more than STORM_SHARE of its granted retries failed.
        `sums`: the window's, read at one time."""
        asks = sums[_ASKS]
        if asks < self.config.max_attempts:
            return self._reserve
        if asks >= sums[_REQUESTS]:
            return 0
        if sums[_FAILED_RETRIES] > STORM_SHARE * sums[_GRANTED]:
            return 0
        return self._reserve

    def balance(self, now: float) -> float:
        """Retries that could be withdrawn now."""
        sums = self._window.totals(now)
        return (sums[_BALANCE] + self._floor(sums)) / _SCALE

    def withdraw(self, now: float, attempts_made: int = 1) -> bool:
        """May this request, which has made `attempts_made` attempts, try once more?
        True spends one retry from the budget; False means give up (and counts why)."""
        if attempts_made >= self.config.max_attempts:
            self.capped += 1
            return False
        window = self._window
        window.add(now, 1, _ASKS)  # this ask is judged with the window's, itself included
        if attempts_made > 1:
            window.add(now, 1, _FAILED_RETRIES)  # it asks again: its last retry failed
        sums = window.totals(now)
        if sums[_BALANCE] + self._floor(sums) < self._withdraw:
            self.exhausted += 1
            return False
        window.add(now, -self._withdraw, _BALANCE)
        window.add(now, 1, _GRANTED)
        self.retries += 1
        self.attempts += 1
        return True

    def retryable(self, status: int | None, connect_failed: bool, first_byte_sent: bool) -> bool:
        """Is this failure safe to retry on another endpoint?

        Only before the first response byte reached the client (after it, mid-stream
        failover in filters/failover.py is the only way on), and only for a connect
        failure (nothing reached an engine) or a status in `retryable_statuses`.
        """
        if first_byte_sent:
            return False
        if connect_failed:
            return True
        return status is not None and status in self.config.retryable_statuses

    def backoff(self, attempt: int, rng: RandomSource, retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number `attempt` (1 = the first retry): full
        jitter under min(backoff_max_s, backoff_base_s x 2^(attempt-1)), but at least
        `retry_after_s`. Returns math.inf when Retry-After exceeds retry_after_max_s:
        do not retry; pass the upstream's answer (and its Retry-After) on."""
        cfg = self.config
        ceiling = min(cfg.backoff_max_s, cfg.backoff_base_s * 2.0 ** max(0, attempt - 1))
        sleep = rng.random() * ceiling
        if retry_after_s is not None and retry_after_s > 0:
            if retry_after_s > cfg.retry_after_max_s:
                return math.inf
            sleep = max(sleep, retry_after_s)
        return sleep


def parse_retry_after(value: str, wall_now: float | None = None) -> float | None:
    """A Retry-After header value in seconds from now (RFC 9110 section 10.2.3):
    delay-seconds, or an HTTP-date when `wall_now` (Unix seconds) is given. None when
    the value is malformed; never negative."""
    v = value.strip()
    if v.isdigit():
        return float(int(v))
    if wall_now is None or not v:
        return None
    try:
        when = parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - wall_now)
