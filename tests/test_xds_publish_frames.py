"""The frames publish port (xds/publish_frames.py): the same publishes, ACKs and refusals as
the gRPC publish stream, with mTLS as strict; its framing read the same whatever the
chunking; and the agent's link moving to it when the control plane advertises it, staying
on gRPC when it cannot."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import certs
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd import agent_link
from meshd.agent import AgentStats
from meshd.agent_link import ControlPlaneLink
from xds.client import Backoff, Publisher, tls_client_context
from xds.publish_frames import (
    PREAMBLE,
    SUBSCRIBE_PREAMBLE,
    FrameError,
    FramePublisher,
    FrameReader,
    frame,
    frames_target,
    publish_message,
)
from xds.resources import ENDPOINT_STATE_TYPE as T
from xds.resources import EndpointState, ResourceError
from xds.server import ControlPlane, ServerLimits, TlsConfig


def state(name: str, running: int = 0) -> bytes:
    return EndpointState(address=f"{name}:8000", pool="p", requests_running=running).encode()


# -- framing, sans I/O -----------------------------------------------------------------------


@given(
    st.lists(st.binary(max_size=40), max_size=6),
    st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=20),
)
def test_frames_come_out_the_same_however_the_bytes_are_cut(
    payloads: list[bytes], cuts: list[int]
) -> None:
    wire = PREAMBLE + b"".join(frame(p) for p in payloads)
    reader = FrameReader(1 << 20, PREAMBLE)
    out: list[bytes] = []
    i = 0
    for n in cuts * (len(wire) // max(1, sum(cuts)) + 1):
        out += reader.feed(wire[i : i + n])
        i += n
        if i >= len(wire):
            break
    out += reader.feed(wire[i:])
    assert out == payloads


@given(
    st.sampled_from([PREAMBLE, SUBSCRIBE_PREAMBLE]),
    st.lists(st.binary(max_size=40), max_size=4),
    st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=20),
)
def test_either_preamble_is_told_however_the_bytes_are_cut(
    opening: bytes, payloads: list[bytes], cuts: list[int]
) -> None:
    # The port's two kinds of connection (publish, subscribe) share a prefix ("MESHD-"):
    # which one came is known only once it is whole, however it arrives.
    wire = opening + b"".join(frame(p) for p in payloads)
    reader = FrameReader(1 << 20, (PREAMBLE, SUBSCRIBE_PREAMBLE))
    out: list[bytes] = []
    i = 0
    for n in cuts * (len(wire) // max(1, sum(cuts)) + 1):
        out += reader.feed(wire[i : i + n])
        i += n
        if i >= len(wire):
            break
        assert reader.chosen in (b"", opening)
    out += reader.feed(wire[i:])
    assert out == payloads and reader.chosen == opening


def test_framing_errors() -> None:
    with pytest.raises(FrameError, match="not a meshd frames stream"):
        FrameReader(100, PREAMBLE).feed(b"PRI * HTTP/2.0\r\n")  # a gRPC client, say
    reader = FrameReader(100, PREAMBLE)
    assert reader.feed(PREAMBLE[:3]) == []
    with pytest.raises(FrameError, match="not a meshd"):
        reader.feed(b"X")
    # Both accepted: a prefix of either waits, what is neither is refused.
    reader = FrameReader(100, (PREAMBLE, SUBSCRIBE_PREAMBLE))
    assert reader.feed(b"MESHD-") == [] and reader.partial
    with pytest.raises(FrameError, match="not a meshd"):
        reader.feed(b"XUBLISH/1\n")
    with pytest.raises(FrameError, match="not a meshd"):
        FrameReader(100, PREAMBLE).feed(SUBSCRIBE_PREAMBLE)  # a publish-only reader
    # Over the limit as soon as the header is in, not once the body has come.
    reader = FrameReader(100)
    assert reader.feed((101).to_bytes(4, "big")[:2]) == []
    with pytest.raises(FrameError, match="101 bytes over the limit of 100"):
        reader.feed((101).to_bytes(4, "big")[2:])
    assert FrameReader(100).feed(frame(b"x" * 100)) == [b"x" * 100]


def test_a_reader_says_when_part_of_a_frame_is_in() -> None:
    reader = FrameReader(100, PREAMBLE)
    assert not reader.partial
    reader.feed(PREAMBLE[:4])
    assert reader.partial
    reader.feed(PREAMBLE[4:] + frame(b"abc")[:5])
    assert reader.partial
    assert reader.feed(frame(b"abc")[5:]) == [b"abc"] and not reader.partial


def test_frames_target() -> None:
    assert frames_target("cp.ns.svc:15010", 15012) == ("cp.ns.svc", 15012)
    assert frames_target("127.0.0.1:1", 2) == ("127.0.0.1", 2)
    assert frames_target("[::1]:15010", 9) == ("::1", 9)
    for target in ("dns:///cp:15010", "unix:/tmp/s", "ipv4:1.2.3.4:5", "cp", "::1"):
        assert frames_target(target, 9) is None, target


# -- the control plane's port ----------------------------------------------------------------


@pytest.fixture
async def cp() -> AsyncIterator[ControlPlane]:
    plane = ControlPlane(limits=ServerLimits(max_message_bytes=256 * 1024))
    await plane.start("127.0.0.1", 0, publish_port=0)
    yield plane
    await plane.stop(0)


async def test_frames_publish_acks_and_refuses_as_grpc_does(cp: ControlPlane) -> None:
    pub = FramePublisher("127.0.0.1", cp.publish_port)
    grpc_pub = Publisher(f"127.0.0.1:{cp.port}")
    try:
        await pub.publish(T, {"e1": state("e1")})
        assert cp.cache.get(T, "e1") is not None
        bad = {"e2": b"\xc1not msgpack", "e3": state("e3")}
        with pytest.raises(ResourceError) as over_frames:
            await pub.publish(T, bad)
        with pytest.raises(ResourceError) as over_grpc:
            await grpc_pub.publish(T, bad)
        assert str(over_frames.value) == str(over_grpc.value) and "e2" in str(over_grpc.value)
        assert cp.cache.get(T, "e3") is None and cp.stats.publishes_rejected == 2
        with pytest.raises(ResourceError, match="not accepted"):
            await pub.publish("type.googleapis.com/unknown", {"x": b""})
        await pub.publish(T, {}, removed=["e1"])  # the connection carries on
        assert cp.cache.get(T, "e1") is None and cp.stats.publishes == 2
        assert grpc_pub.frames_port == cp.publish_port  # advertised on the gRPC stream
    finally:
        await pub.close()
        await grpc_pub.close()


async def raw_connection(cp: ControlPlane, first: bytes) -> bytes:
    """What the control plane sends back to `first` before it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", cp.publish_port)
    writer.write(first)
    try:
        async with asyncio.timeout(5.0):
            return await reader.read()  # to EOF
    finally:
        writer.close()


