"""Helpers shared by the data-plane tests: config for an in-process sidecar."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
from aiohttp import web

from loadtest import real_vllm
from loadtest.envoy_bin import EnvoyNotInstalled, envoy_binary
from loadtest.stub_backend import StubConfig, make_app
from meshd.config import Config, load_config
from meshd.sidecar import Sidecar


def sidecar_config(endpoints: list[str], **sections: Any) -> Config:
    base: dict[str, Any] = {
        "listeners": {"outbound": {"port": 0}, "admin": {"port": 0}},
        "pools": [{"name": "default", "endpoints": endpoints}],
        "drain": {"grace_period_s": 2},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(None, base=base, env={})


def url(s: Sidecar, path: str, listener: str = "outbound") -> str:
    return f"http://{s.addresses[listener]}{path}"


def _envoy_missing() -> str:
    try:
        envoy_binary()
    except EnvoyNotInstalled as exc:
        return str(exc)
    return ""


ENVOY_MISSING = _envoy_missing()
# `pytestmark = NEEDS_ENVOY` in a module whose tests all run the real Envoy.
NEEDS_ENVOY = [
    pytest.mark.envoy,
    pytest.mark.skipif(bool(ENVOY_MISSING), reason=f"needs the Envoy binary: {ENVOY_MISSING}"),
]
F = TypeVar("F", bound=Callable[..., Any])


def envoy_only(test: F) -> F:
    """The marks of NEEDS_ENVOY on one test."""
    for mark in reversed(NEEDS_ENVOY):
        test = mark(test)
    return test


# `pytestmark = NEEDS_REAL_VLLM`: the module starts real vLLM engines from .venv-vllm.
NEEDS_REAL_VLLM = [
    pytest.mark.real_vllm,
    pytest.mark.skipif(
        not real_vllm.available(),
        reason="no real vLLM here: run `python -m loadtest.real_vllm setup` (.venv-vllm)",
    ),
]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def stub_engines(
    names: list[str], default_tokens: int = 4
) -> AsyncIterator[tuple[list[int], list[str]]]:
    """Stub engines (loadtest.stub_backend) on port 0, one per name: their ports, and the
    name of the engine that served each request, in order."""
    served: list[str] = []
    runners: list[web.AppRunner] = []
    ports: list[int] = []
    try:
        for name in names:

            @web.middleware
            async def record(
                request: web.Request, handler: Handler, name: str = name
            ) -> web.StreamResponse:
                served.append(name)
                return await handler(request)

            app = make_app(StubConfig(default_tokens=default_tokens))
            app.middlewares.append(record)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            ports.append(runner.addresses[0][1])
        yield ports, served
    finally:
        for r in runners:
            await r.cleanup()
