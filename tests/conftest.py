"""Shared fixtures: real aiohttp test backends and an in-process sidecar."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from backends import TestBackend

from meshd.config import Config, load_config
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


def sidecar_config(endpoints: list[str], **sections: Any) -> Config:
    base: dict[str, Any] = {
        "listeners": {"outbound": {"port": 0}, "admin": {"port": 0}},
        "pools": [{"name": "default", "endpoints": endpoints}],
        "drain": {"grace_period_s": 2},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(None, base=base, env={})


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


def url(s: Sidecar, path: str, listener: str = "outbound") -> str:
    return f"http://{s.addresses[listener]}{path}"
