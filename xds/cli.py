"""`meshd control-plane`: serve the xDS control channel (ADS, delta and state-of-the-world,
plus the publish stream engine agents write to), optionally over mTLS."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import socket
import time
from pathlib import Path

import grpc
from aiohttp import web

from xds.allocator import pin_mmap_threshold
from xds.server import ControlPlane, ServerLimits, TlsConfig

log = logging.getLogger("meshd.xds.cli")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "control-plane",
        help="serve endpoint state and prefix digests over xDS (ADS)",
        description="Run the control plane: Envoy's Aggregated Discovery Service (delta and "
        "state-of-the-world) serving meshd's EndpointState and PrefixDigest resources, and "
        "the publish stream engine agents write them to.",
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:18000",
        help="host:port (default %(default)s: loopback; give 0.0.0.0:PORT to serve other "
        "hosts, with --tls-cert/--tls-key/--client-ca unless the network is trusted)",
    )
    p.add_argument(
        "--publish-port",
        type=int,
        default=0,
        help="also take the agents' publishes as frames on this port, same host and TLS as "
        "--listen (default 0: any free port; -1: none). Advertised to agents on the gRPC "
        "publish stream; a publish there costs the control plane a fifth of gRPC's CPU",
    )
    p.add_argument("--tls-cert", type=Path, help="server certificate chain (PEM)")
    p.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    p.add_argument(
        "--client-ca",
        type=Path,
        help="CA (PEM) that signs client certificates; clients without one are refused",
    )
    d = ServerLimits()
    p.add_argument("--keepalive-time-s", type=float, default=d.keepalive_time_s)
    p.add_argument("--keepalive-timeout-s", type=float, default=d.keepalive_timeout_s)
    p.add_argument(
        "--max-unacked",
        type=int,
        default=d.max_unacked_per_type,
        help="responses in flight per stream and type before updates coalesce "
        "(default %(default)s)",
    )
    p.add_argument(
        "--push-interval-s",
        type=float,
        default=d.push_interval_s,
        help="changes reach subscribers at most this often, merged (0: at once; a burst is "
        "still merged) (default %(default)s)",
    )
    p.add_argument(
        "--max-response-bytes",
        type=int,
        default=d.max_response_bytes,
        metavar="N",
        help="a delta response carries resources up to N bytes (at least one), the rest in "
        "the next (default %(default)s)",
    )
    p.add_argument(
        "--resource-ttl-s",
        type=float,
        default=30.0,
        help="remove an engine's resources after this long without a publish from its agent "
        "(agents heartbeat every 2 s by default; 0: never) (default %(default)s)",
    )
    p.add_argument(
        "--no-eds",
        action="store_true",
        help="do not serve the pools as Envoy ClusterLoadAssignments (EDS)",
    )
    p.add_argument(
        "--shard",
        action="append",
        default=[],
        metavar="ADDR[,REPLICA...]",
        help="a control-plane shard of the fleet, this one included (repeat for each; "
        "agents use the same list, `meshd agent --shard`): the EDS view is then every "
        "shard's engines, the others' followed over ADS, so an Envoy may follow any shard",
    )
    p.add_argument(
        "--shard-self",
        default=socket.gethostname(),
        metavar="NAME",
        help="which --shard is this one: the one with a replica whose address, host or host's "
        "first DNS label is NAME (default: the host name, a StatefulSet pod's name)",
    )
    p.add_argument(
        "--shard-stale-s",
        type=float,
        default=30.0,
        help="another shard unreachable this long: its engines leave the EDS view until it "
        "answers again (0: never) (default %(default)s)",
    )
    p.add_argument(
        "--shard-unfollow-s",
        type=float,
        default=60.0,
        help="no Envoy has followed this shard this long: stop following the other shards "
        "until one does again (0: never stop) (default %(default)s)",
    )
    p.add_argument(
        "--admin",
        default="127.0.0.1:15014",
        metavar="HOST:PORT",
        help="admin listener: /healthz, /readyz, /metrics (default %(default)s: loopback; "
        "set 0.0.0.0:PORT for kubelet probes and scraping)",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="HOST:PORT",
        help="export spans over OTLP/gRPC: per response pushed, and per sampled publish",
    )
    p.add_argument(
        "--trace-sample-ratio", type=float, default=1.0, help="share of traces kept (0..1)"
    )
    p.add_argument(
        "--publish-trace-every",
        type=int,
        default=ServerLimits().publish_trace_every,
        metavar="N",
        help="a span for every Nth accepted publish (refused ones always; default %(default)s)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)


def other_shards(shards: list[str], me: str) -> list[tuple[str, ...]]:
    """The --shard values but this control plane's own (see --shard-self); SystemExit
    unless exactly one of them is its own."""
    from meshd.shards import parse_shard

    parsed = [parse_shard(s) for s in shards]

    def names(address: str) -> set[str]:
        host = address.rpartition(":")[0].strip("[]")
        return {address, host, host.split(".")[0]}

    mine = [s for s in parsed if any(me in names(a) for a in s)]
    if len(mine) != 1:
        raise SystemExit(
            f"--shard: {len(mine)} of the shards name this control plane ({me!r}); "
            "give --shard-self"
        )
    return [s for s in parsed if s is not mine[0]]


def _shard_credentials(tls: TlsConfig | None) -> grpc.ChannelCredentials | None:
    """What this control plane shows the other shards: its own certificate (the chart's
    are for client and server auth) and the CA of its clients."""
    if tls is None:
        return None
    return grpc.ssl_channel_credentials(tls.client_ca, tls.private_key, tls.cert_chain)


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    if args.tls_cert is None and args.tls_key is None:
        if args.client_ca is not None:
            raise SystemExit("--client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise SystemExit("--tls-cert and --tls-key go together")
    return TlsConfig(
        args.tls_cert.read_bytes(),
        args.tls_key.read_bytes(),
        args.client_ca.read_bytes() if args.client_ca is not None else None,
    )


async def _start_admin(address: str, plane: ControlPlane) -> web.AppRunner:
    """The control plane's admin listener: liveness, readiness, its Prometheus stats with
    each pool's demand and desired replicas over every sidecar (meshd_fleet_pool_*), and
    the same as JSON at /autoscale (what KEDA's metrics-api scaler reads)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    from meshd.autoscale_metrics import FleetDemand, FleetDemandCollector
    from meshd.heap import GcCollector, gc_pauses
    from xds.metrics import ServerStatsCollector

    registry = CollectorRegistry()
    registry.register(ServerStatsCollector(plane.stats, plane.eds, plane.eds_shards))
    registry.register(GcCollector(gc_pauses()))  # meshd_gc_*: the collector's pauses
    fleet = FleetDemand(plane)
    registry.register(FleetDemandCollector(fleet))

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def autoscale(request: web.Request) -> web.Response:
        return web.json_response(fleet.as_json(time.monotonic()))

    app = web.Application()
    app.router.add_get("/autoscale", autoscale)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = address.rpartition(":")
    await web.TCPSite(runner, host.strip("[]") or "127.0.0.1", int(port)).start()
    return runner


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    pin_mmap_threshold()  # full digests each in pages of their own (xds/allocator.py)
    host, _, port = args.listen.rpartition(":")
    limits = ServerLimits(
        max_unacked_per_type=args.max_unacked,
        push_interval_s=args.push_interval_s,
        max_response_bytes=args.max_response_bytes,
        keepalive_time_s=args.keepalive_time_s,
        keepalive_timeout_s=args.keepalive_timeout_s,
        resource_ttl_s=args.resource_ttl_s if args.resource_ttl_s > 0 else None,
        publish_trace_every=args.publish_trace_every,
    )
    tls = _tls(args)
    if tls is None and not _loopback(host):
        log.warning(
            "serving PLAINTEXT xDS on %s with no client authentication: anyone who reaches "
            "it can publish engine state and read the fleet's; give --tls-cert, --tls-key "
            "and --client-ca (mTLS), or listen on loopback",
            args.listen,
        )
    elif tls is not None and tls.client_ca is None and not _loopback(host):
        log.warning(
            "serving xDS on %s without --client-ca: clients are not authenticated", args.listen
        )

    provider = None
    if args.otlp_endpoint:
        from meshd import telemetry

        provider = telemetry.setup_tracing(
            "meshd-control-plane", args.otlp_endpoint, args.trace_sample_ratio
        )

    siblings = other_shards(args.shard, args.shard_self) if len(args.shard) > 1 else []

    async def serve() -> None:
        plane = ControlPlane(
            limits=limits,
            eds=not args.no_eds,
            eds_shards=siblings,
            eds_shard_stale_s=args.shard_stale_s if args.shard_stale_s > 0 else math.inf,
            eds_shard_unfollow_s=args.shard_unfollow_s if args.shard_unfollow_s > 0 else math.inf,
            shard_credentials=_shard_credentials(tls),
            tracer_provider=provider,
        )
        admin = await _start_admin(args.admin, plane)
        bound = await plane.start(
            host.strip("[]") or "0.0.0.0",
            int(port),
            tls,
            publish_port=args.publish_port if args.publish_port >= 0 else None,
        )
        # Started: what start-up built lives as long as the process; no full collection
        # walks it again (a stall of the loop that pushes to every sidecar; meshd/heap.py).
        from meshd.heap import settle

        log.info("froze %d objects built at start", settle())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # Once SIGTERM stops it gracefully: a reader may send one as soon as this is read.
        print(f"meshd control plane on {host}:{bound}", flush=True)
        await stop.wait()
        await plane.stop(grace=2.0)
        await admin.cleanup()

    asyncio.run(serve())
    if provider is not None:
        provider.shutdown()
    return 0
