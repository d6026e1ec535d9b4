"""The control plane's own spans (issue 9), against a real OTLP/gRPC receiver
(tests/otlp_receiver.py): a span per sampled publish (and every refused one) and per response
pushed,
open until the client answers it, a NACK on it as an attribute and an event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2 as pb
from grpc import aio
from otlp_receiver import OtlpReceiver

from meshd import telemetry as tm
from xds.client import Publisher
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState, ResourceError
from xds.server import ControlPlane, ServerLimits

T = ENDPOINT_STATE_TYPE
DELTA = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
READ_TIMEOUT_S = 5.0  # a guard against a hang: every read is expected at once


def state(name: str, running: int = 0) -> bytes:
    return EndpointState(address=f"{name}:8000", pool="p", requests_running=running).encode()


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture
async def traced(receiver: OtlpReceiver) -> AsyncIterator[tuple[ControlPlane, Any]]:
    provider = tm.setup_tracing("meshd-control-plane", receiver.endpoint, 1.0)
    plane = ControlPlane(limits=ServerLimits(publish_trace_every=1), tracer_provider=provider)
    await plane.start("127.0.0.1", 0)
    yield plane, provider
    await plane.stop(0)
    provider.shutdown()


async def recv(call: Any) -> pb.DeltaDiscoveryResponse:
    resp: pb.DeltaDiscoveryResponse = await asyncio.wait_for(call.read(), READ_TIMEOUT_S)
    return resp


async def test_publish_and_push_spans_with_a_nack(
    traced: tuple[ControlPlane, Any], receiver: OtlpReceiver
) -> None:
    plane, provider = traced
    target = f"127.0.0.1:{plane.port}"
    pub = Publisher(target)
    await pub.publish(T, {"a": state("a")})
    with pytest.raises(ResourceError):
        await pub.publish(T, {"bad": b"\xc1 not msgpack"})
    async with aio.insecure_channel(target) as ch:
        call: Any = ch.stream_stream(
            DELTA,
            request_serializer=pb.DeltaDiscoveryRequest.SerializeToString,
            response_deserializer=pb.DeltaDiscoveryResponse.FromString,
        )()
        first = pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["*"])
        first.node.CopyFrom(base_pb2.Node(id="sidecar-7"))
        await call.write(first)
        r1 = await recv(call)
        await call.write(pb.DeltaDiscoveryRequest(type_url=T, response_nonce=r1.nonce))
        await plane.wait_until(lambda: plane.stats.acks[T] == 1)
        await pub.publish(T, {"a": state("a", 3), "b": state("b")})
        r2 = await recv(call)
        nack = pb.DeltaDiscoveryRequest(type_url=T, response_nonce=r2.nonce)
        nack.error_detail.message = "b: cannot use it"
        await call.write(nack)
        await plane.wait_until(lambda: plane.stats.nacks[T] == 1)
        call.cancel()
    await pub.close()
    assert provider.force_flush(10_000)
    receiver.wait_for(5)
    by = receiver.by_name()

    publishes = by[tm.SPAN_XDS_PUBLISH]
    assert len(publishes) == 3
    ok1, bad, ok2 = sorted(publishes, key=lambda s: s.start_ns)
    assert ok1.service_name == "meshd-control-plane"
    assert ok1.attributes[tm.ATTR_XDS_TYPE_URL] == T
    assert ok1.attributes[tm.ATTR_XDS_RESOURCES] == 1 and ok1.attributes[tm.ATTR_XDS_CHANGED] == 1
    assert ok1.attributes[tm.ATTR_ENGINE] == "a"
    assert ok2.attributes[tm.ATTR_XDS_RESOURCES] == 2 and ok2.attributes[tm.ATTR_XDS_CHANGED] == 2
    assert int(ok2.attributes[tm.ATTR_XDS_VERSION]) > int(ok1.attributes[tm.ATTR_XDS_VERSION])
    assert bad.attributes[tm.ATTR_REASON].startswith("bad: ")  # the resource and why
    assert bad.attributes[tm.ATTR_XDS_CHANGED] == 0

    pushes = {s.attributes[tm.ATTR_XDS_NONCE]: s for s in by[tm.SPAN_XDS_PUSH]}
    acked, nacked = pushes[r1.nonce], pushes[r2.nonce]
    for span, resp in ((acked, r1), (nacked, r2)):
        assert span.attributes[tm.ATTR_XDS_NODE] == "sidecar-7"
        assert span.attributes[tm.ATTR_XDS_DELTA] is True
        assert span.attributes[tm.ATTR_XDS_RESOURCES] == len(resp.resources)
        assert span.attributes[tm.ATTR_XDS_VERSION] == resp.system_version_info
        assert span.end_ns >= span.start_ns
    assert tm.ATTR_XDS_NACK not in acked.attributes and not acked.events
    assert nacked.attributes[tm.ATTR_XDS_NACK] == "b: cannot use it"
    assert nacked.events == [(tm.EVENT_XDS_NACK, {tm.ATTR_XDS_NACK: "b: cannot use it"})]


async def test_publishes_are_sampled_and_refused_ones_always_traced(
    receiver: OtlpReceiver,
) -> None:
    provider = tm.setup_tracing("meshd-control-plane", receiver.endpoint, 1.0)
    plane = ControlPlane(limits=ServerLimits(publish_trace_every=3), tracer_provider=provider)
    await plane.start("127.0.0.1", 0)
    pub = Publisher(f"127.0.0.1:{plane.port}")
    try:
        for i in range(7):
            await pub.publish(T, {"a": state("a", i)})
        with pytest.raises(ResourceError):
            await pub.publish(T, {"bad": b"\xc1 not msgpack"})
    finally:
        await pub.close()
        await plane.stop(0)
        provider.shutdown()
    spans = sorted(receiver.by_name()[tm.SPAN_XDS_PUBLISH], key=lambda s: s.start_ns)
    # Accepted publishes 0, 3 and 6 of 7, and the refused one.
    assert [s.attributes.get(tm.ATTR_REASON) is None for s in spans] == [True, True, True, False]
    assert ServerLimits().publish_trace_every == 1000
