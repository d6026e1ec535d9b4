"""xds/client.py against a real control plane: state kept through a control-plane restart
and resumed with only the changes, NACK of a malformed resource, unsubscription, a
subscriber that never reads, and mTLS refusing a wrong client certificate; each over gRPC
and over the frames port (tests/test_xds_subscribe_frames.py: what is its own)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import certs
import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb
from grpc import aio
from test_xds_protocol import RawStream, T, state

from xds.client import Backoff, Subscriber, Update
from xds.resources import EndpointState
from xds.server import ControlPlane, TlsConfig

FAST = Backoff(base_s=0.02, max_s=0.2)


@pytest.fixture(params=["grpc", "frames"])
async def cp(request: pytest.FixtureRequest) -> AsyncIterator[ControlPlane]:
    """A control plane with (frames: the subscriber moves to its frames port) or without
    a frames port (gRPC: the subscriber stays there)."""
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0, publish_port=0 if request.param == "frames" else None)
    yield plane
    await plane.stop(0)


def make_sub(
    port: int, names: list[str] | None = None, **kw: object
) -> tuple[Subscriber, list[Update]]:
    updates: list[Update] = []
    sub = Subscriber(
        f"127.0.0.1:{port}",
        {T: names},
        backoff=FAST,
        on_update=updates.append,
        rng=random.Random(1),
        **kw,  # type: ignore[arg-type]
    )
    sub.start()
    return sub, updates


def transport(cp: ControlPlane) -> str:
    """What a subscriber to `cp` follows it over."""
    return "frames" if cp.publish_port else "grpc"


def running(sub: Subscriber, name: str) -> int | None:
    v = sub.get(T, name)
    return None if v is None else v.requests_running


async def test_restart_keeps_state_and_resumes_with_changes_only(cp: ControlPlane) -> None:
    cp.cache.update(T, {n: state(n) for n in ("e1", "e2", "e3")})
    sub, updates = make_sub(cp.port)
    try:
        await sub.wait_until(lambda: len(sub.entries(T)) == 3)
        assert sub.connected and isinstance(sub.get(T, "e1"), EndpointState)
        assert sub.transport == transport(cp) and sub.stats.connects == 1
        assert sub.last_update_age_s is not None and sub.stale_for_s == 0.0
        port = cp.port
        await cp.stop(0)
        await sub.wait_until(lambda: not sub.connected)
        # Static stability: the last known state stays, marked as unconfirmed.
        assert set(sub.entries(T)) == {"e1", "e2", "e3"}
        assert sub.stale_for_s >= 0.0 and sub.stats.disconnects == 1

        cp2 = ControlPlane()
        cp2.cache.update(T, {"e1": state("e1"), "e2": state("e2", 7), "e4": state("e4")})
        await cp2.start("127.0.0.1", port)
        try:
            updates.clear()
            await sub.wait_until(lambda: sub.connected and "e4" in sub.entries(T))
            # Only what differs crossed the wire: e2 changed, e4 new, e3 gone; e1 not re-sent.
            assert len(updates) == 1
            assert set(updates[0].changed) == {"e2", "e4"}
            assert updates[0].removed == {"e3"}
            assert running(sub, "e2") == 7 and set(sub.entries(T)) == {"e1", "e2", "e4"}
            assert cp2.stats.responses[T] == 1
        finally:
            await cp2.stop(0)
    finally:
        await sub.close()


async def test_malformed_resource_nacked_not_applied(cp: ControlPlane) -> None:
    cp.cache.update(T, {"e1": state("e1"), "e2": state("e2")})
    sub, updates = make_sub(cp.port)
    try:
        await sub.wait_until(lambda: len(sub.entries(T)) == 2)
        assert sub.transport == transport(cp)
        # A resource that bypassed validation (written into the cache directly).
        cp.cache.set(T, "e1", b"\xc1garbage")
        await cp.wait_until(lambda: cp.stats.nacks[T] == 1)
        assert sub.stats.nacks == 1 and "e1" in sub.stats.last_nack
        assert "e1" in cp.stats.last_nack[T]
        assert running(sub, "e1") == 0  # the last good version stays
        cp.cache.set(T, "e2", state("e2", 3))
        await sub.wait_until(lambda: running(sub, "e2") == 3)
        # The NACKed version was not re-sent with the next update.
        assert set(updates[-1].changed) == {"e2"}
        cp.cache.set(T, "e1", state("e1", 9))
        await sub.wait_until(lambda: running(sub, "e1") == 9)
        assert sub.connected
    finally:
        await sub.close()


async def test_unsubscribe(cp: ControlPlane) -> None:
    cp.cache.update(T, {"a": state("a"), "b": state("b")})
    sub, updates = make_sub(cp.port, ["a", "b"])
    try:
        await sub.wait_until(lambda: len(sub.entries(T)) == 2)
        assert sub.transport == transport(cp)
        await sub.unsubscribe(T, ["b"])
        assert set(sub.entries(T)) == {"a"}
        await cp.wait_until(lambda: cp.streams()[0].names == {"a"})
        cp.cache.set(T, "b", state("b", 1))
        cp.cache.set(T, "a", state("a", 1))
        await sub.wait_until(lambda: running(sub, "a") == 1)
        assert set(updates[-1].changed) == {"a"} and "b" not in sub.entries(T)
        await sub.subscribe(T, ["b"])
        await sub.wait_until(lambda: running(sub, "b") == 1)
    finally:
        await sub.close()


async def test_subscriber_that_never_reads_does_not_stall_others(cp: ControlPlane) -> None:
    names = [f"e{i}" for i in range(10)]
    cp.cache.update(T, {n: state(n) for n in names})
    async with aio.insecure_channel(f"127.0.0.1:{cp.port}") as ch:
        slow = RawStream(ch)
        await slow.send(pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["*"]))
        # (The push, not a request, makes this true: wait_until must wake on pushes too;
        # it hung in CI when the request was read before the push went out.)
        async with asyncio.timeout(15):
            await cp.wait_until(lambda: any(s.unacked == 1 for s in cp.streams()))
        sub, _ = make_sub(cp.port)
        try:
            await sub.wait_until(lambda: len(sub.entries(T)) == 10)
            for rnd in range(1, 6):
                for n in names:
                    cp.cache.set(T, n, state(n, rnd))

                # The live subscriber keeps up with every round.
                def caught_up(r: int = rnd) -> bool:
                    return all(running(sub, n) == r for n in names)

                await sub.wait_until(caught_up)
            slow_info = next(s for s in cp.streams() if s.unacked == 1 and s.pending)
            # 50 updates wait for the silent client as 10: the latest of each resource.
            assert slow_info.pending == 10
            assert cp.stats.coalesced[T] == 40
        finally:
            await sub.close()
        slow.call.cancel()


async def test_wait_until_wakes_on_a_push_to_a_client_that_never_answers(
    cp: ControlPlane,
) -> None:
    cp.cache.update(T, {"e0": state("e0")})
    async with aio.insecure_channel(f"127.0.0.1:{cp.port}") as ch:
        # Waiting before the request: it is read (one wake-up, nothing unacked yet), then
        # the push goes out and only that can make the predicate true.
        waiting = asyncio.ensure_future(
            cp.wait_until(lambda: any(s.unacked == 1 for s in cp.streams()))
        )
        await asyncio.sleep(0)
        slow = RawStream(ch)
        await slow.send(pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["*"]))
        async with asyncio.timeout(10):
            await waiting
        slow.call.cancel()


# -- mTLS -------------------------------------------------------------------------------


async def test_mtls_refuses_wrong_client_certificate() -> None:
    ca, rogue_ca = certs.ca("meshd-ca"), certs.ca("rogue-ca")
    server_cert, server_key = certs.leaf(ca, "control-plane")
    plane = ControlPlane()
    plane.cache.set(T, "e1", state("e1"))
    port = await plane.start(
        "127.0.0.1", 0, TlsConfig(server_cert, server_key, client_ca=certs.pem(ca[1]))
    )
    target = f"127.0.0.1:{port}"
    try:
        good_cert, good_key = certs.leaf(ca, "sidecar")
        good = Subscriber(
            target,
            {T: None},
            credentials=grpc.ssl_channel_credentials(certs.pem(ca[1]), good_key, good_cert),
            backoff=FAST,
        )
        good.start()
        try:
            await good.wait_until(lambda: good.get(T, "e1") is not None)
        finally:
            await good.close()

        for key, cert in (certs.leaf(rogue_ca, "sidecar")[::-1], (None, None)):
            creds = grpc.ssl_channel_credentials(certs.pem(ca[1]), key, cert)
            async with aio.secure_channel(target, creds) as ch:
                s = RawStream(ch)
                with pytest.raises(aio.AioRpcError) as info:
                    await s.send(pb.DeltaDiscoveryRequest(type_url=T))
                    await s.recv()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert plane.stats.streams_total == 1  # only the good client got a stream
    finally:
        await plane.stop(0)


# -- replicas and subscriptions by name -----------------------------------------------------


async def test_failover_to_another_replica_resumes_with_changes_only(cp: ControlPlane) -> None:
    other = ControlPlane()
    await other.start("127.0.0.1", 0)
    try:
        for plane in (cp, other):
            plane.cache.update(T, {"e1": state("e1"), "e2": state("e2")})
        updates: list[Update] = []
        sub = Subscriber(
            [f"127.0.0.1:{cp.port}", f"127.0.0.1:{other.port}"],
            {T: None},
            backoff=FAST,
            on_update=updates.append,
            rng=random.Random(1),
        )
        sub.start()
        try:
            await asyncio.wait_for(sub.wait_until(lambda: len(sub.entries(T)) == 2), 10)
            assert sub.target == f"127.0.0.1:{cp.port}"
            other.cache.set(T, "e2", state("e2", 5))  # only the replica we fail over to
            updates.clear()
            await cp.stop(0)
            await asyncio.wait_for(sub.wait_until(lambda: running(sub, "e2") == 5), 10)
            assert sub.connected and sub.target == f"127.0.0.1:{other.port}"
            assert sub.stats.failovers == 1 and sub.stats.disconnects == 1
            # Versions are content hashes: the other replica sent only what differs.
            assert [set(u.changed) for u in updates] == [{"e2"}]
        finally:
            await sub.close()
    finally:
        await other.stop(0)


async def test_a_type_with_no_names_is_not_asked_as_a_wildcard(cp: ControlPlane) -> None:
    from xds.resources import PREFIX_DIGEST_TYPE, PrefixDigest

    def digest(n: str) -> bytes:
        return PrefixDigest(n, "", 0, 0, True, 16, added=(1, 2)).encode()

    cp.cache.update(T, {"e1": state("e1")})
    cp.cache.update(PREFIX_DIGEST_TYPE, {"e1": digest("e1"), "e2": digest("e2")})
    sub = Subscriber(f"127.0.0.1:{cp.port}", {T: None, PREFIX_DIGEST_TYPE: ()}, backoff=FAST)
    sub.start()
    try:
        await asyncio.wait_for(sub.wait_until(lambda: "e1" in sub.entries(T)), 10)
        assert [i.type_url for i in cp.streams()] == [T]
        assert not sub.entries(PREFIX_DIGEST_TYPE)
        await sub.subscribe(PREFIX_DIGEST_TYPE, ["e1"])
        await asyncio.wait_for(sub.wait_until(lambda: "e1" in sub.entries(PREFIX_DIGEST_TYPE)), 10)
        (info,) = [i for i in cp.streams() if i.type_url == PREFIX_DIGEST_TYPE]
        assert not info.wildcard and info.names == {"e1"}
        assert set(sub.entries(PREFIX_DIGEST_TYPE)) == {"e1"}
    finally:
        await sub.close()
