"""Slow start: a weight ramp for endpoints that are new, restarted or newly healthy, so that
traffic shed from a hot pool does not flatten one that must first rewarm its KV cache.
Sans-I/O: time comes in.

Envoy's slow start mode (envoyproxy/envoy: docs/root/intro/arch_overview/upstream/
load_balancing/slow_start.rst; api/envoy/config/cluster/v3/cluster.proto SlowStartConfig;
EdfLoadBalancerBase::applySlowStartFactor in source/extensions/load_balancing_policies/common/
load_balancer_impl.cc, formerly source/common/upstream/load_balancer_impl.cc)::

    time_factor = max(time_since_healthy, 1 ms) / slow_start_window
    weight      = max(min_weight_percent / 100, time_factor ^ (1 / aggression))

inside the window, 1 outside it. Envoy's defaults: aggression 1.0 (a linear ramp),
min_weight_percent 10; the window has no default there (meshd: 60 s, about what an 8B model
needs to refill a prefix cache at moderate load). As in Envoy the clock starts when the
endpoint last became healthy (Envoy: `last_hc_pass_time`), not when it was created.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["SlowStart", "SlowStartConfig"]

# Envoy computes the time factor in whole milliseconds with a floor of 1 ms.
_MIN_ELAPSED_S = 0.001


@dataclass(frozen=True, slots=True)
class SlowStartConfig:
    window_s: float = 60.0
    aggression: float = 1.0  # > 1 ramps up faster early, < 1 slower
    min_weight_percent: float = 10.0
    max_endpoints: int = 4096  # endpoints ramping at once; the oldest ramp is dropped

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if not self.aggression > 0:
            raise ValueError(f"aggression must be > 0, got {self.aggression}")
        if not 0 <= self.min_weight_percent <= 100:
            raise ValueError("min_weight_percent must be in [0, 100]")


class SlowStart:
    """Only ramping endpoints are stored; `weight` of any other endpoint is 1.0.

    The driver calls `became_healthy` when an endpoint joins, its engine restarts (a new
    report epoch: its cache is empty), it is unejected or its breaker closes; `weight`
    multiplies the endpoint's capacity weight in the balancer or the picker's load bound.
    """

    __slots__ = ("_since", "config")

    def __init__(self, config: SlowStartConfig | None = None) -> None:
        self.config = config or SlowStartConfig()
        self._since: OrderedDict[str, float] = OrderedDict()

    def became_healthy(self, endpoint: str, now: float) -> None:
        self._since.pop(endpoint, None)
        self._since[endpoint] = now
        while len(self._since) > self.config.max_endpoints:
            self._since.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """The endpoint left the pool or went unhealthy (its ramp restarts later)."""
        self._since.pop(endpoint, None)

    def in_slow_start(self, endpoint: str, now: float) -> bool:
        since = self._since.get(endpoint)
        return since is not None and now - since < self.config.window_s

    def weight(self, endpoint: str, now: float) -> float:
        """The factor in [min_weight_percent / 100, 1] to multiply the endpoint's weight by."""
        since = self._since.get(endpoint)
        if since is None:
            return 1.0
        cfg = self.config
        elapsed = now - since
        if elapsed >= cfg.window_s:
            del self._since[endpoint]  # ramp over: forget, so memory holds only ramps
            return 1.0
        time_factor = max(elapsed, _MIN_ELAPSED_S) / cfg.window_s
        if cfg.aggression != 1.0:
            time_factor = time_factor ** (1.0 / cfg.aggression)
        return max(cfg.min_weight_percent / 100.0, time_factor)
