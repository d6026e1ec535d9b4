"""The control plane holds each PrefixDigest once and still delivers every block (issue #23,
loadtest/xds_memory_bench.py): frames assembled around the cache's body are the protobuf
messages they stand for, the body itself shared (not copied) by the frames and the digest
bases; responses are bounded by max_response_bytes and every block still reaches every
subscriber, on every path (named, lockstep, a late joiner given bases); and over real gRPC
a burst of full digests larger than a client's default 4 MiB receive limit arrives."""

from __future__ import annotations

import asyncio
import random

import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_xds_digest_bases import Client, Engine

from xds.cache import Resource, resource_version
from xds.client import Backoff, Publisher, Subscriber
from xds.eds import CLA_TYPE
from xds.resources import (
    ENDPOINT_STATE_TYPE,
    PREFIX_DIGEST_TYPE,
    PrefixDigest,
    decode_prefix_digest,
)
from xds.server import (
    SPLIT_BODY_BYTES,
    ControlPlane,
    ServerLimits,
    _delta_frame,
    _Push,
    _sotw_frame,
    _Subscription,
    frame_size,
)

T = PREFIX_DIGEST_TYPE


# -- frames -------------------------------------------------------------------------------


def _protobuf_delta(r: Resource) -> bytes:
    msg = pb.DeltaDiscoveryResponse()
    res = msg.resources.add(name=r.name, version=r.version)
    res.resource.type_url = r.type_url
    res.resource.value = r.body
    out: bytes = msg.SerializeToString(deterministic=True)
    return out


def _protobuf_sotw(r: Resource) -> bytes:
    msg = pb.DiscoveryResponse()
    if r.type_url == CLA_TYPE:
        any_ = msg.resources.add(type_url=r.type_url, value=r.body)
    else:
        inner = pb.Resource(name=r.name, version=r.version)
        inner.resource.type_url = r.type_url
        inner.resource.value = r.body
        any_ = msg.resources.add(
            type_url="type.googleapis.com/envoy.service.discovery.v3.Resource",
            value=inner.SerializeToString(deterministic=True),
        )
    del any_
    out: bytes = msg.SerializeToString(deterministic=True)
    return out


@given(
    name=st.text(min_size=1, max_size=40),
    body=st.one_of(
        st.binary(max_size=64),
        st.integers(SPLIT_BODY_BYTES - 2, SPLIT_BODY_BYTES + 300_000).map(
            lambda n: random.Random(n).randbytes(n)
        ),
    ),
    type_url=st.sampled_from([T, ENDPOINT_STATE_TYPE, CLA_TYPE]),
)
@settings(max_examples=150, deadline=None)
def test_a_frame_is_the_protobuf_message_and_shares_a_large_body(
    name: str, body: bytes, type_url: str
) -> None:
    r = Resource(type_url, name, body, resource_version(body))
    delta, sotw = _delta_frame(r), _sotw_frame(r)
    assert b"".join(delta) == _protobuf_delta(r)
    assert b"".join(sotw) == _protobuf_sotw(r)
    assert frame_size(delta) == len(_protobuf_delta(r))
    for frame in (delta, sotw):
        if len(body) >= SPLIT_BODY_BYTES:
            assert frame[1] is body  # the cache's bytes, not a copy
        else:
            assert len(frame) == 1


# -- one copy -----------------------------------------------------------------------------


class BigEngine(Engine):
    def grow(self, n: int) -> None:
        self.blocks.update(self.rng.getrandbits(64) for _ in range(n))


def test_a_digest_body_is_held_once_by_cache_frames_and_bases() -> None:
    cp = ControlPlane(eds=False)
    e = BigEngine("eng-a", random.Random(1))
    e.grow(2000)  # 16 KB of hashes: frames share it
    cp.publish(T, {e.name: e.digest(full=True)})
    base = cp.cache.get(T, e.name)
    assert base is not None and len(base.body) >= SPLIT_BODY_BYTES
    early = Client(cp, 0, [e.name], delta=True)
    cp.flush()
    assert early.receive()
    early.ack()
    e.churn()
    cp.publish(T, {e.name: e.digest(full=False)})
    late = Client(cp, 1, None, delta=True)
    cp.flush()
    assert late.receive()  # the base first
    chain = cp._digest_bases._chains[e.name]
    assert chain.base is base
    frame, _ = chain.delta_frame()
    assert frame[1] is base.body
    assert e.name not in cp._frames.delta_table(T)  # the old base's frame went at the flush
    assert late.holds(e) == frozenset(e.base)
    late.ack()
    assert late.receive()  # then the delta
    assert late.holds(e) == frozenset(e.blocks)
    hit = cp._frames.delta_table(T)[e.name]
    assert hit[0] is cp.cache.get(T, e.name) and len(hit[1]) == 1  # small: joined


# -- bounded responses, every block delivered ---------------------------------------------


class SizedClient(Client):
    """test_xds_digest_bases's client (it applies digests as the sidecar does), keeping
    the responses it took."""

    def __init__(self, cp: ControlPlane, k: int, names: list[str] | None, delta: bool) -> None:
        super().__init__(cp, k, names, delta)
        self.pushes: list[_Push] = []
        take = self.stream.next_push

        def recording(sub: _Subscription) -> _Push | None:
            push = take(sub)
            if push is not None:
                self.pushes.append(push)
            return push

        self.stream.next_push = recording  # type: ignore[method-assign]

    @property
    def last_size(self) -> int:
        return len(self.pushes[-1].payload)


