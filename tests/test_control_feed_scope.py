"""Which engines a sidecar follows: with every endpoint naming its engine
(`pools[].endpoints[].engine`) it subscribes to those resource names alone and the control
plane sends it its pools' engines, not the fleet's; without names it takes the wildcard,
as before. Also the bound on the feed's memo of published addresses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from harness import sidecar_config

import meshd.control_feed as control_feed
from meshd.config import ConfigError
from meshd.control_feed import ControlFeed, subscribed_engines
from meshd.metrics import DataPlaneMetrics
from meshd.pools import build_routers
from meshd.sidecar import Sidecar
from xds.client import Publisher
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState
from xds.server import ControlPlane

WAIT_S = 10.0
# Engines 0 and 1 are this sidecar's; 2 and 3 another pool's, elsewhere.
ADDRESSES = ["127.0.0.1:18000", "127.0.0.1:18001", "10.9.0.2:8000", "10.9.0.3:8000"]


def state(i: int, running: int = 0) -> bytes:
    return EndpointState(
        address=ADDRESSES[i], pool="p", model="tiny", requests_running=running
    ).encode()


def config(port: int, names: list[str | None]) -> Any:
    endpoints = [
        {"url": f"http://{a}"} if n is None else {"url": f"http://{a}", "engine": n}
        for a, n in zip(ADDRESSES[:2], names, strict=True)
    ]
    return sidecar_config(
        [],
        pools=[{"name": "mine", "endpoints": endpoints}],
        control_plane={"addresses": [f"127.0.0.1:{port}"]},
    )


@pytest.fixture
async def plane() -> AsyncIterator[ControlPlane]:
    cp = ControlPlane()
    await cp.start("127.0.0.1", 0)
    pub = Publisher(f"127.0.0.1:{cp.port}")
    await pub.publish(ENDPOINT_STATE_TYPE, {f"e{i}": state(i) for i in range(4)})
    await pub.close()
    yield cp
    await cp.stop(0)


async def test_a_sidecar_naming_its_engines_gets_only_those(
    plane: ControlPlane, sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    s = await sidecar(config(plane.port, ["e0", "e1"]))
    feed = s.control_feed
    assert isinstance(feed, ControlFeed)
    await asyncio.wait_for(feed.wait_until(lambda: len(feed.engines()) == 2), WAIT_S)
    # The other pool's engines change; then one of ours does: by the time ours arrives,
    # theirs would have too, had the sidecar asked for them.
    pub = Publisher(f"127.0.0.1:{plane.port}")
    await pub.publish(ENDPOINT_STATE_TYPE, {"e2": state(2, 5), "e3": state(3, 5)})
    await pub.publish(ENDPOINT_STATE_TYPE, {"e0": state(0, 7)})
    await pub.close()
    sub = feed.subscriber

    def ours_updated() -> bool:
        e = sub.entries(ENDPOINT_STATE_TYPE).get("e0")
        return e is not None and e.value.state.requests_running == 7

    await asyncio.wait_for(feed.wait_until(ours_updated), WAIT_S)
    assert set(sub.entries(ENDPOINT_STATE_TYPE)) == {"e0", "e1"}
    assert feed.engines() == {"e0": ["http://127.0.0.1:18000"], "e1": ["http://127.0.0.1:18001"]}
    assert feed.stats.unmatched == 0
    (info,) = [i for i in plane.streams() if i.type_url == ENDPOINT_STATE_TYPE]
    assert not info.wildcard and info.names == {"e0", "e1"}


async def test_a_sidecar_without_names_takes_the_wildcard(
    plane: ControlPlane, sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    s = await sidecar(config(plane.port, ["e0", None]))
    feed = s.control_feed
    assert isinstance(feed, ControlFeed)
    sub = feed.subscriber
    await asyncio.wait_for(
        feed.wait_until(lambda: len(sub.entries(ENDPOINT_STATE_TYPE)) == 4), WAIT_S
    )
    assert set(feed.engines()) == {"e0", "e1"} and feed.stats.unmatched == 2
    (info,) = [i for i in plane.streams() if i.type_url == ENDPOINT_STATE_TYPE]
    assert info.wildcard


def test_subscribed_engines_names_all_or_none() -> None:
    cfg = config(1, ["e0", "e1"])
    assert subscribed_engines(cfg, build_routers(cfg)) == ["e0", "e1"]
    cfg = config(1, ["e0", None])
    assert subscribed_engines(cfg, build_routers(cfg)) is None
    cfg = config(1, ["e0", "e0"])  # one engine behind two URLs
    assert subscribed_engines(cfg, build_routers(cfg)) == ["e0"]


@pytest.mark.parametrize("name", ["*", "", "a*"])
def test_an_engine_name_is_never_the_wildcard(name: str) -> None:
    with pytest.raises(ConfigError):
        config(1, [name, "e1"])


def test_the_address_memo_starts_over_at_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control_feed, "MAX_ADDRESSES", 8)
    cfg = config(1, [None, None])
    feed = ControlFeed(cfg, build_routers(cfg), DataPlaneMetrics())
    mine = feed._targets_at(ADDRESSES[0])
    assert [url for _, url, _ in mine] == ["http://127.0.0.1:18000"]
    for i in range(20):
        assert feed._targets_at(f"10.1.0.{i}:8000") == ()
        assert len(feed._by_address) <= 8
    assert feed._targets_at(ADDRESSES[0]) is mine
    assert feed._targets_at("HTTP://127.0.0.1:18001/") == feed._targets_at(ADDRESSES[1])


def test_the_ack_pace_is_a_setting_with_edges() -> None:
    def pace(**cp: Any) -> dict[str, float]:
        cfg = sidecar_config(
            [],
            pools=[{"name": "mine", "endpoints": [{"url": f"http://{ADDRESSES[0]}"}]}],
            control_plane={"addresses": ["127.0.0.1:1"], **cp},
        )
        feed = ControlFeed(cfg, build_routers(cfg), DataPlaneMetrics())
        return dict(feed.subscribers[0]._ack_pace)

    assert pace() == {ENDPOINT_STATE_TYPE: 0.02}
    assert pace(ack_pace_s=0.05) == {ENDPOINT_STATE_TYPE: 0.05}
    assert pace(ack_pace_s=1.0) == {ENDPOINT_STATE_TYPE: 1.0}
    assert pace(ack_pace_s=0) == {}  # each response ACKed at once
    for bad in (-0.01, 1.01):
        with pytest.raises(ConfigError, match="ack_pace_s"):
            pace(ack_pace_s=bad)
