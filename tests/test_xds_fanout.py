"""xds/server.py's fan-out without the wire: responses assembled from shared frames are the
protobuf messages they stand for, lockstep subscribers (one batch per flush for all of
them) end up holding exactly what the cache holds whatever the interleaving of updates,
slow ACKs and subscription changes, changes reach streams once per flush (at most once per
push_interval_s), and the EDS view waits until someone follows it."""

from __future__ import annotations

import asyncio
import random

import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb

from xds.eds import CLA_TYPE
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState
from xds.server import MAX_BACKLOG, ControlPlane, ServerLimits, _Stream, _Subscription

T = ENDPOINT_STATE_TYPE


def state(i: int, seq: int = 0) -> bytes:
    return EndpointState(f"10.0.0.{i}:8000", pool=f"p{i % 3}", requests_running=seq).encode()


class Client:
    """A delta client on an in-process stream: applies each response to `held` (name ->
    version), as the subscriber does, and ACKs when told to."""

    def __init__(self, cp: ControlPlane, k: int, names: list[str] | None = None) -> None:
        self.stream = _Stream(cp, f"client-{k}", delta=True)
        cp._streams.add(self.stream)
        self.held: dict[str, str] = {}
        self.unanswered: list[str] = []
        self.names = names
        self.request(pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=names or ["*"]))

    @property
    def sub(self) -> _Subscription:
        return self.stream.subs[T]

    def request(self, req: pb.DeltaDiscoveryRequest) -> None:
        self.stream.on_delta_request(req)

    def receive(self) -> bool:
        """Take the response the stream would write now (flow control as its write loop)."""
        if len(self.sub.unacked) >= self.stream.cp.limits.max_unacked_per_type:
            return False
        push = self.stream.next_push(self.sub)
        if push is None:
            return False
        resp = pb.DeltaDiscoveryResponse.FromString(push.payload)
        assert resp.type_url == T and resp.nonce == push.nonce
        assert resp.system_version_info == push.version
        for r in resp.resources:
            assert r.resource.type_url == T
            self.held[r.name] = r.version
        for n in resp.removed_resources:
            self.held.pop(n, None)
        self.unanswered.append(resp.nonce)
        return True

    def ack(self) -> None:
        for nonce in self.unanswered:
            self.request(pb.DeltaDiscoveryRequest(type_url=T, response_nonce=nonce))
        self.unanswered.clear()


def settle(cp: ControlPlane, clients: list[Client]) -> None:
    """Every client answers and takes what is due until nothing is."""
    cp.flush()
    for c in clients:
        c.ack()
    while any([c.receive() for c in clients]):
        for c in clients:
            c.ack()


def table_versions(cp: ControlPlane, names: list[str] | None = None) -> dict[str, str]:
    return {n: r.version for n, r in cp.cache.resources(T).items() if names is None or n in names}


def test_a_response_from_frames_is_the_protobuf_message() -> None:
    cp = ControlPlane(eds=False)
    cp.cache.update(T, {f"e{i}": state(i) for i in range(5)})
    c = Client(cp, 0)
    push = c.stream.next_push(c.sub)
    assert push is not None
    expected = pb.DeltaDiscoveryResponse(type_url=T, system_version_info="1", nonce=push.nonce)
    for i in range(5):
        r = cp.cache.get(T, f"e{i}")
        assert r is not None
        res = expected.resources.add(name=r.name, version=r.version)
        res.resource.type_url, res.resource.value = T, r.body
    got = pb.DeltaDiscoveryResponse.FromString(push.payload)
    got_sorted = sorted(got.resources, key=lambda r: r.name)
    assert [r.SerializeToString() for r in got_sorted] == [
        r.SerializeToString() for r in expected.resources
    ]
    assert (got.type_url, got.system_version_info, got.nonce) == (T, "1", push.nonce)
    # The same version's frame is shared, not encoded again for the next subscriber.
    r0 = cp.cache.get(T, "e0")
    assert r0 is not None and cp._frames.delta(r0) is cp._frames.delta(r0)


def test_sotw_response_from_frames_wraps_meshd_types() -> None:
    cp = ControlPlane(eds=False)
    cp.cache.update(T, {"a": state(1)})
    s = _Stream(cp, "sotw", delta=False)
    s.on_sotw_request(pb.DiscoveryRequest(type_url=T))
    push = s.next_push(s.subs[T])
    assert push is not None
    resp = pb.DiscoveryResponse.FromString(push.payload)
    inner = pb.Resource.FromString(resp.resources[0].value)
    r = cp.cache.get(T, "a")
    assert r is not None and (inner.name, inner.version, inner.resource.value) == (
        "a",
        r.version,
        r.body,
    )
    assert resp.resources[0].type_url.endswith("discovery.v3.Resource")


