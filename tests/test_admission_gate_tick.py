"""The reaper's tick hands the guards only the KV capacities that changed (each push costs
the breaker a dataclass replace; every endpoint's every tick was ~1% of a core at 1,000
endpoints), and all of them every KV_RESYNC_S; the breaker's token limits end the same."""

from __future__ import annotations

from typing import Any

import pytest
from harness import sidecar_config

from filters.endpoint_state import ReportedState
from meshd import admission_gate
from meshd.sidecar import Sidecar

URLS = [f"http://10.0.0.{i}:8000" for i in range(4)]


def kv(blocks: int) -> ReportedState:
    return ReportedState(kv_block_size=16, kv_capacity_blocks=blocks)


@pytest.fixture
def side(monkeypatch: pytest.MonkeyPatch) -> tuple[Sidecar, list[tuple[str, int]]]:
    s = Sidecar(sidecar_config(URLS))
    given: list[tuple[str, int]] = []
    guard = s.plane.guards["default"]
    real = guard.kv_capacity

    def spy(url: str, tokens: int) -> None:
        given.append((url, tokens))
        real(url, tokens)

    monkeypatch.setattr(guard, "kv_capacity", spy)
    return s, given


def limit(s: Sidecar, url: str) -> Any:
    breaker = s.plane.guards["default"].breaker
    assert breaker is not None
    return breaker._endpoint(url).limits.max_tokens


def test_only_what_changed_reaches_the_guard(side: tuple[Sidecar, list[tuple[str, int]]]) -> None:
    s, given = side
    router, gate = s.routers["default"], s.gate
    for url in URLS:
        router.report(url, kv(1000), 0.0, ttl_s=100.0)
    gate.tick(1.0)
    assert sorted(given) == [(u, 16_000) for u in URLS]  # the first tick: every one
    assert all(limit(s, u) == 32_000 for u in URLS)  # max_tokens_kv_factor 2
    given.clear()
    gate.tick(1.25)
    gate.tick(1.5)
    assert given == []  # nothing changed: nothing handed over
    router.report(URLS[2], kv(2000), 1.6, ttl_s=100.0)
    gate.tick(1.75)
    assert given == [(URLS[2], 32_000)] and limit(s, URLS[2]) == 64_000
    given.clear()
    # A report gone stale takes its capacity out of the walk, as before: nothing handed.
    router.report(URLS[3], kv(3000), 1.8, ttl_s=0.1)
    gate.tick(2.0)
    assert given == []
    gate.tick(1.0 + admission_gate.KV_RESYNC_S)
    assert len(given) == 3  # the resync: every known capacity again


def test_a_forgotten_endpoint_gets_its_limit_back_at_the_resync(
    side: tuple[Sidecar, list[tuple[str, int]]],
) -> None:
    s, _ = side
    router, gate = s.routers["default"], s.gate
    router.report(URLS[0], kv(1000), 0.0, ttl_s=100.0)
    gate.tick(1.0)
    breaker = s.plane.guards["default"].breaker
    assert breaker is not None and limit(s, URLS[0]) == 32_000
    breaker.remove(URLS[0])  # as its eviction past max_endpoints does
    gate.tick(2.0)
    assert limit(s, URLS[0]) == 262_144  # the default until...
    gate.tick(1.0 + admission_gate.KV_RESYNC_S)
    assert limit(s, URLS[0]) == 32_000
