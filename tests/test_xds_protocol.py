"""xds/server.py on the wire: version, nonce, ACK/NACK, subscriptions, removal, resumption
and publishing, driven message by message over a real grpcio server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb
from grpc import aio

from xds.cache import resource_version
from xds.client import Publisher
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState, ResourceError
from xds.server import ControlPlane

T = ENDPOINT_STATE_TYPE
DELTA = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
SOTW = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
# A guard against a hang, not a wait: every read is expected to complete at once.
READ_TIMEOUT_S = 5.0


def state(name: str, running: int = 0) -> bytes:
    return EndpointState(address=f"{name}:8000", pool="p", requests_running=running).encode()


class RawStream:
    """One ADS stream driven message by message."""

    def __init__(self, channel: aio.Channel, delta: bool = True) -> None:
        req, resp = (
            (pb.DeltaDiscoveryRequest, pb.DeltaDiscoveryResponse)
            if delta
            else (pb.DiscoveryRequest, pb.DiscoveryResponse)
        )
        self.call: Any = channel.stream_stream(
            DELTA if delta else SOTW,
            request_serializer=req.SerializeToString,
            response_deserializer=resp.FromString,
        )()

    async def send(self, msg: Any) -> None:
        await self.call.write(msg)

    async def recv(self) -> Any:
        return await asyncio.wait_for(self.call.read(), READ_TIMEOUT_S)


@pytest.fixture
async def cp() -> AsyncIterator[ControlPlane]:
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0)
    yield plane
    await plane.stop(0)


@pytest.fixture
async def channel(cp: ControlPlane) -> AsyncIterator[aio.Channel]:
    async with aio.insecure_channel(f"127.0.0.1:{cp.port}") as ch:
        yield ch


def names(resp: pb.DeltaDiscoveryResponse) -> dict[str, str]:
    return {r.name: r.version for r in resp.resources}


async def test_delta_version_nonce_ack_nack(cp: ControlPlane, channel: aio.Channel) -> None:
    cp.cache.update(T, {"a": state("a"), "b": state("b"), "c": state("c")})
    s = RawStream(channel)
    await s.send(pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["a", "b"]))
    r1 = await s.recv()
    assert names(r1) == {"a": resource_version(state("a")), "b": resource_version(state("b"))}
    assert r1.system_version_info == "1" and r1.nonce
    assert r1.resources[0].resource.type_url == T
    await s.send(pb.DeltaDiscoveryRequest(type_url=T, response_nonce=r1.nonce))
    await cp.wait_until(lambda: cp.stats.acks[T] == 1)

    cp.cache.set(T, "a", state("a", 1))
    cp.cache.set(T, "c", state("c", 1))  # not subscribed: never sent
    r2 = await s.recv()
    assert names(r2) == {"a": resource_version(state("a", 1))}
    assert r2.nonce != r1.nonce and r2.system_version_info == "3"

    # NACK: counted, detail kept, and the rejected version is not sent again; a later
    # change to another resource goes out alone.
    nack = pb.DeltaDiscoveryRequest(type_url=T, response_nonce=r2.nonce)
    nack.error_detail.message = "bad a"
    await s.send(nack)
    await cp.wait_until(lambda: cp.stats.nacks[T] == 1)
    assert cp.stats.last_nack[T] == "bad a"
    cp.cache.set(T, "b", state("b", 1))
    r3 = await s.recv()
    assert names(r3) == {"b": resource_version(state("b", 1))}

    # An ACK for a nonce not outstanding is stale: counted, harmless.
    await s.send(pb.DeltaDiscoveryRequest(type_url=T, response_nonce=r1.nonce))
    await cp.wait_until(lambda: cp.stats.stale_nonces == 1)
    await s.send(pb.DeltaDiscoveryRequest(type_url=T, response_nonce=r3.nonce))
    await cp.wait_until(lambda: cp.stats.acks[T] == 2)


async def test_delta_unsubscribe_remove_and_absent(cp: ControlPlane, channel: aio.Channel) -> None:
    cp.cache.update(T, {"a": state("a"), "b": state("b")})
    s = RawStream(channel)
    await s.send(pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["a", "b", "zz"]))
    r1 = await s.recv()
    assert set(names(r1)) == {"a", "b"}
    assert list(r1.removed_resources) == ["zz"]  # asked for, does not exist
    await s.send(
        pb.DeltaDiscoveryRequest(
            type_url=T, response_nonce=r1.nonce, resource_names_unsubscribe=["b"]
        )
    )
    await cp.wait_until(lambda: cp.streams()[0].names == {"a", "zz"})
    cp.cache.set(T, "b", state("b", 5))  # unsubscribed: nothing goes out
    cp.cache.remove(T, "a")
    r2 = await s.recv()
    assert not r2.resources and list(r2.removed_resources) == ["a"]


async def test_delta_wildcard_and_resume(cp: ControlPlane, channel: aio.Channel) -> None:
    cp.cache.update(T, {"a": state("a"), "b": state("b", 1), "d": state("d")})
    s = RawStream(channel)
    # A reconnecting client: holds a (current), b (old) and c (since removed).
    req = pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["*"])
    req.initial_resource_versions["a"] = resource_version(state("a"))
    req.initial_resource_versions["b"] = resource_version(state("b"))
    req.initial_resource_versions["c"] = resource_version(state("c"))
    await s.send(req)
    r1 = await s.recv()
    assert set(names(r1)) == {"b", "d"}
    assert list(r1.removed_resources) == ["c"]
    await s.send(pb.DeltaDiscoveryRequest(type_url=T, response_nonce=r1.nonce))
    cp.cache.set(T, "new", state("new"))  # wildcard: new names arrive
    r2 = await s.recv()
    assert set(names(r2)) == {"new"}


async def test_sotw_full_set_version_nack_and_stale_nonce(
    cp: ControlPlane, channel: aio.Channel
) -> None:
    cp.cache.update(T, {"a": state("a"), "b": state("b")})
    s = RawStream(channel, delta=False)
    await s.send(pb.DiscoveryRequest(type_url=T))  # empty names: wildcard
    r1 = await s.recv()
    assert r1.version_info == "1"
    got = {}
    for any_ in r1.resources:
        inner = pb.Resource()
        assert any_.Unpack(inner)
        got[inner.name] = inner.version
    assert got == {"a": resource_version(state("a")), "b": resource_version(state("b"))}
    await s.send(
        pb.DiscoveryRequest(type_url=T, version_info=r1.version_info, response_nonce=r1.nonce)
    )
    await cp.wait_until(lambda: cp.stats.acks[T] == 1)

    cp.cache.remove(T, "b")  # SotW: the full set without b is the removal
    r2 = await s.recv()
    assert r2.version_info == "2" and len(r2.resources) == 1
    nack = pb.DiscoveryRequest(type_url=T, version_info=r1.version_info, response_nonce=r2.nonce)
    nack.error_detail.message = "no"
    await s.send(nack)
    await cp.wait_until(lambda: cp.stats.nacks[T] == 1)
    # A request with an old nonce is superseded and ignored (no response for it).
    await s.send(pb.DiscoveryRequest(type_url=T, resource_names=["a"], response_nonce=r1.nonce))
    await cp.wait_until(lambda: cp.stats.stale_nonces == 1)
    cp.cache.set(T, "a", state("a", 2))
    r3 = await s.recv()
    assert r3.version_info == "3" and len(r3.resources) == 1
    # Narrowing the subscription gets a response at once.
    await s.send(pb.DiscoveryRequest(type_url=T, resource_names=["b"], response_nonce=r3.nonce))
    r4 = await s.recv()
    assert len(r4.resources) == 0 and r4.version_info == "3"


async def test_publish_validates(cp: ControlPlane) -> None:
    pub = Publisher(f"127.0.0.1:{cp.port}")
    try:
        await pub.publish(T, {"e1": state("e1")})
        assert cp.cache.get(T, "e1") is not None
        with pytest.raises(ResourceError, match="e2"):
            await pub.publish(T, {"e2": b"\xc1not msgpack", "e3": state("e3")})
        # Refused as a whole, and the stream (and server) carry on.
        assert cp.cache.get(T, "e3") is None and cp.stats.publishes_rejected == 1
        with pytest.raises(ResourceError, match="not accepted"):
            await pub.publish("type.googleapis.com/unknown", {"x": b""})
        await pub.publish(T, {}, removed=["e1"])
        assert cp.cache.get(T, "e1") is None and cp.stats.publishes == 2
    finally:
        await pub.close()
