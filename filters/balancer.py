"""Endpoint choice within a pool before prefix-aware picking: least outstanding
requests (weighted) or round robin, with passive health from connect failures.

Sans-I/O: the driver reports what happened and passes `now` in. `order()`
returns every endpoint, best first, so the retry path has its fallbacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Policy = Literal["least-request", "round-robin"]


@dataclass(slots=True)
class EndpointLoad:
    url: str
    weight: float = 1.0
    outstanding: int = 0
    requests: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    resting_until: float = 0.0
    last_error: str | None = None

    def healthy(self, now: float) -> bool:
        return now >= self.resting_until


class EndpointBalancer:
    """Orders a pool's endpoints for one request.

    An endpoint that fails to accept `unhealthy_after` connections in a row rests
    for `cooldown_s` (doubling, up to 16x, while it keeps failing); resting
    endpoints go to the back of the order rather than out of it, so a pool whose
    every endpoint is resting still gets tried instead of failing outright.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, float]],
        *,
        policy: Policy = "least-request",
        unhealthy_after: int = 3,
        cooldown_s: float = 10.0,
    ) -> None:
        if not endpoints:
            raise ValueError("a pool needs at least one endpoint")
        self._loads = {url: EndpointLoad(url, weight) for url, weight in endpoints}
        self._urls = [url for url, _ in endpoints]
        self._policy = policy
        self._unhealthy_after = unhealthy_after
        self._cooldown_s = cooldown_s
        self._cursor = 0

    @property
    def endpoints(self) -> Sequence[str]:
        return self._urls

    def load(self, url: str) -> EndpointLoad:
        return self._loads[url]

    def order(self, now: float) -> list[str]:
        n = len(self._urls)
        start = self._cursor
        self._cursor = (self._cursor + 1) % n
        rotated = [self._urls[(start + i) % n] for i in range(n)]
        if self._policy == "round-robin":

            def key(url: str) -> tuple[bool, float]:
                return (not self._loads[url].healthy(now), 0.0)
        else:

            def key(url: str) -> tuple[bool, float]:
                load = self._loads[url]
                return (not load.healthy(now), load.outstanding / load.weight)

        # sorted() is stable, so equal keys keep the rotation: ties go round robin.
        return sorted(rotated, key=key)

    def on_start(self, url: str) -> None:
        load = self._loads[url]
        load.outstanding += 1
        load.requests += 1

    def on_finish(self, url: str) -> None:
        self._loads[url].outstanding -= 1

    def on_success(self, url: str) -> None:
        load = self._loads[url]
        load.consecutive_failures = 0
        load.resting_until = 0.0

    def on_connect_failure(self, url: str, now: float, reason: str) -> None:
        load = self._loads[url]
        load.failures += 1
        load.consecutive_failures += 1
        load.last_error = reason
        over = load.consecutive_failures - self._unhealthy_after
        if over >= 0:
            load.resting_until = now + self._cooldown_s * min(16, 2**over)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        return [
            {
                "url": load.url,
                "weight": load.weight,
                "healthy": load.healthy(now),
                "outstanding": load.outstanding,
                "requests": load.requests,
                "failures": load.failures,
                "consecutive_failures": load.consecutive_failures,
                "resting_for_s": max(0.0, round(load.resting_until - now, 3)),
                "last_error": load.last_error,
            }
            for load in (self._loads[u] for u in self._urls)
        ]
