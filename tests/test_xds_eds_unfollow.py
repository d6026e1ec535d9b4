"""xds/eds_shards.py: following the other shards stops once no Envoy has followed this one
for `unfollow_after_s`, and starts again with the next Envoy. The rule with fakes (a fake
clock, a flag for "an Envoy follows"); then over real gRPC: two shards, an EDS client on
one, gone for the grace period: the other shard loses its follower; a new client has
every engine again, a change made meanwhile included."""

from __future__ import annotations

import asyncio

from test_xds_eds_shards import WAIT_S, EdsClient, spread, state

from xds.cache import SnapshotCache
from xds.client import Publisher
from xds.eds import SHARD_CLA_TYPE
from xds.eds_shards import ShardedEds
from xds.resources import ENDPOINT_STATE_TYPE
from xds.server import ControlPlane


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_following_stops_after_the_grace_without_an_envoy_and_starts_again() -> None:
    clock, envoy = Clock(), [True]
    eds = ShardedEds(
        SnapshotCache(),
        [("127.0.0.1:1",)],  # nothing listens there: the subscriber keeps retrying
        clock=clock,
        followed=lambda: envoy[0],
        unfollow_after_s=60.0,
    )
    try:
        eds.start()
        first = eds.subscribers
        assert eds.started and not await eds.unfollow_if_alone()
        envoy[0] = False
        clock.now = 10.0
        assert not await eds.unfollow_if_alone()  # alone from now on
        clock.now = 69.0
        assert not await eds.unfollow_if_alone() and eds.started
        envoy[0] = True  # an Envoy back within the grace: it starts over
        clock.now = 69.5
        assert not await eds.unfollow_if_alone()
        envoy[0] = False
        clock.now = 70.0
        assert not await eds.unfollow_if_alone()
        clock.now = 129.9
        assert not await eds.unfollow_if_alone() and eds.started
        clock.now = 130.0
        assert await eds.unfollow_if_alone()
        assert not eds.started and not eds.ready() and eds.subscribers == [] and eds.stops == 1
        assert all(sub._task is None for sub in first)  # their channels closed
        assert not await eds.unfollow_if_alone()  # stopped: nothing more to stop

        envoy[0] = True  # the next Envoy
        eds.start()
        assert eds.started and len(eds.subscribers) == 1 and eds.subscribers[0] not in first
    finally:
        await eds.close()


async def test_without_followed_it_follows_for_good() -> None:
    clock = Clock()
    eds = ShardedEds(SnapshotCache(), [("127.0.0.1:1",)], clock=clock)
    try:
        eds.start()
        clock.now = 1e9
        assert not await eds.unfollow_if_alone() and eds.started
    finally:
        await eds.close()


async def test_a_shard_without_envoys_lets_the_other_go_and_follows_again_for_the_next() -> None:
    clock = Clock()
    a = ControlPlane(eds_shards=[("pending",)], clock=clock)
    b = ControlPlane(eds_shards=[("pending",)])
    client: EdsClient | None = None
    pubs: list[Publisher] = []
    try:
        await a.start("127.0.0.1", 0)
        await b.start("127.0.0.1", 0)
        shards: list[tuple[str, ...]] = [(f"127.0.0.1:{a.port}",), (f"127.0.0.1:{b.port}",)]
        assert a.eds_shards is not None and b.eds_shards is not None
        a.eds_shards.shards, b.eds_shards.shards = [shards[1]], [shards[0]]
        names = spread(shards, 1)
        pubs = [Publisher(s[0]) for s in shards]
        await pubs[0].publish(ENDPOINT_STATE_TYPE, {names[0][0]: state(9000)})
        await pubs[1].publish(ENDPOINT_STATE_TYPE, {names[1][0]: state(9001)})

        client = EdsClient(a.port)
        await client.until(lambda p: p == {9000, 9001})
        await asyncio.wait_for(b.wait_until(lambda: len(b.streams()) == 1), WAIT_S)
        assert [i.type_url for i in b.streams()] == [SHARD_CLA_TYPE]  # A follows B

        await client.sub.close()
        client = None
        await asyncio.wait_for(a.wait_until(lambda: not a.streams()), WAIT_S)
        assert not await a.eds_shards.unfollow_if_alone()  # alone from now on
        clock.now += a.eds_shards.unfollow_after_s
        assert await a.eds_shards.unfollow_if_alone()
        await asyncio.wait_for(b.wait_until(lambda: not b.streams()), WAIT_S)

        # B's engine changes while nobody follows it; the next Envoy on A has it.
        await pubs[1].publish(ENDPOINT_STATE_TYPE, {names[1][0]: state(9002)})
        client = EdsClient(a.port)
        await client.until(lambda p: p == {9000, 9002})
        assert a.eds_shards.started and a.eds_shards.stops == 1
    finally:
        if client is not None:
            await client.sub.close()
        for pub in pubs:
            await pub.close()
        await a.stop(0)
        await b.stop(0)
