"""One interface over a pool's endpoint-choice policies, so a driver (the sidecar, the
ext_proc picker, the simulator) routes the same way whichever policy is configured:
`round-robin` and `least-request` (EndpointBalancer) or `meshd` (the prefix-aware Picker).

Sans-I/O. The driver's protocol, per request::

    routes = router.order(req, now)                 # primary first, then fallbacks
    for r in routes: router.started(r, rid, req, now); ...connect
        on a connect failure: router.connect_failed(r, rid, now, reason); next route
    router.first_token(r, rid, now)                 # streams only
    router.finished(r, rid, now, ok=..., cached_tokens=usage cached tokens or None)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from filters.balancer import EndpointBalancer
from filters.endpoint_state import EndpointState
from filters.picker import Choice, Picker, PickerConfig, PickRequest
from filters.prefix_index import PrefixIndex

Policy = Literal["round-robin", "least-request", "meshd"]
POLICIES: tuple[Policy, ...] = ("meshd", "least-request", "round-robin")


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """What configuration says about an endpoint."""

    url: str
    weight: float = 1.0
    gpu: str | None = None
    kv_capacity_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Route:
    url: str
    reason: str
    predicted_ttft_s: float | None = None
    cached_tokens: float | None = None
    choice: Choice | None = None


class PoolRouter(Protocol):
    policy: Policy

    def order(self, req: PickRequest, now: float) -> list[Route]: ...
    def started(self, route: Route, rid: Hashable, req: PickRequest, now: float) -> None: ...
    def first_token(self, route: Route, rid: Hashable, now: float) -> None: ...
    def finished(
        self,
        route: Route,
        rid: Hashable,
        req: PickRequest,
        now: float,
        *,
        ok: bool,
        cached_tokens: int | None = None,
    ) -> None: ...
    def connect_failed(self, route: Route, rid: Hashable, now: float, reason: str) -> None: ...
    def snapshot(self, now: float) -> list[dict[str, object]]: ...


class BalancerRouter:
    """Round robin or least outstanding requests, with passive health."""

    def __init__(
        self,
        endpoints: Sequence[EndpointSpec],
        policy: Literal["round-robin", "least-request"],
        *,
        unhealthy_after: int,
        cooldown_s: float,
    ) -> None:
        self.policy: Policy = policy
        self._balancer = EndpointBalancer(
            [(e.url, e.weight) for e in endpoints],
            policy=policy,
            unhealthy_after=unhealthy_after,
            cooldown_s=cooldown_s,
        )

    def order(self, req: PickRequest, now: float) -> list[Route]:
        return [Route(url, self.policy) for url in self._balancer.order(now)]

    def started(self, route: Route, rid: Hashable, req: PickRequest, now: float) -> None:
        self._balancer.on_start(route.url)

    def first_token(self, route: Route, rid: Hashable, now: float) -> None:
        return None

    def finished(
        self,
        route: Route,
        rid: Hashable,
        req: PickRequest,
        now: float,
        *,
        ok: bool,
        cached_tokens: int | None = None,
    ) -> None:
        self._balancer.on_finish(route.url)
        if ok:
            self._balancer.on_success(route.url)

    def connect_failed(self, route: Route, rid: Hashable, now: float, reason: str) -> None:
        self._balancer.on_finish(route.url)
        self._balancer.on_connect_failure(route.url, now, reason)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        return self._balancer.snapshot(now)


class PickerRouter:
    """meshd's prefix-aware, cost-and-latency picker over EndpointStates."""

    policy: Policy = "meshd"

    def __init__(
        self, endpoints: Sequence[EndpointSpec], config: PickerConfig | None = None
    ) -> None:
        self.states = [
            EndpointState(
                e.url,
                url=e.url,
                gpu=e.gpu or "unknown",
                kv_capacity_tokens=e.kv_capacity_tokens,
            )
            for e in endpoints
        ]
        self._by_url = {s.url: s for s in self.states}
        self._last_error: dict[str, str] = {}
        self.picker = Picker(config, index=PrefixIndex())

    def order(self, req: PickRequest, now: float) -> list[Route]:
        choices = self.picker.pick(req, self.states, now)
        routes = [Route(c.url, c.reason, c.predicted_ttft_s, c.cached_tokens, c) for c in choices]
        if not routes:
            # Every endpoint is ejected or draining: try them anyway, least failing first,
            # rather than refusing outright (static stability).
            ranked = sorted(self.states, key=lambda s: (s.consecutive_failures, s.name))
            routes = [Route(s.url, "no-eligible-endpoint") for s in ranked]
        return routes

    def started(self, route: Route, rid: Hashable, req: PickRequest, now: float) -> None:
        if route.choice is not None:
            self.picker.dispatch(route.choice, req, rid, now)
        else:
            self._by_url[route.url].start(rid, now, prompt_tokens=max(1, req.prompt_tokens))

    def first_token(self, route: Route, rid: Hashable, now: float) -> None:
        self._by_url[route.url].first_token(rid, now)

    def finished(
        self,
        route: Route,
        rid: Hashable,
        req: PickRequest,
        now: float,
        *,
        ok: bool,
        cached_tokens: int | None = None,
    ) -> None:
        self._by_url[route.url].finish(rid, now, ok=ok)
        if ok and cached_tokens is not None and route.choice is not None:
            self.picker.observe_cached(route.choice, req, cached_tokens, now)

    def connect_failed(self, route: Route, rid: Hashable, now: float, reason: str) -> None:
        state = self._by_url[route.url]
        state.finish(rid, now, ok=False)
        state.connect_failure(now)
        self._last_error[route.url] = reason

    def snapshot(self, now: float) -> list[dict[str, object]]:
        return [
            {
                "url": s.url,
                "gpu": s.gpu_name(now),
                "healthy": s.ineligible_reason(now) is None,
                "ineligible_reason": s.ineligible_reason(now),
                "outstanding": s.outstanding,
                "tokens_in_flight": s.tokens_in_flight,
                "failures": s.failures,
                "consecutive_failures": s.consecutive_failures,
                "ttft_calibration": round(s.ttft_ratio, 3),
                "cached_blocks": self.picker.index.used_blocks(s.name),
                "last_error": self._last_error.get(s.url),
            }
            for s in self.states
        ]


def make_router(
    policy: Policy,
    endpoints: Sequence[EndpointSpec],
    *,
    unhealthy_after: int = 3,
    cooldown_s: float = 10.0,
    picker: PickerConfig | None = None,
) -> PoolRouter:
    if policy == "meshd":
        return PickerRouter(endpoints, picker)
    return BalancerRouter(endpoints, policy, unhealthy_after=unhealthy_after, cooldown_s=cooldown_s)
