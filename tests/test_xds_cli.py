"""`meshd control-plane` as a process: it starts, serves ADS, and stops on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from envoy.service.discovery.v3 import discovery_pb2 as pb
from grpc import aio
from test_xds_protocol import RawStream, T

from xds import cli


def test_register_adds_control_plane() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["control-plane", "--listen", "127.0.0.1:0", "--max-unacked", "2"])
    assert args.func is cli.run and args.max_unacked == 2
    assert args.resource_ttl_s == 30.0 and not args.no_eds
    args = parser.parse_args(["control-plane", "--resource-ttl-s", "0", "--no-eds"])
    assert args.resource_ttl_s == 0 and args.no_eds


async def test_control_plane_process_serves_and_stops() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; from xds.cli import register, run; import argparse; "
        "p = argparse.ArgumentParser(); register(p.add_subparsers()); "
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))",
        "control-plane",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        port = int(line.rsplit(":", 1)[1])
        async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            s = RawStream(ch)
            await s.send(pb.DeltaDiscoveryRequest(type_url=T, resource_names_subscribe=["x"]))
            resp = await s.recv()
            assert list(resp.removed_resources) == ["x"]  # nothing published yet
            s.call.cancel()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_stats_exported_to_prometheus() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from xds.metrics import ServerStatsCollector
    from xds.server import ServerStats

    stats = ServerStats()
    stats.nacks[T] += 2
    stats.last_nack[T] = "e1: not msgpack"
    registry = CollectorRegistry()
    registry.register(ServerStatsCollector(stats))
    text = generate_latest(registry).decode()
    assert f'meshd_xds_nacks_total{{type_url="{T}"}} 2.0' in text
    assert 'detail="e1: not msgpack"' in text


def test_eds_and_expiry_exported_to_prometheus() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from xds.metrics import ServerStatsCollector
    from xds.resources import EndpointState
    from xds.server import ControlPlane

    plane = ControlPlane()
    plane.publish(T, {"a": EndpointState("10.0.0.1:1", pool="p").encode()})
    plane.publish(T, {"b": EndpointState("engine-b:1", pool="p").encode()})
    plane.stats.expired = 3
    registry = CollectorRegistry()
    registry.register(ServerStatsCollector(plane.stats, plane.eds))
    text = generate_latest(registry).decode()
    assert "meshd_xds_eds_pools 1.0" in text
    assert "meshd_xds_eds_skipped_engines 1.0" in text
    assert "meshd_xds_expired_resources_total 3.0" in text


def test_the_control_plane_listens_on_loopback_unless_told() -> None:
    import argparse

    from xds.cli import _loopback, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["control-plane"])
    host = args.listen.rpartition(":")[0]
    assert _loopback(host)  # plaintext beyond loopback is a warning, and opt-in
    assert _loopback("127.0.0.1") and _loopback("[::1]") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("") and not _loopback("10.0.0.5")
