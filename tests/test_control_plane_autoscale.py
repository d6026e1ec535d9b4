"""One figure per pool, not one per sidecar: sidecars publish their per-pool demand
(PoolDemandReport, xds/resources.py) to a real control plane, which sums it and serves one
desired-replicas figure per pool on its /metrics (meshd_fleet_pool_*) and /autoscale (what
KEDA's metrics-api scaler reads)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from harness import sidecar_config, url
from prometheus_client.parser import text_string_to_metric_families

from filters.autoscale import DECODE_BATCH, PoolDemand, ScalingPolicy
from filters.gpu import GPUS
from meshd.autoscale_metrics import FleetDemand
from xds.cli import _start_admin
from xds.client import Publisher
from xds.resources import (
    POOL_DEMAND_TYPE,
    PoolDemandReport,
    ResourceError,
    decode_pool_demand,
)
from xds.server import ControlPlane

CP = GPUS["H100"].prefill_tokens_per_s
CD = DECODE_BATCH / GPUS["H100"].decode_step_s(DECODE_BATCH)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def plane() -> AsyncIterator[tuple[ControlPlane, Clock]]:
    clock = Clock()
    cp = ControlPlane(clock=clock)
    await cp.start("127.0.0.1", 0)
    yield cp, clock
    await cp.stop(0)


def report(sidecar: str, prefill: float, decode: float, **policy: Any) -> PoolDemandReport:
    d = PoolDemand(
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        requests_per_s=10.0,
        replica_prefill_tokens_per_s=CP,
        replica_decode_tokens_per_s=CD,
        replicas=3,
    )
    return PoolDemandReport("default", sidecar, d, ScalingPolicy(**policy))


async def admin_json(runner: Any, path: str) -> Any:
    host, port = runner.addresses[0][:2]
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}{path}") as r:
        return await (r.json() if path == "/autoscale" else r.text())


async def test_two_sidecars_sum_into_one_figure(plane: tuple[ControlPlane, Clock]) -> None:
    cp, clock = plane
    runner = await _start_admin("127.0.0.1:0", cp)
    pubs = [Publisher(f"127.0.0.1:{cp.port}") for _ in range(2)]
    try:
        # Each sidecar alone: (2 + 1) replicas busy / 0.7 x 1.1 -> 5; together -> 10.
        a = report("a", 2 * CP, CD, scale_down_delay_s=0)
        b = report("b", 2 * CP, CD, scale_down_delay_s=0)
        await pubs[0].publish(POOL_DEMAND_TYPE, {a.name: a.encode()})
        await pubs[1].publish(POOL_DEMAND_TYPE, {b.name: b.encode()})
        doc = await admin_json(runner, "/autoscale")
        pool = doc["pools"]["default"]
        assert pool["sidecars"] == 2
        assert pool["desired_replicas"] == 10
        assert pool["prefill_tokens_per_s"] == pytest.approx(4 * CP)
        assert pool["replicas"] == 3  # the same engines seen twice: not 6
        text = await admin_json(runner, "/metrics")
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        (s,) = fams["meshd_fleet_pool_desired_replicas"].samples
        assert (s.labels, s.value) == ({"pool": "default"}, 10)
        assert fams["meshd_fleet_pool_sidecars"].samples[0].value == 2
        assert "meshd_xds_publishes" in fams  # beside the control plane's own stats

        # One sidecar goes (it withdraws its report): the figure follows the one left.
        await pubs[1].publish(POOL_DEMAND_TYPE, {}, removed=[b.name])
        pool = (await admin_json(runner, "/autoscale"))["pools"]["default"]
        assert (pool["sidecars"], pool["desired_replicas"]) == (1, 5)

        # A sidecar that stops publishing without a word stops counting after 30 s.
        clock.t += 31.0
        assert (await admin_json(runner, "/autoscale"))["pools"] == {}
    finally:
        for p in pubs:
            await p.close()
        await runner.cleanup()


async def test_a_malformed_report_is_refused(plane: tuple[ControlPlane, Clock]) -> None:
    cp, _ = plane
    good = report("a", CP, CD)
    bad = dataclasses.replace(good, demand=dataclasses.replace(good.demand, replicas=-1))
    pub = Publisher(f"127.0.0.1:{cp.port}")
    try:
        with pytest.raises(ResourceError, match="replicas"):
            await pub.publish(POOL_DEMAND_TYPE, {bad.name: bad.encode()})
    finally:
        await pub.close()
    assert decode_pool_demand(good.encode()) == good
    assert FleetDemand(cp).reports() == {}


@pytest.fixture
async def real_plane() -> AsyncIterator[ControlPlane]:
    cp = ControlPlane()  # the sidecars' reports age by the real clock
    await cp.start("127.0.0.1", 0)
    yield cp
    await cp.stop(0)


async def test_real_sidecars_publish_their_demand(real_plane, backends, sidecar) -> None:
    cp = real_plane
    sides = []
    for i in range(2):
        b = await backends(f"b{i}")
        b.chars_per_token = 1.0
        cfg = sidecar_config(
            [b.url],
            control_plane={"addresses": [f"127.0.0.1:{cp.port}"]},
            pools=[
                {
                    "name": "default",
                    "endpoints": [{"url": b.url, "gpu": "H100"}],
                    "autoscaling": {"slo_ttft_s": 2.0, "max_replicas": 20},
                }
            ],
        )
        sides.append(await sidecar(cfg))
    async with aiohttp.ClientSession() as http:
        for i, s in enumerate(sides):
            for _ in range(4 + 4 * i):  # the second sidecar sees twice the traffic
                body = {"model": "tiny", "prompt": "z" * 300, "max_tokens": 10}
                async with http.post(url(s, "/v1/completions"), json=body) as r:
                    assert r.status == 200
    own = []
    for s in sides:
        s.accounting.flush()
        assert await s.demand_publisher.publish_once() == 1
        own.append(s.autoscale.last["default"][0])
    fleet = FleetDemand(cp)
    reps = fleet.reports()["default"]
    assert sorted(r.sidecar for r in reps) == sorted(s.demand_publisher.sidecar_id for s in sides)
    merged, plan, n, policy = fleet.evaluate(asyncio.get_running_loop().time())["default"]
    assert n == 2 and policy.slo_ttft_s == 2.0 and policy.max_replicas == 20
    assert merged.prefill_tokens_per_s == pytest.approx(sum(d.prefill_tokens_per_s for d in own))
    assert merged.decode_tokens_per_s == pytest.approx(sum(d.decode_tokens_per_s for d in own))
    assert merged.prefill_tokens_per_s > 0
    assert 1 <= plan.desired <= 20
    # Drained, a sidecar withdraws its report.
    await sides[0].drain_and_stop()
    assert [r.sidecar for r in fleet.reports()["default"]] == [sides[1].demand_publisher.sidecar_id]
