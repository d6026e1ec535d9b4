"""A sidecar following control-plane shards (control_plane.shards, issue #23): two real
control planes, each engine published to the shard meshd/shards.py picks for it, and an
in-process sidecar that follows both and merges them; an engine that moves to another
shard (a shard was added) stays reported while the old one still lists it and after the
old one removes it; a shard that goes away leaves the other's engines fresh."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from backends import TestBackend as Backend
from harness import sidecar_config

from meshd.control_feed import ControlFeed
from meshd.shards import shard_for
from meshd.sidecar import Sidecar
from xds.client import Publisher
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState
from xds.server import ControlPlane

WAIT_S = 10.0


def state(b: Backend, running: int = 0) -> bytes:
    return EndpointState(
        address=b.url.removeprefix("http://"),
        pool="default",
        model="tiny",
        gpu="H100",
        requests_running=running,
    ).encode()


async def test_a_sidecar_merges_its_engines_from_every_shard(
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    planes = [ControlPlane(eds=False), ControlPlane(eds=False)]
    pubs: list[Publisher] = []
    try:
        for p in planes:
            await p.start("127.0.0.1", 0)
        shards = [(f"127.0.0.1:{p.port}",) for p in planes]
        pubs = [Publisher(shard[0]) for shard in shards]
        # Three engines in each shard (the ports are random, so the names are chosen).
        by_shard: list[list[str]] = [[], []]
        for i in range(1000):
            n = f"engine-{i}"
            k = shards.index(shard_for(n, shards))
            if len(by_shard[k]) < 3:
                by_shard[k].append(n)
        names = by_shard[0] + by_shard[1]
        home = {n: k for k in (0, 1) for n in by_shard[k]}
        bs = [await backends(f"b{i}") for i in range(6)]
        cfg = sidecar_config(
            [b.url for b in bs],
            routing={"policy": "meshd"},
            control_plane={"shards": [list(sh) for sh in shards], "stale_after_s": 30},
        )
        s = await sidecar(cfg)
        feed = s.control_feed
        assert isinstance(feed, ControlFeed) and len(feed.subscribers) == 2
        for n, b in zip(names, bs, strict=True):
            await pubs[home[n]].publish(ENDPOINT_STATE_TYPE, {n: state(b, 1)})
        await asyncio.wait_for(feed.wait_until(lambda: len(feed.engines()) == 6), WAIT_S)
        assert sorted(feed.engines()) == sorted(names)
        health = feed.health()
        assert health["connected"] and len(health["shards"]) == 2

        # engine-0 moves to the other shard (a shard was added): the new shard has it
        # before the old one forgets it, and removing it from the old one keeps it.
        moved, b0 = names[0], bs[0]
        old, new = home[moved], 1 - home[moved]
        await pubs[new].publish(ENDPOINT_STATE_TYPE, {moved: state(b0, 5)})
        await pubs[old].publish(ENDPOINT_STATE_TYPE, {}, removed=[moved])
        await asyncio.sleep(0.3)  # both shards' responses applied
        await asyncio.wait_for(feed.wait_until(lambda: moved in feed.engines()), WAIT_S)
        assert moved in feed.engines()
        # Gone from every shard: gone.
        await pubs[new].publish(ENDPOINT_STATE_TYPE, {}, removed=[moved])
        await asyncio.wait_for(feed.wait_until(lambda: moved not in feed.engines()), WAIT_S)

        # A shard that goes away: the other shard's engines still come and go.
        away = 1 - home[names[1]]
        await planes[away].stop(0)
        await pubs[home[names[1]]].publish(ENDPOINT_STATE_TYPE, {}, removed=[names[1]])
        await asyncio.wait_for(feed.wait_until(lambda: names[1] not in feed.engines()), WAIT_S)
        assert not feed.health()["connected"]
    finally:
        for pub in pubs:
            await pub.close()
        for p in planes:
            await p.stop(0)


def test_named_engines_are_asked_for_only_at_their_shard() -> None:
    from meshd.config import load_config
    from meshd.metrics import DataPlaneMetrics
    from meshd.pools import build_routers

    shards = [("127.0.0.1:1",), ("127.0.0.1:2",), ("127.0.0.1:3",)]
    names = [f"engine-{i}" for i in range(12)]
    endpoints = [{"url": f"http://10.0.0.{i}:8000", "engine": n} for i, n in enumerate(names)]
    cfg = load_config(
        None,
        base={
            "pools": [{"name": "default", "endpoints": endpoints}],
            "control_plane": {"shards": [list(s) for s in shards]},
        },
        env={},
    )
    feed = ControlFeed(cfg, build_routers(cfg), DataPlaneMetrics())
    asked = [sorted(sub._interest[ENDPOINT_STATE_TYPE].names) for sub in feed.subscribers]
    assert sorted(n for shard in asked for n in shard) == sorted(names)  # each once
    for k, shard_names in enumerate(asked):
        assert all(shard_for(n, shards) == shards[k] for n in shard_names)
