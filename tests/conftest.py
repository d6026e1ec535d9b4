"""Shared fixtures: real aiohttp test backends and an in-process sidecar."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The repository root too: tests share fuzz/ helpers (fuzz/http_wire.py), not installed.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from backends import TestBackend

from meshd.config import Config
from meshd.sidecar import Sidecar


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., Awaitable[TestBackend]]]:
    started: list[TestBackend] = []

    async def make(name: str = "b", models: tuple[str, ...] = ("tiny",)) -> TestBackend:
        b = TestBackend(name, models)
        await b.start()
        started.append(b)
        return b

    yield make
    for b in started:
        await b.stop()


@pytest.fixture
async def sidecar() -> AsyncIterator[Callable[..., Awaitable[Sidecar]]]:
    started: list[Sidecar] = []

    async def make(config: Config) -> Sidecar:
        s = Sidecar(config)
        await s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        await s.drain_and_stop()