def _settle(cp: ControlPlane, clients: list[SizedClient], limit: int) -> None:
    """Flush and let every client take and answer what is due until nothing is, checking
    each response's size: at most `limit` of resources unless it carries one alone."""
    for _ in range(200):
        cp.flush()
        took = False
        for c in clients:
            c.ack()
            while True:
                n = len(c.received)
                before = len(c.unanswered)
                if not c.receive():
                    break
                took = True
                assert len(c.unanswered) == before + 1
                carried = len(c.received) - n
                size = c.last_size
                assert carried <= 1 or size <= limit + 256, (carried, size, limit)
                c.ack()
        if not took and not cp._dirty:
            return
    raise AssertionError("the clients never settled")


@given(
    sizes=st.lists(st.integers(0, 1500), min_size=1, max_size=8),
    limit=st.integers(1, 30_000),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_block_reaches_every_subscriber_through_bounded_responses(
    sizes: list[int], limit: int, seed: int
) -> None:
    rng = random.Random(seed)
    cp = ControlPlane(eds=False, limits=ServerLimits(max_response_bytes=limit))
    engines = [BigEngine(f"eng-{i}", rng) for i in range(len(sizes))]
    names = [e.name for e in engines]
    clients: list[SizedClient] = [
        SizedClient(cp, 0, names, delta=True),  # named, from the start
        SizedClient(cp, 1, None, delta=True),  # wildcard: lockstep once in step
        SizedClient(cp, 2, None, delta=True),
    ]
    for e, n in zip(engines, sizes, strict=True):
        e.grow(n)
        cp.publish(T, {e.name: e.digest(full=True)})
    _settle(cp, clients, limit)
    for _ in range(3):  # deltas, resyncs, a restart; a late joiner each round
        for e in engines:
            e.churn()
            roll = rng.random()
            if roll < 0.1:
                e.restart()
                e.grow(rng.randrange(200))
                cp.publish(T, {e.name: e.digest(full=True)})
            else:
                cp.publish(T, {e.name: e.digest(full=roll < 0.3)})
        clients.append(SizedClient(cp, len(clients), rng.choice([None, names]), delta=True))
        _settle(cp, clients, limit)
    for c in clients:
        for e in engines:
            assert c.holds(e) == frozenset(e.blocks), (c.stream.peer, e.name)


def test_a_flush_larger_than_a_response_is_split_and_members_share_the_bytes() -> None:
    limit = 40_000
    cp = ControlPlane(eds=False, limits=ServerLimits(max_response_bytes=limit))
    engines = [BigEngine(f"eng-{i}", random.Random(i)) for i in range(12)]
    members = [SizedClient(cp, k, None, delta=True) for k in range(3)]
    _settle(cp, members, limit)
    assert all(c.sub.lockstep is not None for c in members)
    for e in engines:
        e.grow(1000)  # ~8 KB each: ~100 KB in one flush, over the limit
        cp.publish(T, {e.name: e.digest(full=True)})
    cp.flush()
    backlog = members[0].sub.backlog
    assert len(backlog) > 1 and all(b.size <= limit + 256 for b in backlog)
    assert all(c.receive() for c in members)
    first = members[0].pushes[-1]
    # One response, the same bytes object, for every member (one nonce shared).
    assert all(c.pushes[-1].payload is first.payload for c in members)
    _settle(cp, members, limit)
    for c in members:
        for e in engines:
            assert c.holds(e) == frozenset(e.blocks)


# -- over gRPC ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_burst_of_full_digests_reaches_a_client_with_grpcs_default_limit() -> None:
    """16 full digests of 40,000 blocks (5.1 MB) published at once: a client that keeps
    gRPC's default 4 MiB receive limit (set here explicitly) gets every block. Before
    max_response_bytes they went as one 5.1 MB response, which the client refused
    (RESOURCE_EXHAUSTED) at every reconnect."""
    from loadtest.xds_scale_bench import digest_body, engine_name

    plane = ControlPlane(eds=False)
    await plane.start("127.0.0.1", 0)
    names = [engine_name(i) for i in range(16)]
    got: dict[str, PrefixDigest] = {}
    sub = Subscriber(
        f"127.0.0.1:{plane.port}",
        {T: names},
        channel_options=[("grpc.max_receive_message_length", 4 * 2**20)],
        backoff=Backoff(base_s=0.02, max_s=0.2),
        on_update=lambda u: got.update({n: e.value for n, e in u.changed.items()}),
    )
    pub = Publisher(f"127.0.0.1:{plane.port}")
    try:
        for j in range(0, 16, 4):
            await pub.publish(T, {engine_name(i): digest_body(i, 40_000) for i in range(j, j + 4)})
        sub.start()
        await asyncio.wait_for(sub.wait_until(lambda: len(got) == 16), 30)
        for i, name in enumerate(names):
            assert got[name] == decode_prefix_digest(digest_body(i, 40_000))
        assert sub.stats.nacks == 0
    finally:
        await sub.close()
        await pub.close()
        await plane.stop(0)
