"""Fixtures for the engine simulator tests: running fleets, stopped at teardown."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
from sim_helpers import FAST

from loadtest.engine import EngineFleet, EngineSpec


@pytest.fixture
async def fleet() -> AsyncIterator[Callable[..., Awaitable[EngineFleet]]]:
    started: list[EngineFleet] = []

    async def make(*specs: EngineSpec, time_scale: float = FAST) -> EngineFleet:
        f = EngineFleet(
            [replace(s, time_scale=time_scale) if s.time_scale == 1.0 else s for s in specs]
            or [EngineSpec(time_scale=time_scale)]
        )
        await f.start()
        started.append(f)
        return f

    yield make
    for f in started:
        await f.stop()