async def test_bad_bytes_end_the_connection(cp: ControlPlane) -> None:
    assert await raw_connection(cp, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") == b""
    assert await raw_connection(cp, PREAMBLE + frame(b"\xff\xff not protobuf")) == b""
    assert await raw_connection(cp, PREAMBLE + (256 * 1024 + 1).to_bytes(4, "big")) == b""
    # Two messages in one write: two answers, in order.
    two = b"".join(
        frame(publish_message(T, {n: state(n)}, (), i).SerializeToString())
        for i, n in enumerate(("a", "b"))
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", cp.publish_port)
    writer.write(PREAMBLE + two)
    got = FrameReader(1024)
    answers: list[bytes] = []
    async with asyncio.timeout(5.0):
        while len(answers) < 2:
            answers += got.feed(await reader.read(1024))
    writer.close()
    assert [a.endswith(b"0") or a.endswith(b"1") for a in answers] == [True, True]
    assert cp.cache.get(T, "a") is not None and cp.cache.get(T, "b") is not None


async def test_a_large_message_in_many_reads(cp: ControlPlane) -> None:
    pub = FramePublisher("127.0.0.1", cp.publish_port)
    try:
        many = {f"e{i}": state(f"e{i}") for i in range(600)}  # ~170 KB, many reads
        await pub.publish(T, many)
        assert len(cp.cache.resources(T)) == 600
    finally:
        await pub.close()


# -- mTLS ------------------------------------------------------------------------------------


def _client_files(tmp: Path, ca_pem: bytes, leaf: tuple[bytes, bytes] | None) -> ssl.SSLContext:
    (tmp / "ca.pem").write_bytes(ca_pem)
    if leaf is None:
        return tls_client_context(str(tmp / "ca.pem"), None, None)
    (tmp / "c.pem").write_bytes(leaf[0])
    (tmp / "c.key").write_bytes(leaf[1])
    return tls_client_context(str(tmp / "ca.pem"), str(tmp / "c.pem"), str(tmp / "c.key"))


async def test_mtls_refuses_what_the_grpc_port_refuses(tmp_path: Path) -> None:
    ca, rogue = certs.ca("meshd-ca"), certs.ca("rogue-ca")
    server_cert, server_key = certs.leaf(ca, "control-plane")
    plane = ControlPlane()
    tls = TlsConfig(server_cert, server_key, client_ca=certs.pem(ca[1]))
    await plane.start("127.0.0.1", 0, tls, publish_port=0)
    try:
        for i, leaf in enumerate((certs.leaf(rogue, "agent"), None)):
            d = tmp_path / f"bad{i}"
            d.mkdir()
            pub = FramePublisher(
                "127.0.0.1",
                plane.publish_port,
                ssl_context=_client_files(d, certs.pem(ca[1]), leaf),
            )
            with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
                async with asyncio.timeout(5.0):
                    await pub.publish(T, {"x": state("x")})
            await pub.close()
        # A client that does not check the server is refused its certificate check too:
        # the server's certificate is not one the rogue CA signed.
        d = tmp_path / "wrong-ca"
        d.mkdir()
        pub = FramePublisher(
            "127.0.0.1",
            plane.publish_port,
            ssl_context=_client_files(d, certs.pem(rogue[1]), certs.leaf(ca, "agent")),
        )
        with pytest.raises(ssl.SSLCertVerificationError):
            await pub.publish(T, {"x": state("x")})
        await pub.close()
        assert plane.stats.publishes == 0 and plane.cache.get(T, "x") is None

        d = tmp_path / "good"
        d.mkdir()
        good = FramePublisher(
            "127.0.0.1",
            plane.publish_port,
            ssl_context=_client_files(d, certs.pem(ca[1]), certs.leaf(ca, "agent")),
        )
        await good.publish(T, {"x": state("x")})
        # ~170 KB: many TLS records, read on in one go rather than one record a poll.
        many = {f"e{i}": state(f"e{i}") for i in range(600)}
        async with asyncio.timeout(2.0):
            await good.publish(T, many)
        await good.close()
        assert plane.stats.publishes == 2 and plane.cache.get(T, "x") is not None
        assert len(plane.cache.resources(T)) == 601
    finally:
        await plane.stop(0)


async def test_a_handshake_never_finished_is_dropped(tmp_path: Path) -> None:
    ca = certs.ca("meshd-ca")
    server_cert, server_key = certs.leaf(ca, "control-plane")
    plane = ControlPlane(limits=ServerLimits(handshake_timeout_s=0.05))
    tls = TlsConfig(server_cert, server_key, client_ca=certs.pem(ca[1]))
    await plane.start("127.0.0.1", 0, tls, publish_port=0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", plane.publish_port)
        async with asyncio.timeout(5.0):
            assert await reader.read() == b""  # closed by the server, nothing sent
        writer.close()
    finally:
        await plane.stop(0)


# -- the agent's link ------------------------------------------------------------------------


@dataclass
class Owner:
    stats: AgentStats = field(default_factory=AgentStats)
    credentials: grpc.ChannelCredentials | None = None
    ssl_context: ssl.SSLContext | None = None
    lost: int = 0

    @dataclass
    class _Config:
        backoff: Backoff = field(default_factory=lambda: Backoff(base_s=0.001, max_s=0.002))
        publish_frames: bool = True

    config: _Config = field(default_factory=_Config)

    def on_link_lost(self) -> None:
        self.lost += 1


async def settle(link: ControlPlaneLink, plane: ControlPlane, name: str, running: int) -> None:
    """Offer engine `name`'s state; return once the control plane holds this version of
    it and the link has its ACK."""
    want = state(name, running)
    stats = link.agent.stats
    acked = stats.publishes
    link.offer(T, name, want)
    async with asyncio.timeout(5.0):
        while (r := plane.cache.get(T, name)) is None or r.body != want:
            await asyncio.sleep(0.005)
        while stats.publishes == acked:
            await asyncio.sleep(0.005)


async def until_frames(link: ControlPlaneLink, plane: ControlPlane, name: str) -> int:
    """Publish new states of `name` until one goes over the frames port (the link
    connects there in the background); how many went over gRPC before."""
    for n in range(1, 200):
        await settle(link, plane, name, 100 + n)
        if link.transport == "frames":
            return n - 1
        await asyncio.sleep(0.005)
    raise AssertionError("the link never moved to the frames port")


@pytest.fixture
def free_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.parametrize("allowed", [True, False])
async def test_the_link_moves_to_the_advertised_port(cp: ControlPlane, allowed: bool) -> None:
    owner = Owner()
    owner.config.publish_frames = allowed
    link = ControlPlaneLink(owner, f"127.0.0.1:{cp.port}")
    link.start()
    try:
        await settle(link, cp, "e1", 1)  # the first send: over gRPC, which advertises
        assert link.transport == "grpc"
        if allowed:
            await until_frames(link, cp, "e1")
        else:
            for running in range(2, 6):
                await settle(link, cp, "e1", running)
                await asyncio.sleep(0.01)
            assert link.transport == "grpc"
        assert owner.stats.publish_failures == 0 and owner.lost == 0
    finally:
        await link.close()


async def test_a_frames_port_out_of_reach_leaves_the_link_on_grpc(
    cp: ControlPlane, free_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cp, "_advertised", (("meshd-publish-frames-port", str(free_port)),))
    owner = Owner()
    link = ControlPlaneLink(owner, f"127.0.0.1:{cp.port}")
    link.start()
    try:
        for running in range(1, 4):
            await settle(link, cp, "e1", running)
        assert link.transport == "grpc"
        assert owner.stats.publish_failures == 0 and owner.lost == 0  # nothing lost on the way
    finally:
        await link.close()


async def test_a_frames_port_that_never_answers_holds_no_send_up(
    cp: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    never = asyncio.Event()

    async def hangs(self: FramePublisher) -> None:  # a port whose packets are dropped
        await never.wait()

    monkeypatch.setattr(FramePublisher, "connect", hangs)
    monkeypatch.setattr(agent_link, "FRAMES_CONNECT_TIMEOUT_S", 60.0)
    owner = Owner()
    link = ControlPlaneLink(owner, f"127.0.0.1:{cp.port}")
    link.start()
    try:
        async with asyncio.timeout(5.0):  # far inside the connect timeout: nothing waits on it
            for running in range(1, 6):
                await settle(link, cp, "e1", running)
        assert link.transport == "grpc"
        assert link._dialing is not None and not link._dialing.done()  # still connecting
        assert owner.stats.publish_failures == 0
    finally:
        await link.close()
    assert link._dialing is None  # the attempt went with the link


async def test_a_control_plane_without_the_port_is_published_to_over_grpc() -> None:
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0)  # no publish_port: nothing advertised
    owner = Owner()
    link = ControlPlaneLink(owner, f"127.0.0.1:{plane.port}")
    link.start()
    try:
        for running in range(1, 3):
            await settle(link, plane, "e1", running)
        assert link.transport == "grpc"
    finally:
        await link.close()
        await plane.stop(0)


async def test_the_link_survives_a_control_plane_restart_on_frames(cp: ControlPlane) -> None:
    owner = Owner()
    link = ControlPlaneLink(owner, f"127.0.0.1:{cp.port}")
    link.start()
    port, publish_port = cp.port, cp.publish_port
    try:
        await until_frames(link, cp, "e1")
        await cp.stop(0)
        again = ControlPlane()
        await again.start("127.0.0.1", port, publish_port=publish_port)
        try:
            await settle(link, again, "e1", 3)  # over gRPC first, after the failure
            assert link.transport == "grpc"
            await until_frames(link, again, "e1")
            assert owner.lost >= 1
        finally:
            await again.stop(0)
    finally:
        await link.close()
