"""The probe listener (listeners.probes): /healthz and /readyz on a port of their own, for a
kubelet probing the pod IP while the admin listener (/config, /endpoints) stays on loopback;
/metrics there only when asked (issue #21's item 5)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from backends import TestBackend as Backend
from harness import sidecar_config, url

from meshd.sidecar import Sidecar


@pytest.mark.parametrize("metrics", [False, True])
async def test_the_probe_listener_serves_health_and_nothing_else(
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    metrics: bool,
) -> None:
    b = await backends()
    probes = {"probes": {"enabled": True, "host": "127.0.0.1", "port": 0, "metrics": metrics}}
    s = await sidecar(sidecar_config([b.url], listeners=probes))
    async with aiohttp.ClientSession() as http:
        got = {}
        for path in ("/healthz", "/readyz", "/metrics", "/config", "/endpoints"):
            async with http.get(url(s, path, "probes")) as r:
                got[path] = r.status
        async with http.get(url(s, "/config", "admin")) as r:
            assert r.status == 200  # the admin listener still has everything
    assert got == {
        "/healthz": 200,
        "/readyz": 200,
        "/metrics": 200 if metrics else 404,
        "/config": 404,
        "/endpoints": 404,
    }


async def test_no_probe_listener_unless_enabled(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    assert "probes" not in s.addresses
