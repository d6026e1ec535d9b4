"""xds/eds.py: the ClusterLoadAssignment per pool that the control plane derives from the
engines' EndpointState (health, weight from headroom, GPU locality and metadata), that it
changes only when something Envoy uses changes, and that it goes out over ADS (SotW and
delta) like any resource; plus the resource TTL that removes a silent agent's engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2 as pb
from grpc import aio
from test_xds_protocol import RawStream

from xds.cache import SnapshotCache
from xds.client import Publisher
from xds.eds import CLA_TYPE, METADATA_NAMESPACE, EdsView, weight
from xds.resources import ENDPOINT_STATE_TYPE as T
from xds.resources import PREFIX_DIGEST_TYPE, EndpointState, PrefixDigest
from xds.server import ControlPlane, ServerLimits


def hosts(cla: endpoint_pb2.ClusterLoadAssignment) -> dict[str, tuple[str, int, int, str]]:
    """port -> (health, weight, gpu locality, engine)"""
    out = {}
    for loc in cla.endpoints:
        for lb in loc.lb_endpoints:
            meta = lb.metadata.filter_metadata[METADATA_NAMESPACE]
            out[str(lb.endpoint.address.socket_address.port_value)] = (
                health_check_pb2.HealthStatus.Name(lb.health_status),
                lb.load_balancing_weight.value,
                loc.locality.sub_zone,
                meta["engine"],
            )
    return out


def test_assignment_per_pool_from_engine_state() -> None:
    cache = SnapshotCache()
    view = EdsView(cache)
    cache.update(
        T,
        {
            "a": EndpointState("10.0.0.1:8000", pool="p", gpu="H100", gpu_count=1).encode(),
            "b": EndpointState(
                "10.0.0.2:8001", pool="p", gpu="H100", gpu_count=1, kv_usage=0.75
            ).encode(),
            "c": EndpointState("10.0.0.3:8002", pool="p", gpu="A100", draining=True).encode(),
            "d": EndpointState("10.0.0.4:8003", pool="q", healthy=False).encode(),
            "named": EndpointState("engine-7.svc:8000", pool="p").encode(),
        },
    )
    assert view.pools() == ["p", "q"]
    p = view.assignment("p")
    assert p is not None and p.cluster_name == "p"
    assert hosts(p) == {
        "8000": ("HEALTHY", 32, "H100", "a"),
        "8001": ("HEALTHY", 10, "H100", "b"),  # 25 % KV left: a third of the weight
        "8002": ("DRAINING", 10, "A100", "c"),
    }
    q = view.assignment("q")
    assert q is not None and hosts(q) == {"8003": ("UNHEALTHY", 10, "unknown", "d")}
    assert view.skipped == {"named"}  # Envoy cannot use a host name from EDS
    meta = p.endpoints[1].lb_endpoints[0].metadata.filter_metadata[METADATA_NAMESPACE]
    assert meta["gpu"] == "H100" and meta["pool"] == "p" and meta["draining"] is False


def test_only_what_envoy_uses_changes_the_assignment() -> None:
    cache = SnapshotCache()
    view = EdsView(cache)
    base = EndpointState("10.0.0.1:8000", pool="p", gpu="H100", requests_running=2)
    cache.set(T, "a", base.encode())
    v0 = cache.get(CLA_TYPE, "p")
    assert v0 is not None
    # Load moving within a weight step: same assignment, no version change, no rebuild.
    rebuilds = view.rebuilds
    for running in (3, 5, 9):
        cache.set(T, "a", EndpointState(**{**_fields(base), "requests_running": running}).encode())
    assert view.rebuilds == rebuilds and cache.get(CLA_TYPE, "p") == v0
    # A queue forming moves the weight: a new version.
    cache.set(T, "a", EndpointState(**{**_fields(base), "requests_waiting": 6}).encode())
    v1 = cache.get(CLA_TYPE, "p")
    assert v1 is not None and v1.version != v0.version
    # The engine leaves: the pool stays, empty (Envoy drops its hosts), until dropped.
    cache.remove(T, "a")
    p = view.assignment("p")
    assert p is not None and not p.endpoints
    assert view.drop_empty("p") and cache.get(CLA_TYPE, "p") is None


def _fields(s: EndpointState) -> dict[str, object]:
    return {f: getattr(s, f) for f in s.__dataclass_fields__}


def test_weight_scales_with_gpus_and_headroom() -> None:
    idle = EndpointState("x:1", gpu="H100", gpu_count=1)
    assert weight(idle) == 32
    assert weight(EndpointState("x:1", gpu="H100", gpu_count=8)) == 254
    assert weight(EndpointState("x:1", gpu="H100", gpu_count=1, kv_usage=1.0)) == 1
    assert weight(EndpointState("x:1", gpu="B200")) > weight(idle) > weight(EndpointState("x:1"))


def test_engines_already_in_the_cache_are_served() -> None:
    cache = SnapshotCache()
    cache.set(T, "a", EndpointState("10.0.0.1:8000", pool="p").encode())
    view = EdsView(cache)
    assert view.pools() == ["p"]
    view.close()
    cache.set(T, "b", EndpointState("10.0.0.2:8000", pool="p").encode())
    a = view.assignment("p")
    assert a is not None and len(hosts(a)) == 1  # closed: no longer follows


@pytest.fixture
async def cp() -> AsyncIterator[ControlPlane]:
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0)
    yield plane
    await plane.stop(0)


async def test_assignment_over_ads_sotw_and_delta(cp: ControlPlane) -> None:
    pub = Publisher(f"127.0.0.1:{cp.port}")
    try:
        await pub.publish(T, {"a": EndpointState("127.0.0.1:9000", pool="p").encode()})
    finally:
        await pub.close()
    async with aio.insecure_channel(f"127.0.0.1:{cp.port}") as ch:
        sotw = RawStream(ch, delta=False)
        await sotw.send(pb.DiscoveryRequest(type_url=CLA_TYPE, resource_names=["p"]))
        resp = await sotw.recv()
        (any_cla,) = resp.resources
        assert any_cla.type_url == CLA_TYPE  # unwrapped, as Envoy expects for EDS
        cla = endpoint_pb2.ClusterLoadAssignment.FromString(any_cla.value)
        assert hosts(cla) == {"9000": ("HEALTHY", 10, "unknown", "a")}
        sotw.call.cancel()

        delta = RawStream(ch)
        await delta.send(
            pb.DeltaDiscoveryRequest(type_url=CLA_TYPE, resource_names_subscribe=["p"])
        )
        d = await delta.recv()
        (res,) = d.resources
        assert res.name == "p" and res.resource.type_url == CLA_TYPE
        await delta.send(pb.DeltaDiscoveryRequest(type_url=CLA_TYPE, response_nonce=d.nonce))
        cp.publish(T, {"a": EndpointState("127.0.0.1:9000", pool="p", healthy=False).encode()})
        d2 = await delta.recv()
        cla = endpoint_pb2.ClusterLoadAssignment.FromString(d2.resources[0].resource.value)
        assert hosts(cla)["9000"][0] == "UNHEALTHY"
        delta.call.cancel()


async def test_silent_engine_expires_with_its_digest() -> None:
    now = [0.0]
    plane = ControlPlane(limits=ServerLimits(resource_ttl_s=5.0), clock=lambda: now[0])
    digest = PrefixDigest("a", "", 0, 0, True, 16, added=(7,)).encode()
    plane.publish(T, {"a": EndpointState("10.0.0.1:1", pool="p").encode()})
    plane.publish(PREFIX_DIGEST_TYPE, {"a": digest})
    plane.publish(T, {"b": EndpointState("10.0.0.2:1", pool="p").encode()})
    now[0] = 4.0
    plane.publish(T, {"b": EndpointState("10.0.0.2:1", pool="p").encode()})  # a heartbeat
    assert plane.expire(4.0) == []
    now[0] = 6.0
    assert plane.expire(6.0) == ["a"]
    assert plane.cache.get(T, "a") is None and plane.cache.get(PREFIX_DIGEST_TYPE, "a") is None
    assert plane.cache.get(T, "b") is not None and plane.stats.expired == 1
    p = plane.eds.assignment("p") if plane.eds else None
    assert p is not None and set(hosts(p)) == {"1"} and len(p.endpoints[0].lb_endpoints) == 1
    # Resources written straight into the cache (not published) never expire.
    plane.cache.set(T, "c", EndpointState("10.0.0.3:1").encode())
    assert plane.expire(100.0) == ["b"] and plane.cache.get(T, "c") is not None


async def test_expiry_runs_on_its_own_while_serving() -> None:
    plane = ControlPlane(limits=ServerLimits(resource_ttl_s=0.2))
    await plane.start("127.0.0.1", 0)
    try:
        plane.publish(T, {"a": EndpointState("10.0.0.1:1").encode()})
        deadline = asyncio.get_running_loop().time() + 5.0
        while plane.cache.get(T, "a") is not None:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        assert plane.stats.expired == 1
    finally:
        await plane.stop(0)


def test_assembled_bytes_are_the_protobuf_encoding() -> None:
    from xds.eds import encode_assignment, entry_for

    states = {
        f"e{i}": EndpointState(
            f"10.0.0.{i}:80{i:02d}", pool="p", gpu=("H100", "A100", None)[i % 3], kv_usage=i / 10
        )
        for i in range(7)
    }
    entries = [e for n, s in states.items() if (e := entry_for(n, s)) is not None]
    raw = encode_assignment("p", entries)
    cla = endpoint_pb2.ClusterLoadAssignment.FromString(raw)
    assert cla.SerializeToString(deterministic=True) == raw
    assert [loc.locality.sub_zone for loc in cla.endpoints] == ["A100", "H100", "unknown"]
    assert sum(len(loc.lb_endpoints) for loc in cla.endpoints) == 7
    # And the view, which keeps the bytes per engine, serves the same bytes.
    cache = SnapshotCache()
    EdsView(cache)
    cache.update(T, {n: s.encode() for n, s in states.items()})
    r = cache.get(CLA_TYPE, "p")
    assert r is not None and r.body == raw
