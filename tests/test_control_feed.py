"""meshd/control_feed.py end to end: a real control plane (grpc, port 0), a Publisher
writing engines' EndpointState and PrefixDigest into it, and an in-process sidecar whose
`control_plane.addresses` points at it, in front of real HTTP backends. Routing follows
the reported state (draining and unhealthy engines get no traffic, a digest steers a
request to the engine holding its prefix), and a control plane killed mid-run leaves the
sidecar serving, its reports going stale after `stale_after_s`."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import certs
import pytest
from backends import TestBackend as Backend
from harness import sidecar_config, url

from filters.hotpath import block_hashes
from filters.picker import PickRequest
from filters.pool_router import EndpointSpec, make_router
from meshd.config import ConfigError
from meshd.control_feed import ControlFeed
from meshd.sidecar import Sidecar
from xds.client import Publisher
from xds.resources import ENDPOINT_STATE_TYPE, PREFIX_DIGEST_TYPE, EndpointState, PrefixDigest
from xds.server import ControlPlane, TlsConfig

WAIT_S = 10.0
MODEL = "tiny"


def engine_state(b: Backend, **kw: Any) -> EndpointState:
    return EndpointState(
        address=b.url.removeprefix("http://"), pool="default", model=MODEL, gpu="H100", **kw
    )


async def publish(pub: Publisher, states: dict[str, EndpointState]) -> None:
    await pub.publish(ENDPOINT_STATE_TYPE, {n: s.encode() for n, s in states.items()})


def feed_of(s: Sidecar) -> ControlFeed:
    feed = s._feed
    assert isinstance(feed, ControlFeed)
    return feed


async def until(feed: ControlFeed, pred: Callable[[], bool]) -> None:
    await asyncio.wait_for(feed.wait_until(pred), WAIT_S)


async def poll(pred: Callable[[], bool], wait_s: float = WAIT_S) -> None:
    """For conditions that only time changes (a report going stale)."""
    deadline = time.monotonic() + wait_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def complete(session: aiohttp.ClientSession, s: Sidecar, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    async with session.post(url(s, "/v1/completions"), json=body) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


async def spread(s: Sidecar, n: int, tag: str) -> Counter[str]:
    """Which backend served each of n requests with unrelated prompts (each at least one
    prefix block long: shorter ones have no prefix to spread by and, at zero load, tie)."""
    async with aiohttp.ClientSession() as session:
        got = [await complete(session, s, f"{tag} {i} " + "x" * (80 + i * 7)) for i in range(n)]
    return Counter(str(r["backend"]) for r in got)


@pytest.fixture
async def plane() -> AsyncIterator[ControlPlane]:
    cp = ControlPlane()
    await cp.start("127.0.0.1", 0)
    yield cp
    await cp.stop(0)


@pytest.fixture
async def publisher(plane: ControlPlane) -> AsyncIterator[Publisher]:
    pub = Publisher(f"127.0.0.1:{plane.port}")
    yield pub
    await pub.close()


Rig = tuple[list[Backend], Sidecar]


@pytest.fixture
async def rig(
    plane: ControlPlane,
    publisher: Publisher,
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> Rig:
    bs = [await backends(f"b{i}") for i in range(3)]
    await publish(publisher, {f"e{i}": engine_state(b) for i, b in enumerate(bs)})
    cfg = sidecar_config(
        [b.url for b in bs],
        routing={"policy": "meshd"},
        control_plane={"addresses": [f"127.0.0.1:{plane.port}"], "stale_after_s": 1.0},
    )
    s = await sidecar(cfg)
    feed = feed_of(s)
    await until(feed, lambda: len(feed.engines()) == 3)
    return bs, s


async def test_draining_and_unhealthy_engines_get_no_traffic(
    rig: Rig, publisher: Publisher
) -> None:
    bs, s = rig
    feed = feed_of(s)
    assert set(await spread(s, 12, "warm")) - {"b0"}  # not only b0 without reports

    await publish(
        publisher,
        {"e1": engine_state(bs[1], draining=True), "e2": engine_state(bs[2], healthy=False)},
    )
    router = s.routers["default"]
    await until(
        feed,
        lambda: (
            {e["url"]: e["ineligible_reason"] for e in router.snapshot(time.monotonic())}
            == {bs[0].url: None, bs[1].url: "draining", bs[2].url: "unhealthy"}
        ),
    )
    assert await spread(s, 12, "drain") == Counter({"b0": 12})

    # Back in service, and now e0 drains: traffic follows the report.
    await publish(
        publisher,
        {
            "e0": engine_state(bs[0], draining=True),
            "e1": engine_state(bs[1]),
            "e2": engine_state(bs[2]),
        },
    )
    await until(
        feed,
        lambda: (
            [e["ineligible_reason"] for e in router.snapshot(time.monotonic())]
            == ["draining", None, None]
        ),
    )
    served = await spread(s, 12, "after")
    assert "b0" not in served and sum(served.values()) == 12


async def test_a_reported_prefix_digest_steers_the_request(rig: Rig, publisher: Publisher) -> None:
    bs, s = rig
    feed = feed_of(s)
    cfg = s.config.routing
    # The sidecar hashes text blocks; a digest built from the same hashes is what a
    # precise-prefix engine would publish for this prompt.
    system = "You are the assistant of record for invoice disputes. " * 40
    hashes = block_hashes(system, MODEL, cfg.cache_salt, cfg.block_size_bytes)
    assert len(hashes) > 20
    # Where the picker would send it with no digest (idle pool: rendezvous hashing), so the
    # digest goes to an engine it would not have chosen.
    plain = make_router("meshd", [EndpointSpec(b.url, gpu="H100") for b in bs])
    req = PickRequest(model=MODEL, block_hashes=hashes, prompt_tokens=len(system) // 4)
    default = plain.order(req, 0.0)[0].url
    target = next(i for i, b in enumerate(bs) if b.url != default)

    digest = PrefixDigest(
        engine=f"e{target}",
        epoch="",
        seq=1,
        base_seq=1,
        full=True,
        block_size=16,
        added=tuple(hashes),
    )
    await publisher.publish(PREFIX_DIGEST_TYPE, {f"e{target}": digest.encode()})
    router = s.routers["default"]
    await until(
        feed,
        lambda: router.snapshot(time.monotonic())[target]["digest_blocks"] == len(hashes),
    )
    async with aiohttp.ClientSession() as session:
        r = await complete(session, s, system + "Question: why was I charged twice?")
        assert r["backend"] == f"b{target}"
        route = router.snapshot(time.monotonic())[target]
        assert route["cached_blocks"] >= len(hashes)

        # The blocks move (evicted there, stored on another engine): so does the request.
        other = next(i for i in range(3) if i not in (target,))
        await publisher.publish(
            PREFIX_DIGEST_TYPE,
            {
                f"e{target}": PrefixDigest(f"e{target}", "", 2, 2, True, 16).encode(),
                f"e{other}": PrefixDigest(
                    f"e{other}", "", 1, 1, True, 16, added=tuple(hashes)
                ).encode(),
            },
        )
        await until(
            feed,
            lambda: [e["digest_blocks"] for e in router.snapshot(time.monotonic())][target] == 0,
        )
        await until(
            feed,
            lambda: router.snapshot(time.monotonic())[other]["digest_blocks"] == len(hashes),
        )
        r = await complete(session, s, system + "Question: where is my refund?")
        assert r["backend"] == f"b{other}"


async def test_a_sidecar_joining_after_the_full_digest_gets_its_base(
    plane: ControlPlane,
    publisher: Publisher,
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    """The engine's full digest and a delta on it were both published before the sidecar
    subscribed: the control plane holds only the delta, and sends the base first (else the
    sidecar would know nothing of the engine's cache until the agent's next resync)."""
    bs = [await backends(f"b{i}") for i in range(2)]
    await publish(publisher, {f"e{i}": engine_state(b) for i, b in enumerate(bs)})
    hashes = block_hashes("Shared system prompt of the late joiner. " * 40, MODEL, "", 64)
    half = len(hashes) // 2
    full = PrefixDigest("e1", "ep", 1, 1, True, 16, added=tuple(hashes[:half]))
    delta = PrefixDigest("e1", "ep", 2, 1, False, 16, added=tuple(hashes[half:]))
    await publisher.publish(PREFIX_DIGEST_TYPE, {"e1": full.encode()})
    await publisher.publish(PREFIX_DIGEST_TYPE, {"e1": delta.encode()})
    held = plane.cache.get(PREFIX_DIGEST_TYPE, "e1")
    assert held is not None and held.body == delta.encode()

    cfg = sidecar_config(
        [b.url for b in bs],
        routing={"policy": "meshd"},
        control_plane={"addresses": [f"127.0.0.1:{plane.port}"], "stale_after_s": 5.0},
    )
    s = await sidecar(cfg)
    feed = feed_of(s)
    router = s.routers["default"]
    await until(feed, lambda: router.snapshot(time.monotonic())[1]["digest_blocks"] == len(hashes))
    assert feed.stats.digests_ignored == 0
    assert plane.stats.digest_bases_sent == 1


async def test_killed_control_plane_leaves_the_sidecar_serving(
    rig: Rig, plane: ControlPlane, publisher: Publisher
) -> None:
    bs, s = rig
    feed = feed_of(s)
    router = s.routers["default"]
    await publish(publisher, {"e1": engine_state(bs[1], draining=True)})
    await until(
        feed, lambda: router.snapshot(time.monotonic())[1]["ineligible_reason"] == "draining"
    )
    await plane.stop(0)
    await until(feed, lambda: not feed.subscriber.connected)
    # Static stability: the last known state holds (e1 still kept out) and nothing fails.
    served = await spread(s, 6, "outage")
    assert "b1" not in served and sum(served.values()) == 6
    # Once stale the report stops counting: the sidecar routes on its own observations.
    await poll(lambda: feed.health()["stale"])
    # Said on /readyz, and not counted against readiness (the sidecar still routes).
    async with aiohttp.ClientSession() as session, session.get(url(s, "/readyz", "admin")) as r:
        ready = await r.json()
    assert r.status == 200 and ready["control_plane"]["stale"] is True
    assert ready["control_plane"]["connected"] is False
    assert s.control_feed is feed
    await poll(lambda: router.snapshot(time.monotonic())[1]["ineligible_reason"] is None)
    # b1 is back in rotation: 24 unrelated prompts reach all three (12 left one out in a
    # full run, where the hash and calibration depend on timing: (2/3)^12 per endpoint).
    assert sorted(await spread(s, 24, "stale")) == ["b0", "b1", "b2"]

    async with aiohttp.ClientSession() as session, session.get(url(s, "/metrics", "admin")) as r:
        text = await r.text()
    assert "meshd_control_plane_connected 0.0" in text
    assert "meshd_control_plane_stale 1.0" in text
    assert 'meshd_control_plane_updates_total{type="endpoint_state"}' in text
    applying = re.search(r"^meshd_control_plane_apply_cpu_seconds_total (\S+)$", text, re.M)
    assert applying is not None
    assert 0 < float(applying.group(1)) == feed.subscriber.stats.apply_cpu_s
    reading = re.search(r"^meshd_control_plane_read_cpu_seconds_total (\S+)$", text, re.M)
    assert reading is not None
    assert (
        0 < float(reading.group(1)) == feed.subscriber.stats.read_cpu_s < float(applying.group(1))
    )
    assert feed.health()["connected"] is False and feed.health()["disconnects"] == 1


async def test_report_renewed_while_connected_and_removal_forgets_it(
    rig: Rig, plane: ControlPlane, publisher: Publisher
) -> None:
    bs, s = rig
    feed = feed_of(s)
    router = s.routers["default"]
    await publish(publisher, {"e2": engine_state(bs[2], healthy=False)})
    await until(
        feed, lambda: router.snapshot(time.monotonic())[2]["ineligible_reason"] == "unhealthy"
    )
    # Nothing new is published for longer than stale_after_s: the feed renews the report
    # (the control plane vouches for it while the stream is open).
    start = time.monotonic()
    await poll(lambda: time.monotonic() - start > 1.5 * feed.stale_after_s)
    assert router.snapshot(time.monotonic())[2]["ineligible_reason"] == "unhealthy"
    assert feed.stats.refreshes > 0
    # The engine's resource removed (its agent went away): back to local observations.
    await publisher.publish(ENDPOINT_STATE_TYPE, {}, removed=["e2"])
    await until(feed, lambda: "e2" not in feed.engines())
    assert router.snapshot(time.monotonic())[2]["reported"] is None
    assert router.snapshot(time.monotonic())[2]["ineligible_reason"] is None


async def test_engine_of_another_sidecar_is_ignored(
    rig: Rig, plane: ControlPlane, publisher: Publisher
) -> None:
    _, s = rig
    feed = feed_of(s)
    before = feed.stats.unmatched
    await publish(publisher, {"elsewhere": EndpointState(address="10.9.9.9:8000", healthy=False)})
    await until(feed, lambda: feed.stats.unmatched > before)
    assert "elsewhere" not in feed.engines() and len(feed.engines()) == 3
    # Digests are asked for by name, for our engines only (as the control plane sees it).
    await plane.wait_until(lambda: any(i.type_url == PREFIX_DIGEST_TYPE for i in plane.streams()))
    (digests,) = [i for i in plane.streams() if i.type_url == PREFIX_DIGEST_TYPE]
    assert not digests.wildcard and digests.names == {"e0", "e1", "e2"}


@pytest.mark.parametrize("frames", [True, False])
async def test_mtls_feed(
    tmp_path: Path,
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    frames: bool,
) -> None:
    ca = certs.ca("meshd-ca")
    server_cert, server_key = certs.leaf(ca, "control-plane")
    client_cert, client_key = certs.leaf(ca, "sidecar")
    (tmp_path / "ca.pem").write_bytes(certs.pem(ca[1]))
    (tmp_path / "cert.pem").write_bytes(client_cert)
    (tmp_path / "key.pem").write_bytes(client_key)
    cp = ControlPlane()
    tls_config = TlsConfig(server_cert, server_key, certs.pem(ca[1]))
    port = await cp.start("127.0.0.1", 0, tls_config, publish_port=0)
    try:
        b = await backends("b0")
        cp.publish(ENDPOINT_STATE_TYPE, {"e0": engine_state(b, draining=True).encode()})
        tls = {
            "ca_file": str(tmp_path / "ca.pem"),
            "cert_file": str(tmp_path / "cert.pem"),
            "key_file": str(tmp_path / "key.pem"),
        }
        cfg = sidecar_config(
            [b.url],
            control_plane={"addresses": [f"127.0.0.1:{port}"], "tls": tls, "frames": frames},
        )
        s = await sidecar(cfg)
        feed = feed_of(s)
        await until(feed, lambda: "e0" in feed.engines())
        assert feed.subscriber.connected and cp.stats.streams_open == 1
        # Over the frames port the control plane advertised, with the same mTLS; or, with
        # control_plane.frames off, over gRPC.
        assert feed.health()["transport"] == ("frames" if frames else "grpc")

        bad = sidecar_config(
            [b.url],
            control_plane={
                "addresses": [f"127.0.0.1:{port}"],
                "tls": {**tls, "key_file": str(tmp_path / "missing.pem")},
            },
        )
        with pytest.raises(ConfigError, match=r"control_plane\.tls\.key_file"):
            ControlFeed(bad, s.routers, s.metrics)
    finally:
        await cp.stop(0)


async def test_balancer_policy_follows_reports_too(
    plane: ControlPlane,
    publisher: Publisher,
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    bs = [await backends(f"b{i}") for i in range(2)]
    await publish(publisher, {"e0": engine_state(bs[0]), "e1": engine_state(bs[1], draining=True)})
    cfg = sidecar_config(
        [b.url for b in bs],
        routing={"policy": "round-robin"},
        control_plane={"addresses": [f"127.0.0.1:{plane.port}"]},
    )
    s = await sidecar(cfg)
    feed = feed_of(s)
    await until(feed, lambda: len(feed.engines()) == 2)
    assert await spread(s, 6, "rr") == Counter({"b0": 6})


async def test_failover_backoff_is_quick_for_a_dead_first_replica(
    plane: ControlPlane,
    publisher: Publisher,
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    # The first address refuses connections: the feed moves on to the second at once.
    dead = ControlPlane()
    dead_port = await dead.start("127.0.0.1", 0)
    await dead.stop(0)
    b = await backends("b0")
    await publish(publisher, {"e0": engine_state(b)})
    cfg = sidecar_config(
        [b.url],
        control_plane={"addresses": [f"127.0.0.1:{dead_port}", f"127.0.0.1:{plane.port}"]},
    )
    s = await sidecar(cfg)
    feed = feed_of(s)
    await until(feed, lambda: "e0" in feed.engines())
    assert feed.subscriber.target == f"127.0.0.1:{plane.port}"
    assert feed.health()["failovers"] >= 1


async def test_a_restarted_engine_ramps_back_in(rig: Rig, publisher: Publisher) -> None:
    bs, s = rig
    feed = feed_of(s)
    router = s.routers["default"]
    await publish(publisher, {"e1": engine_state(bs[1], epoch="boot-1")})
    await until(feed, lambda: feed.stats.updates[ENDPOINT_STATE_TYPE] >= 4)
    assert [e["ramp"] for e in router.snapshot(time.monotonic())] == [1.0, 1.0, 1.0]
    # A new epoch: the engine restarted with a cold cache, so slow start weighs it down.
    await publish(publisher, {"e1": engine_state(bs[1], epoch="boot-2")})
    await until(feed, lambda: router.snapshot(time.monotonic())[1]["ramp"] < 1.0)
    ramps = [e["ramp"] for e in router.snapshot(time.monotonic())]
    assert ramps[0] == ramps[2] == 1.0 and 0.0 < ramps[1] < 0.5