@pytest.mark.parametrize("seed", range(6))
def test_lockstep_subscribers_hold_what_the_cache_holds(seed: int) -> None:
    rng = random.Random(seed)
    cp = ControlPlane(eds=False)
    names = [f"e{i}" for i in range(30)]
    cp.cache.update(T, {n: state(i) for i, n in enumerate(names)})
    clients = [Client(cp, k) for k in range(6)] + [Client(cp, 6, names=names[:10])]
    settle(cp, clients)
    joined = 0
    for step in range(150):
        # Some updates and removals (and re-adds), then a flush.
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(len(names))
            if rng.random() < 0.15:
                cp.cache.remove(T, names[i])
            else:
                cp.cache.set(T, names[i], state(i, step * 10 + rng.randrange(10)))
        cp.flush()
        for c in clients:
            roll = rng.random()
            if roll < 0.6:
                c.receive()
                if rng.random() < 0.2:  # a change not yet flushed when it answers
                    i = rng.randrange(len(names))
                    cp.cache.set(T, names[i], state(i, step * 10 + 9))
                if rng.random() < 0.7:
                    c.ack()  # else it stays unanswered a while: a slow client
            elif roll < 0.65 and c.names is None:
                # A wildcard client names a resource explicitly too, then drops it.
                n = rng.choice(names)
                c.request(pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=[n]))
                c.request(pb.DeltaDiscoveryRequest(type_url=T, resource_names_unsubscribe=[n]))
        joined = max(joined, sum(1 for c in clients if c.sub.lockstep is not None))
        if step % 25 == 24:
            settle(cp, clients)
            for c in clients:
                assert c.held == table_versions(cp, c.names), (step, c.stream.peer)
    settle(cp, clients)
    for c in clients:
        assert c.held == table_versions(cp, c.names)
    # The shared path was taken (an explicit-name client never joins it).
    assert joined >= 3
    assert clients[-1].sub.lockstep is None


def test_a_slow_member_gets_its_backlog_merged_then_leaves_when_far_behind() -> None:
    cp = ControlPlane(eds=False)
    cp.cache.update(T, {"a": state(1), "b": state(2), "c": state(3)})
    fast, slow = Client(cp, 0), Client(cp, 1)
    settle(cp, [fast, slow])
    assert fast.sub.lockstep is not None and slow.sub.lockstep is fast.sub.lockstep
    for rnd, name in enumerate(["a", "b", "a"], start=1):
        cp.cache.set(T, name, state(ord(name), rnd))
        cp.flush()
        assert fast.receive()
        fast.ack()
        if rnd == 1:
            assert slow.receive()  # then it does not answer
    cp.cache.remove(T, "c")
    cp.flush()
    assert fast.receive()
    fast.ack()
    assert len(slow.sub.backlog) == 3 and slow.sub.lockstep is not None
    slow.ack()
    push = slow.stream.next_push(slow.sub)
    assert push is not None and (push.resources, push.removed) == (2, 1)  # a once, b; c gone
    resp = pb.DeltaDiscoveryResponse.FromString(push.payload)
    assert sorted(r.name for r in resp.resources) == ["a", "b"]
    assert list(resp.removed_resources) == ["c"]
    slow.held.update({r.name: r.version for r in resp.resources})
    slow.held.pop("c")
    slow.unanswered.append(push.nonce)
    slow.ack()
    assert slow.held == fast.held == table_versions(cp)
    # Far behind: it leaves, keeps its backlog, and catches up alone.
    assert slow.receive() is False
    for rnd in range(MAX_BACKLOG + 2):
        cp.cache.set(T, "a", state(1, 100 + rnd))
        cp.flush()
        if rnd == 0:
            assert slow.receive()  # unanswered from here on
        fast.receive()
        fast.ack()
    assert slow.sub.lockstep is None and fast.sub.lockstep is not None
    settle(cp, [fast, slow])
    assert slow.held == fast.held == table_versions(cp)
    assert slow.sub.lockstep is fast.sub.lockstep  # idle and equal again: back in


def test_changes_reach_streams_once_per_flush_and_interval() -> None:
    async def main() -> None:
        cp = ControlPlane(eds=False, limits=ServerLimits(push_interval_s=30.0))
        c = Client(cp, 0)
        for i in range(20):
            cp.publish(T, {f"e{i}": state(i)})
        assert c.stream.next_push(c.sub) is not None  # the first subscription's response
        c.ack()
        calls: list[frozenset[str]] = []
        on_change = c.stream.on_change

        def counting(t: str, n: frozenset[str]) -> None:
            calls.append(n)
            on_change(t, n)

        c.stream.on_change = counting  # type: ignore[method-assign,assignment]
        for i in range(20):
            cp.publish(T, {f"e{i}": state(i, 1)})
        await asyncio.sleep(0)  # one loop turn: a flush was due at once (none before)
        assert len(calls) == 1 and len(calls[0]) == 20
        cp.publish(T, {"e0": state(0, 2)})
        handle = cp._flush_handle
        assert isinstance(handle, asyncio.TimerHandle)
        loop = asyncio.get_running_loop()
        assert handle.when() - loop.time() > 25.0  # the next one waits for the interval
        cp.flush()
        assert len(calls) == 2 and calls[1] == {"e0"}

    asyncio.run(main())


def test_eds_waits_until_an_envoy_subscribes() -> None:
    async def main() -> None:
        cp = ControlPlane()
        assert cp.eds is not None
        c = Client(cp, 0)
        before = cp.eds.rebuilds
        for i in range(9):
            cp.publish(T, {f"e{i}": state(i)})
        cp.flush()
        assert cp.eds.rebuilds == before and cp.eds.dirty  # no one follows the view
        envoy = _Stream(cp, "envoy", delta=True)
        cp._streams.add(envoy)
        envoy.on_delta_request(
            pb.DeltaDiscoveryRequest(type_url=CLA_TYPE, resource_names_subscribe=["p0", "p1"])
        )
        assert cp.eds.rebuilds == before + 3 and not cp.eds.dirty  # p0, p1, p2 at once
        push = envoy.next_push(envoy.subs[CLA_TYPE])
        assert push is not None and push.resources == 2
        down = EndpointState("10.0.0.0:8000", pool="p0", healthy=False).encode()
        cp.publish(T, {"e0": down})
        cp.flush()
        assert cp.eds.rebuilds == before + 4  # followed now: p0 rebuilt in the flush
        assert c.sub.lockstep is None or c.sub.backlog

    asyncio.run(main())
