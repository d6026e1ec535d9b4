"""Two control-plane replicas: real engine agents (meshd/agent.py, next to simulated vLLM
engines) publish to both, the replicas converge to the same resource versions, and a
sidecar subscribed to one fails over to the other when it is killed mid-stream, and keeps
receiving fresh engine state there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp
import pytest
from harness import sidecar_config, url

from loadtest.engine import EngineSpec, SimEngine
from meshd.agent import AgentConfig, EngineAgent
from meshd.control_feed import ControlFeed
from meshd.sidecar import Sidecar
from xds.client import Backoff
from xds.resources import ENDPOINT_STATE_TYPE
from xds.server import ControlPlane

WAIT_S = 10.0


@dataclass
class Fleet:
    engines: list[SimEngine]
    agents: list[EngineAgent]
    planes: list[ControlPlane]


def agent_config(i: int, engine: SimEngine, planes: Sequence[ControlPlane]) -> AgentConfig:
    return AgentConfig(
        name=f"engine-{i}",
        engine_url=engine.url,
        address=engine.url.removeprefix("http://"),
        pool="default",
        control_planes=tuple(f"127.0.0.1:{p.port}" for p in planes),
        interval_s=0.02,
        heartbeat_s=0.5,
        gpu="H100",
        gpu_count=1,
        nvml=False,
        backoff=Backoff(base_s=0.02, max_s=0.2),
    )


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    planes = [ControlPlane(), ControlPlane()]
    for p in planes:
        await p.start("127.0.0.1", 0)
    engines = [SimEngine(EngineSpec(name=f"engine-{i}", time_scale=50.0)) for i in range(2)]
    for e in engines:
        await e.start()
    agents = [EngineAgent(agent_config(i, e, planes)) for i, e in enumerate(engines)]
    for a in agents:
        await a.start()
    try:
        yield Fleet(engines, agents, planes)
    finally:
        for a in agents:
            await a.close()
        for e in engines:
            await e.stop()
        for p in planes:
            await p.stop(0)


def versions(plane: ControlPlane) -> dict[str, str]:
    return {n: r.version for n, r in plane.cache.resources(ENDPOINT_STATE_TYPE).items()}


async def poll(pred: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_sidecar_fails_over_between_replicas_and_keeps_fresh_state(
    fleet: Fleet, sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    a, b = fleet.planes
    # Both replicas hold both engines, at the same versions (content hashes).
    await poll(lambda: len(versions(a)) == 2 and versions(a) == versions(b))

    cfg = sidecar_config(
        [e.url for e in fleet.engines],
        routing={"policy": "meshd"},
        control_plane={
            "addresses": [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"],
            "stale_after_s": 1.0,
        },
    )
    s = await sidecar(cfg)
    feed = s._feed
    assert isinstance(feed, ControlFeed)
    await asyncio.wait_for(feed.wait_until(lambda: len(feed.engines()) == 2), WAIT_S)
    assert feed.subscriber.target == f"127.0.0.1:{a.port}"
    router = s.routers["default"]

    def reported(i: int) -> dict[str, object] | None:
        r = router.snapshot(time.monotonic())[i]["reported"]
        assert r is None or isinstance(r, dict)
        return r

    assert (reported(1) or {}).get("healthy") is True

    # Kill replica A mid-stream; then the world changes while only B can say so.
    await a.stop(0)
    await fleet.engines[1].stop()
    await asyncio.wait_for(
        feed.wait_until(
            lambda: feed.subscriber.connected and feed.subscriber.target.endswith(f":{b.port}")
        ),
        WAIT_S,
    )
    await poll(lambda: (reported(1) or {}).get("healthy") is False)
    r1 = reported(1)
    assert r1 is not None and r1["fresh"] is True
    assert feed.health()["failovers"] >= 1 and feed.health()["disconnects"] >= 1
    assert router.snapshot(time.monotonic())[1]["ineligible_reason"] == "unhealthy"

    # Serving goes on through the failover, to the engine the state says is healthy.
    async with aiohttp.ClientSession() as session:
        for i in range(4):
            body = {"model": fleet.engines[0].spec.model, "prompt": f"q{i}", "max_tokens": 4}
            async with session.post(url(s, "/v1/completions"), json=body) as r:
                assert r.status == 200, await r.text()
    # And state that B alone received stays fresh past stale_after_s (renewed while connected).
    start = time.monotonic()
    await poll(lambda: time.monotonic() - start > 1.5)
    r1 = reported(1)
    assert r1 is not None and r1["fresh"] is True and r1["healthy"] is False
