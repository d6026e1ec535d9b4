"""A sidecar's subscription over the control plane's frames port (xds/publish_frames.py,
xds/client.py): the subscriber moves there when the real control plane advertises it, gets
what a gRPC subscriber gets, and stays on (or goes back to) gRPC when the port cannot be
used; the server side ends a connection that sends what is no request, and a subscriber
that does not read holds up no one."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import certs
import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb

from xds.client import Backoff, Subscriber, tls_client_context
from xds.publish_frames import SUBSCRIBE_PREAMBLE, frame
from xds.resources import ENDPOINT_STATE_TYPE as T
from xds.resources import PREFIX_DIGEST_TYPE, EndpointState, PrefixDigest
from xds.server import ControlPlane, ServerLimits, TlsConfig

FAST = Backoff(base_s=0.02, max_s=0.2)


def state(name: str, running: int = 0) -> bytes:
    return EndpointState(address=f"{name}:8000", pool="p", requests_running=running).encode()


def running(sub: Subscriber, name: str) -> int | None:
    v = sub.get(T, name)
    return None if v is None else v.requests_running


@pytest.fixture
async def cp() -> AsyncIterator[ControlPlane]:
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0, publish_port=0)
    yield plane
    await plane.stop(0)


def subscriber(target: str, names: list[str] | None = None, **kw: object) -> Subscriber:
    sub = Subscriber(target, {T: names}, backoff=FAST, rng=random.Random(1), **kw)  # type: ignore[arg-type]
    sub.start()
    return sub


async def until(sub: Subscriber, predicate: object) -> None:
    async with asyncio.timeout(10):
        await sub.wait_until(predicate)  # type: ignore[arg-type]


async def test_the_subscriber_moves_to_frames_and_gets_what_grpc_gets(cp: ControlPlane) -> None:
    cp.cache.update(T, {f"e{i}": state(f"e{i}") for i in range(20)})
    target = f"127.0.0.1:{cp.port}"
    frames, grpc_only = subscriber(target), subscriber(target, frames=False)
    named = subscriber(target, ["e1", "e2", "nope"])
    try:
        for sub in (frames, grpc_only):
            await until(sub, lambda s=sub: len(s.entries(T)) == 20)
        await until(named, lambda: len(named.entries(T)) == 2)
        assert (frames.transport, grpc_only.transport, named.transport) == (
            "frames",
            "grpc",
            "frames",
        )
        rng = random.Random(7)
        for k in range(1, 40):
            name = f"e{rng.randrange(25)}"
            if rng.random() < 0.1:
                cp.cache.update(T, {}, removed=[name])
            else:
                cp.cache.set(T, name, state(name, k))
            if k % 5 == 0:
                await asyncio.sleep(0)
        cp.cache.set(T, "e1", state("e1", 1000))
        for sub in (frames, grpc_only, named):
            await until(sub, lambda s=sub: running(s, "e1") == 1000)
        want = {n: e.version for n, e in cp.cache.resources(T).items()}
        for sub in (frames, grpc_only):
            await until(sub, lambda s=sub: {n: e.version for n, e in s.entries(T).items()} == want)
        assert {n: e.value for n, e in frames.entries(T).items()} == {
            n: e.value for n, e in grpc_only.entries(T).items()
        }
        assert set(named.entries(T)) == {"e1", "e2"} & set(want)
        # Every response the control plane sent went where it was read (none to a gRPC
        # stream left for the frames port), and each was ACKed over the transport it took.
        sent = cp.stats.responses[T]
        got = sum(s.stats.responses for s in (frames, grpc_only, named))
        assert sent == got and frames.stats.nacks == 0
        await cp.wait_until(lambda: cp.stats.acks[T] == sent)
        assert frames.stats.connects == 1 and frames.stats.disconnects == 0
        assert frames.stats.frames_failures == 0 and cp.stats.streams_open == 3
        # The subscription changes over frames as over gRPC.
        await named.unsubscribe(T, ["e1"])
        await named.subscribe(T, ["e3"])
        await cp.wait_until(lambda: any(i.names == {"e2", "e3", "nope"} for i in cp.streams()))
        await until(named, lambda: "e3" in named.entries(T))
        assert "e1" not in named.entries(T)
    finally:
        for sub in (frames, grpc_only, named):
            await sub.close()
    await cp.wait_until(lambda: cp.stats.streams_open == 0)


async def test_a_restart_resumes_over_the_new_frames_port(cp: ControlPlane) -> None:
    cp.cache.update(T, {n: state(n) for n in ("e1", "e2", "e3")})
    sub = subscriber(f"127.0.0.1:{cp.port}")
    try:
        await until(sub, lambda: len(sub.entries(T)) == 3 and sub.transport == "frames")
        port, old_frames = cp.port, cp.publish_port
        await cp.stop(0)
        await until(sub, lambda: not sub.connected)
        cp2 = ControlPlane()
        cp2.cache.update(T, {"e1": state("e1"), "e2": state("e2", 7), "e4": state("e4")})
        await cp2.start("127.0.0.1", port, publish_port=0)
        try:
            assert cp2.publish_port != old_frames
            await until(sub, lambda: sub.connected and "e4" in sub.entries(T))
            # The old port refused (gRPC, which said where the new one is), then frames.
            assert sub.transport == "frames" and sub.stats.frames_failures == 1
            assert set(sub.entries(T)) == {"e1", "e2", "e4"} and running(sub, "e2") == 7
            assert cp2.stats.responses[T] == 1  # only what differs, once
        finally:
            await cp2.stop(0)
    finally:
        await sub.close()


async def test_a_restart_on_the_same_ports_is_followed_over_frames_again(
    cp: ControlPlane,
) -> None:
    # As in a cluster, where the Service's ports stay: while the control plane is away
    # the frames port fails too, which must not keep the subscriber off it once it is back.
    cp.cache.set(T, "e1", state("e1", 1))
    sub = subscriber(f"127.0.0.1:{cp.port}")
    try:
        await until(sub, lambda: running(sub, "e1") == 1 and sub.transport == "frames")
        port, frames_port = cp.port, cp.publish_port
        await cp.stop(0)
        await until(sub, lambda: not sub.connected)
        await until(sub, lambda: sub.stats.frames_failures >= 2)  # away: refused, again
        cp2 = ControlPlane()
        cp2.cache.set(T, "e1", state("e1", 2))
        await cp2.start("127.0.0.1", port, publish_port=frames_port)
        try:
            await until(sub, lambda: running(sub, "e1") == 2)
            assert sub.transport == "frames" and sub.connected
        finally:
            await cp2.stop(0)
    finally:
        await sub.close()


async def test_a_frames_port_out_of_reach_leaves_the_subscriber_on_grpc(
    cp: ControlPlane,
) -> None:
    assert cp._frame_server is not None
    cp._frame_server.close()  # still advertised, no longer answering
    cp.cache.set(T, "e1", state("e1", 1))
    sub = subscriber(f"127.0.0.1:{cp.port}")
    try:
        await until(sub, lambda: running(sub, "e1") == 1)
        # Tried twice, gRPC answering between (once might have been the control plane
        # coming back), then held off: gRPC.
        assert sub.transport == "grpc" and sub.stats.frames_failures == 2
        assert sub.stats.connects == 1 and sub.stats.connect_failures == 0
        cp.cache.set(T, "e1", state("e1", 2))
        await until(sub, lambda: running(sub, "e1") == 2)
        assert sub.transport == "grpc" and sub.stats.frames_failures == 2
    finally:
        await sub.close()


async def test_a_control_plane_without_the_port_is_followed_over_grpc() -> None:
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0)
    plane.cache.set(T, "e1", state("e1", 1))
    sub = subscriber(f"127.0.0.1:{plane.port}")
    try:
        await until(sub, lambda: running(sub, "e1") == 1)
        assert sub.transport == "grpc" and sub.stats.frames_failures == 0
    finally:
        await sub.close()
        await plane.stop(0)


async def test_mtls_over_frames_needs_the_ssl_context(tmp_path: Path) -> None:
    ca = certs.ca("meshd-ca")
    server_cert, server_key = certs.leaf(ca, "control-plane")
    plane = ControlPlane()
    plane.cache.set(T, "e1", state("e1", 1))
    tls = TlsConfig(server_cert, server_key, client_ca=certs.pem(ca[1]))
    port = await plane.start("127.0.0.1", 0, tls, publish_port=0)
    cert, key = certs.leaf(ca, "sidecar")
    for name, data in (("ca.pem", certs.pem(ca[1])), ("c.pem", cert), ("c.key", key)):
        (tmp_path / name).write_bytes(data)
    creds = grpc.ssl_channel_credentials(certs.pem(ca[1]), key, cert)
    ctx = tls_client_context(
        str(tmp_path / "ca.pem"), str(tmp_path / "c.pem"), str(tmp_path / "c.key")
    )
    with_ctx = subscriber(f"127.0.0.1:{port}", credentials=creds, ssl_context=ctx)
    without = subscriber(f"127.0.0.1:{port}", credentials=creds)
    try:
        for sub in (with_ctx, without):
            await until(sub, lambda s=sub: running(s, "e1") == 1)
        assert with_ctx.transport == "frames" and without.transport == "grpc"
        plane.cache.set(T, "e1", state("e1", 2))
        for sub in (with_ctx, without):
            await until(sub, lambda s=sub: running(s, "e1") == 2)
        # A client without a certificate the CA signed: refused over frames as well.
        (tmp_path / "ca-only").mkdir()
        refused = subscriber(
            f"127.0.0.1:{port}",
            credentials=creds,
            ssl_context=tls_client_context(str(tmp_path / "ca.pem"), None, None),
        )
        try:
            await until(refused, lambda: refused.stats.frames_failures == 2)
            await until(refused, lambda: running(refused, "e1") == 2)  # then gRPC
            assert refused.transport == "grpc"
        finally:
            await refused.close()
        assert with_ctx.stats.frames_failures == 0 and without.stats.frames_failures == 0
    finally:
        await with_ctx.close()
        await without.close()
        await plane.stop(0)


async def _raw(cp: ControlPlane, first: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", cp.publish_port)
    writer.write(first)
    return reader, writer


async def test_what_is_no_request_ends_the_connection(cp: ControlPlane) -> None:
    cp.cache.set(T, "e1", state("e1"))
    req = pb.DeltaDiscoveryRequest(type_url=T).SerializeToString()
    reader, writer = await _raw(cp, SUBSCRIBE_PREAMBLE + frame(req) + frame(b"\xff\xff junk"))
    async with asyncio.timeout(5):
        got = await reader.read()  # to EOF
    writer.close()
    assert got.startswith(SUBSCRIBE_PREAMBLE)  # answered, then closed
    await cp.wait_until(lambda: cp.stats.streams_open == 0 and not cp.streams())
    assert cp.stats.streams_total == 1


async def test_a_subscriber_that_does_not_read_holds_up_no_one() -> None:
    # Its first response larger than loopback's socket buffers (~16 MB here): the writer
    # must wait for the socket.
    plane = ControlPlane(limits=ServerLimits(max_response_bytes=32 * 2**20))
    await plane.start("127.0.0.1", 0, publish_port=0)

    def digest(n: str, seed: int) -> bytes:
        hashes = tuple(range(seed, seed + 250_000))  # ~2 MB each
        return PrefixDigest(n, "", 0, 0, True, 16, added=hashes).encode()

    names = [f"e{i}" for i in range(8)]
    plane.cache.update(T, {n: state(n) for n in names})
    plane.cache.update(PREFIX_DIGEST_TYPE, {n: digest(n, 0) for n in names})
    subscribe = pb.DeltaDiscoveryRequest(type_url=PREFIX_DIGEST_TYPE).SerializeToString()
    reader, writer = await _raw(plane, SUBSCRIBE_PREAMBLE + frame(subscribe))
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sub = Subscriber(f"127.0.0.1:{plane.port}", {T: None, PREFIX_DIGEST_TYPE: names}, backoff=FAST)
    sub.start()
    try:
        await until(sub, lambda: len(sub.entries(PREFIX_DIGEST_TYPE)) == 8)
        assert sub.transport == "frames"
        for k in range(1, 3):
            plane.cache.update(PREFIX_DIGEST_TYPE, {n: digest(n, k) for n in names})
            plane.cache.set(T, "e1", state("e1", k))
            await until(sub, lambda k=k: running(sub, "e1") == k)
        await until(
            sub,
            lambda: all(
                e.version == plane.cache.get(PREFIX_DIGEST_TYPE, n).version  # type: ignore[union-attr]
                for n, e in sub.entries(PREFIX_DIGEST_TYPE).items()
            ),
        )
        assert plane.stats.streams_open == 2
        assert plane._frame_server is not None
        held = [c for c in plane._frame_server.connections if c._unsent]
        assert len(held) == 1  # the silent one's: mid-response, its writer waiting
    finally:
        writer.close()
        await sub.close()
    # The silent one's connection gone: its stream (and its writer, held mid-write) too.
    await plane.wait_until(lambda: plane.stats.streams_open == 0)
    await plane.stop(0)
    del reader


async def test_a_large_response_over_mtls_arrives_whole(tmp_path: Path) -> None:
    # One response of ~16 MB: more than the sockets hold, so the server's TLS write is
    # taken in parts (OpenSSL's retry of the same buffer) while the subscriber reads.
    ca = certs.ca("meshd-ca")
    server_cert, server_key = certs.leaf(ca, "control-plane")
    plane = ControlPlane(limits=ServerLimits(max_response_bytes=32 * 2**20))
    names = [f"e{i}" for i in range(8)]
    digests = {
        n: PrefixDigest(n, "", 0, 0, True, 16, added=tuple(range(k, k + 250_000))).encode()
        for k, n in enumerate(names)
    }
    plane.cache.update(PREFIX_DIGEST_TYPE, digests)
    tls = TlsConfig(server_cert, server_key, client_ca=certs.pem(ca[1]))
    port = await plane.start("127.0.0.1", 0, tls, publish_port=0)
    cert, key = certs.leaf(ca, "sidecar")
    for name, data in (("ca.pem", certs.pem(ca[1])), ("c.pem", cert), ("c.key", key)):
        (tmp_path / name).write_bytes(data)
    sub = Subscriber(
        f"127.0.0.1:{port}",
        {PREFIX_DIGEST_TYPE: names},
        backoff=FAST,
        credentials=grpc.ssl_channel_credentials(certs.pem(ca[1]), key, cert),
        ssl_context=tls_client_context(
            str(tmp_path / "ca.pem"), str(tmp_path / "c.pem"), str(tmp_path / "c.key")
        ),
    )
    sub.start()
    try:
        await until(sub, lambda: len(sub.entries(PREFIX_DIGEST_TYPE)) == 8)
        assert sub.transport == "frames" and sub.stats.responses == 1
        got = sub.get(PREFIX_DIGEST_TYPE, "e3")
        assert isinstance(got, PrefixDigest) and len(got.added) == 250_000
    finally:
        await sub.close()
        await plane.stop(0)
