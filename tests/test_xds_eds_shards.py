"""xds/eds_shards.py: with control-plane shards every shard serves Envoy the whole fleet's
assignments. The merge of every shard's part is byte for byte what one unsharded control
plane serves for the same engines (hypothesis, over random fleets split at random); over
real gRPC, two shards with the engines spread by meshd/shards.py, and an EDS client (delta
ADS, Envoy's request shape) on one of them sees them all; the other shard stopped, its
engines stay for the stale window, then leave; restarted, they come back; and the first
assignment waits for the other shard, at most the sync timeout. tests/test_envoy_eds.py
checks the same with the real Envoy."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.shards import shard_for
from xds.cache import SnapshotCache
from xds.cli import other_shards
from xds.client import Backoff, Publisher, Subscriber
from xds.eds import CLA_TYPE, SHARD_CLA_TYPE, EdsView
from xds.eds_shards import merge_assignments, split_assignment
from xds.metrics import ServerStatsCollector
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState
from xds.server import ControlPlane

WAIT_S = 10.0


def engine_state(i: int, rng: random.Random) -> EndpointState:
    return EndpointState(
        f"10.0.{i // 250}.{i % 250}:8000",
        pool=rng.choice(["p", "q", ""]),
        gpu=rng.choice(["H100", "A100", None]),
        gpu_count=rng.randrange(1, 9),
        kv_usage=rng.choice([None, 0.1, 0.5, 0.95]),
        healthy=rng.random() > 0.1,
        draining=rng.random() < 0.1,
        epoch=f"e{i}",
    )


@given(
    n=st.integers(1, 40),
    shards=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_the_merge_of_the_shards_parts_is_the_unsharded_view(
    n: int, shards: int, seed: int
) -> None:
    rng = random.Random(seed)
    states = {f"engine-{i:03d}": engine_state(i, rng) for i in range(n)}
    whole = SnapshotCache()
    EdsView(whole)
    whole.update(ENDPOINT_STATE_TYPE, {k: s.encode() for k, s in states.items()})
    parts = [SnapshotCache() for _ in range(shards)]
    for cache in parts:
        EdsView(cache, type_url=SHARD_CLA_TYPE)
    for name, s in states.items():
        parts[rng.randrange(shards)].set(ENDPOINT_STATE_TYPE, name, s.encode())
    # An engine moving shards may be in two for a while: counted once.
    moving = rng.choice(sorted(states))
    for cache in parts:
        cache.set(ENDPOINT_STATE_TYPE, moving, states[moving].encode())
    for pool, r in whole.resources(CLA_TYPE).items():
        pieces = [
            split_assignment(c.resources(SHARD_CLA_TYPE)[pool].body)
            for c in parts
            if pool in c.resources(SHARD_CLA_TYPE)
        ]
        assert merge_assignments(pool, pieces) == r.body


def test_this_shard_is_found_among_the_shards_by_its_pod_name() -> None:
    shards = [f"cp-{i}.cp-headless.ns.svc:15010" for i in range(3)]
    assert other_shards(shards, "cp-1") == [(shards[0],), (shards[2],)]
    assert other_shards(["a:1", "b:2,b2:2"], "a:1") == [("b:2", "b2:2")]
    with pytest.raises(SystemExit, match="0 of the shards"):
        other_shards(shards, "elsewhere")


def state(port: int, pool: str = "p") -> bytes:
    return EndpointState(f"127.0.0.1:{port}", pool=pool, gpu="H100", gpu_count=1).encode()


class EdsClient:
    """A delta ADS client asking for one pool's ClusterLoadAssignment by name, as Envoy's
    EDS cluster does; `ports()` is the pool as it last heard it."""

    def __init__(self, port: int, pool: str = "p") -> None:
        self.pool = pool
        self.sub = Subscriber(
            f"127.0.0.1:{port}",
            {CLA_TYPE: [pool]},
            node_id="envoy-like",
            decoders={CLA_TYPE: endpoint_pb2.ClusterLoadAssignment.FromString},
            backoff=Backoff(base_s=0.02, max_s=0.2),
        )
        self.sub.start()

    def ports(self) -> set[int] | None:
        cla = self.sub.get(CLA_TYPE, self.pool)
        if cla is None:
            return None
        return {
            lb.endpoint.address.socket_address.port_value
            for loc in cla.endpoints
            for lb in loc.lb_endpoints
        }

    async def until(self, pred: Callable[[set[int] | None], bool]) -> None:
        await asyncio.wait_for(self.sub.wait_until(lambda: pred(self.ports())), WAIT_S)


def spread(shards: list[tuple[str, ...]], per_shard: int) -> list[list[str]]:
    """Engine names, `per_shard` of them in each shard as meshd/shards.py places them."""
    out: list[list[str]] = [[] for _ in shards]
    for i in range(10_000):
        name = f"engine-{i}"
        k = shards.index(shard_for(name, shards))
        if len(out[k]) < per_shard:
            out[k].append(name)
        if all(len(o) == per_shard for o in out):
            return out
    raise AssertionError("no spread found")


async def test_an_eds_client_of_one_shard_sees_every_shards_engines() -> None:
    stale_s = 0.6
    a = ControlPlane(eds_shards=[("pending",)], eds_shard_stale_s=stale_s)
    b = ControlPlane(eds_shards=[("pending",)], eds_shard_stale_s=stale_s)
    client: EdsClient | None = None
    pubs: list[Publisher] = []
    try:
        await a.start("127.0.0.1", 0)
        await b.start("127.0.0.1", 0)
        shards: list[tuple[str, ...]] = [(f"127.0.0.1:{a.port}",), (f"127.0.0.1:{b.port}",)]
        assert a.eds_shards is not None and b.eds_shards is not None
        a.eds_shards.shards, b.eds_shards.shards = [shards[1]], [shards[0]]
        names = spread(shards, 2)
        port_of = {n: 9000 + i for i, n in enumerate(names[0] + names[1])}
        pubs = [Publisher(s[0]) for s in shards]
        for k in (0, 1):
            await pubs[k].publish(ENDPOINT_STATE_TYPE, {n: state(port_of[n]) for n in names[k]})
        every = set(port_of.values())
        b_ports = {port_of[n] for n in names[1]}

        client = EdsClient(a.port)
        await client.until(lambda p: p == every)
        # Only Envoy's shard follows the others, and only from Envoy's arrival.
        assert not b.eds_shards.started

        # An engine of the other shard changes: the client on A hears it.
        moved = names[1][0]
        await pubs[1].publish(ENDPOINT_STATE_TYPE, {moved: state(9999)})
        every = every - {port_of[moved]} | {9999}
        b_ports = b_ports - {port_of[moved]} | {9999}
        await client.until(lambda p: p == every)

        # B stops: its engines stay for the stale window, then leave.
        b_port = b.port
        await pubs[1].close()
        stopped = time.monotonic()
        await b.stop(0)
        follower = a.eds_shards.subscribers[0]
        await asyncio.wait_for(follower.wait_until(lambda: not follower.connected), WAIT_S)
        assert client.ports() == every
        await client.until(lambda p: p == every - b_ports)
        assert time.monotonic() - stopped >= stale_s
        gauges = {
            m.name: m.samples[0].value
            for m in ServerStatsCollector(a.stats, a.eds, a.eds_shards).collect()
            if m.name.startswith("meshd_xds_eds_shard")
        }
        assert gauges == {"meshd_xds_eds_shard_connected": 0.0, "meshd_xds_eds_shard_in_view": 0.0}

        # B back (on its address, empty), its agents publish again: back in the view.
        b = ControlPlane(eds_shards=[shards[0]], eds_shard_stale_s=stale_s)
        await b.start("127.0.0.1", b_port)
        pubs[1] = Publisher(shards[1][0])
        await pubs[1].publish(
            ENDPOINT_STATE_TYPE,
            {n: state(9999 if n == moved else port_of[n]) for n in names[1]},
        )
        await client.until(lambda p: p == every)
    finally:
        if client is not None:
            await client.sub.close()
        for pub in pubs:
            await pub.close()
        await a.stop(0)
        await b.stop(0)


async def test_envoys_first_assignment_waits_for_the_other_shards() -> None:
    """Not the pool with a shard missing: the first response waits until every other
    shard answered, or the sync timeout for one that does not (a dead shard)."""
    a = ControlPlane(eds_shards=[("pending",)])
    b = ControlPlane(eds_shards=[("pending",)])
    client: EdsClient | None = None
    try:
        await a.start("127.0.0.1", 0)
        await b.start("127.0.0.1", 0)
        assert a.eds_shards is not None and b.eds_shards is not None
        a.eds_shards.shards = [(f"127.0.0.1:{b.port}",)]
        b.eds_shards.shards = [(f"127.0.0.1:{a.port}",)]
        async with asyncio.timeout(WAIT_S):
            # A has an engine, B another; A's client never sees A's alone.
            await Publisher(f"127.0.0.1:{a.port}").publish(ENDPOINT_STATE_TYPE, {"x": state(1)})
            await Publisher(f"127.0.0.1:{b.port}").publish(ENDPOINT_STATE_TYPE, {"y": state(2)})
            client = EdsClient(a.port)
            await client.until(lambda p: p is not None)
            assert client.ports() == {1, 2}
            await client.sub.close()

        # A shard that never answers holds the first assignment for the sync timeout only.
        c = ControlPlane(eds_shards=[("127.0.0.1:1",)])  # nothing listens there
        assert c.eds_shards is not None
        c.eds_shards.sync_timeout_s = 0.3
        await c.start("127.0.0.1", 0)
        try:
            await Publisher(f"127.0.0.1:{c.port}").publish(ENDPOINT_STATE_TYPE, {"z": state(3)})
            began = time.monotonic()
            client = EdsClient(c.port)
            await client.until(lambda p: p == {3})
            assert time.monotonic() - began >= 0.3
        finally:
            await c.stop(0)
    finally:
        if client is not None:
            await client.sub.close()
        await a.stop(0)
        await b.stop(0)
