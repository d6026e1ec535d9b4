"""Outlier ejection, as Envoy does it: an endpoint that returns consecutive 5xx, or whose
success rate falls far below its pool's, leaves the pool for a while, longer each time it
offends again. Sans-I/O: time comes in; the driver applies the events it returns.

Semantics and defaults from Envoy (envoyproxy/envoy: api/envoy/config/cluster/v3/
outlier_detection.proto; docs/root/intro/arch_overview/upstream/outlier.rst;
source/common/upstream/outlier_detection_impl.cc, DetectorImpl::ejectHost,
checkHostForUneject, processSuccessRateEjections, onIntervalTimer):

- consecutive_5xx (5): that many 5xx or local-origin failures in a row eject at once.
- interval (10 s): the success-rate sweep period; each sweep also decrements the ejection
  multiplier of every endpoint that has stayed in service for a whole interval.
- success rate: over the last completed interval, endpoints with at least
  success_rate_request_volume (100) requests are candidates; with at least
  success_rate_minimum_hosts (5) candidates, an endpoint is ejected when its rate is below
  mean - (success_rate_stdev_factor / 1000) x stdev (population stdev; factor 1900).
- ejection time = base_ejection_time (30 s) x the multiplier, which grows by one per
  ejection while base x multiplier < max + base, capped at max_ejection_time (300 s).
- max_ejection_percent (10): an ejection happens only if 100 x (ejected + 1) / hosts <=
  max_ejection_percent. The proto used to say Envoy "will eject at least one host
  regardless"; since Envoy 1.31 that needs `always_eject_one_host` (default false), so with
  Envoy's defaults a pool of fewer than 10 endpoints ejects nothing. meshd's pools are
  small (8 engines), so meshd defaults always_eject_one_host to True: one endpoint may be
  out whatever the percentage, more only within it.

Departures: unejection happens exactly at `until` (Envoy checks only at interval ticks, so
its ejections last up to one interval longer); no enforcement percentages or jitter (Envoy's
defaults for the two detectors kept here are enforce 100%, jitter 0); the gateway-failure
and failure-percentage detectors (off by default in Envoy) are not implemented.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["OutlierConfig", "OutlierDetector", "OutlierEvent"]


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    consecutive_5xx: int = 5
    interval_s: float = 10.0
    base_ejection_time_s: float = 30.0
    max_ejection_time_s: float = 300.0
    max_ejection_percent: float = 10.0
    always_eject_one_host: bool = True  # meshd's default; Envoy's is False
    success_rate_minimum_hosts: int = 5
    success_rate_request_volume: int = 100
    success_rate_stdev_factor: int = 1900  # thousandths: 1900 means 1.9
    success_rate_enabled: bool = True
    max_hosts: int = 4096  # endpoints tracked per pool

    def __post_init__(self) -> None:
        if self.consecutive_5xx < 1:
            raise ValueError("consecutive_5xx must be >= 1")
        if not self.interval_s > 0 or not self.base_ejection_time_s > 0:
            raise ValueError("interval_s and base_ejection_time_s must be > 0")
        if self.max_ejection_time_s < self.base_ejection_time_s:
            # Envoy refuses this configuration too.
            raise ValueError("max_ejection_time_s cannot be smaller than base_ejection_time_s")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ValueError("max_ejection_percent must be in [0, 100]")


EventAction = Literal["eject", "uneject"]


@dataclass(frozen=True, slots=True)
class OutlierEvent:
    endpoint: str
    action: EventAction
    at: float
    reason: str  # "consecutive_5xx", "success_rate" or "ejection_expired"
    until: float | None = None  # for ejections: when the endpoint returns
    ejections: int = 0  # how many times this endpoint has been ejected so far


@dataclass(slots=True)
class _Host:
    consecutive_5xx: int = 0
    ejected_until: float | None = None
    backoff: int = 0  # Envoy's ejectTimeBackoff multiplier
    ejections: int = 0
    last_unejected_at: float | None = None
    current_total: int = 0  # this interval
    current_ok: int = 0
    last_total: int = 0  # the last completed interval
    last_ok: int = 0
    success_rate: float | None = None  # percent, at the last sweep that measured it


class OutlierDetector:
    """One per pool. The driver calls `record` for every finished attempt and `tick`
    often (after each record, or from a periodic timer) and applies what `tick` returns:
    on "eject" set the EndpointState's ejected_until, on "uneject" start its slow start.

    `record` and `ejected` are O(log n); `tick` is O(1) unless an interval ended (then one
    O(n) sweep, once per interval_s). Counters: `ejections_total`,
    `ejections_consecutive_5xx`, `ejections_success_rate`, `ejections_overflow` (an
    outlier left in service because of max_ejection_percent).
    """

    __slots__ = (
        "_events",
        "_expiry",
        "_hosts",
        "_n_ejected",
        "_next_sweep",
        "config",
        "ejections_consecutive_5xx",
        "ejections_overflow",
        "ejections_success_rate",
        "ejections_total",
    )

    def __init__(self, config: OutlierConfig | None = None) -> None:
        self.config = config or OutlierConfig()
        self._hosts: dict[str, _Host] = {}
        self._expiry: list[tuple[float, str]] = []
        self._n_ejected = 0
        self._next_sweep: float | None = None
        self._events: list[OutlierEvent] = []
        self.ejections_total = 0
        self.ejections_consecutive_5xx = 0
        self.ejections_success_rate = 0
        self.ejections_overflow = 0

    # -- membership -----------------------------------------------------------------------

    def add(self, endpoint: str) -> None:
        if endpoint in self._hosts:
            return
        if len(self._hosts) >= self.config.max_hosts:
            raise ValueError(f"more than max_hosts ({self.config.max_hosts}) endpoints")
        self._hosts[endpoint] = _Host()

    def remove(self, endpoint: str) -> None:
        h = self._hosts.pop(endpoint, None)
        if h is not None and h.ejected_until is not None:
            self._n_ejected -= 1  # its expiry entry goes stale and is skipped

    @property
    def endpoints(self) -> int:
        return len(self._hosts)

    # -- observations ---------------------------------------------------------------------

    def record(
        self, endpoint: str, now: float, *, status: int | None = None, local_failure: bool = False
    ) -> bool:
        """One attempt finished: with an HTTP `status`, or `local_failure` (connect error,
        reset, timeout: Envoy maps those to 5xx too). Returns True when this record
        ejected the endpoint (the event also comes out of the next `tick`)."""
        heap = self._expiry
        if heap and heap[0][0] <= now:  # (_expire's own test: no call while none ends)
            self._expire(now)
        if self._next_sweep is None:
            self._next_sweep = now + self.config.interval_s
        h = self._hosts.get(endpoint)
        if h is None:
            self.add(endpoint)
            h = self._hosts[endpoint]
        failed = local_failure or (status is not None and status >= 500)
        h.current_total += 1
        if not failed:
            h.current_ok += 1
            h.consecutive_5xx = 0
            return False
        h.consecutive_5xx += 1
        if h.consecutive_5xx < self.config.consecutive_5xx or h.ejected_until is not None:
            return False
        # Envoy resets the counter once the threshold fires, ejected or not.
        h.consecutive_5xx = 0
        return self._eject(endpoint, h, now, "consecutive_5xx")

    def tick(self, now: float) -> list[OutlierEvent]:
        """Expire ejections, run the interval sweep when due; return every event since the
        last call, oldest first."""
        self._expire(now)
        nxt = self._next_sweep
        if nxt is None:
            self._next_sweep = now + self.config.interval_s
        elif now >= nxt:
            intervals = 1 + int((now - nxt) // self.config.interval_s)
            self._sweep(now, intervals)
            self._next_sweep = nxt + intervals * self.config.interval_s
        events, self._events = self._events, []
        return events

    def uneject(self, endpoint: str, now: float, reason: str) -> bool:
        """End an ejection early (its engine restarted: what failed is gone); its ejection
        count stays, so that one ejected again is out longer. Whether it was ejected."""
        self._expire(now)
        h = self._hosts.get(endpoint)
        if h is None or h.ejected_until is None:
            return False
        h.ejected_until = None  # its heap entry no longer matches: _expire skips it
        h.last_unejected_at = now
        h.consecutive_5xx = 0
        self._n_ejected -= 1
        self._events.append(OutlierEvent(endpoint, "uneject", now, reason, None, h.ejections))
        return True

    # -- queries --------------------------------------------------------------------------

    def ejected(self, endpoint: str, now: float) -> bool:
        if not self._n_ejected:
            return False  # (the guard asks per route per request: the common case first)
        self._expire(now)
        h = self._hosts.get(endpoint)
        return h is not None and h.ejected_until is not None

    def ejected_until(self, endpoint: str) -> float | None:
        h = self._hosts.get(endpoint)
        return None if h is None else h.ejected_until

    def ejected_count(self, now: float) -> int:
        self._expire(now)
        return self._n_ejected

    def snapshot(self, now: float) -> list[dict[str, object]]:
        self._expire(now)
        return [
            {
                "endpoint": name,
                "ejected_until": h.ejected_until,
                "ejections": h.ejections,
                "ejection_multiplier": h.backoff,
                "consecutive_5xx": h.consecutive_5xx,
                "success_rate": h.success_rate,
            }
            for name, h in self._hosts.items()
        ]

    # -- internals ------------------------------------------------------------------------

    def _eject(self, endpoint: str, h: _Host, now: float, reason: str) -> bool:
        cfg = self.config
        n = len(self._hosts)
        within = 100.0 * (self._n_ejected + 1) / n <= cfg.max_ejection_percent
        if not within and not (cfg.always_eject_one_host and self._n_ejected == 0):
            self.ejections_overflow += 1
            return False
        base, cap = cfg.base_ejection_time_s, cfg.max_ejection_time_s
        if h.backoff * base < cap + base:
            h.backoff += 1
        until = now + min(base * h.backoff, cap)
        h.ejected_until = until
        h.ejections += 1
        self._n_ejected += 1
        heapq.heappush(self._expiry, (until, endpoint))
        self.ejections_total += 1
        if reason == "consecutive_5xx":
            self.ejections_consecutive_5xx += 1
        else:
            self.ejections_success_rate += 1
        self._events.append(OutlierEvent(endpoint, "eject", now, reason, until, h.ejections))
        return True

    def _expire(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            until, endpoint = heapq.heappop(heap)
            h = self._hosts.get(endpoint)
            if h is None or h.ejected_until != until:
                continue  # removed (or removed and re-added) since
            h.ejected_until = None
            h.last_unejected_at = until
            # As Envoy: a fresh start, so a few errors do not re-eject at once.
            h.consecutive_5xx = 0
            self._n_ejected -= 1
            self._events.append(
                OutlierEvent(endpoint, "uneject", until, "ejection_expired", None, h.ejections)
            )

    def _sweep(self, now: float, intervals: int) -> None:
        cfg = self.config
        for h in self._hosts.values():
            # When the driver was silent for several intervals, what it recorded since the
            # last sweep is still the best picture of "the last interval".
            h.last_total, h.last_ok = h.current_total, h.current_ok
            h.current_total = h.current_ok = 0
            h.success_rate = None
        if cfg.success_rate_enabled and len(self._hosts) >= cfg.success_rate_minimum_hosts:
            self._success_rate_ejections(now)
        for h in self._hosts.values():
            if (
                h.ejected_until is None
                and h.backoff
                and h.last_unejected_at is not None
                and now - h.last_unejected_at >= cfg.interval_s
            ):
                h.backoff = max(0, h.backoff - intervals)

    def _success_rate_ejections(self, now: float) -> None:
        cfg = self.config
        rates: list[tuple[str, _Host, float]] = []
        for name, h in self._hosts.items():
            if h.ejected_until is not None or h.last_total == 0:
                continue
            rate = 100.0 * h.last_ok / h.last_total
            if h.last_total >= cfg.success_rate_request_volume:
                h.success_rate = rate
                rates.append((name, h, rate))
        if not rates or len(rates) < cfg.success_rate_minimum_hosts:
            return
        mean = sum(r for _, _, r in rates) / len(rates)
        stdev = math.sqrt(sum((r - mean) ** 2 for _, _, r in rates) / len(rates))
        threshold = mean - cfg.success_rate_stdev_factor / 1000.0 * stdev
        for name, h, rate in rates:
            if rate < threshold and h.ejected_until is None:
                self._eject(name, h, now, "success_rate")
