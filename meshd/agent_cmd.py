"""`meshd agent`'s command line: its flags, the AgentConfig they make, and the process that
runs one EngineAgent (meshd/agent.py), or with --engines a NodeAgent for several
(meshd/node_agent.py), until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
from pathlib import Path
from typing import Any

import yaml

from meshd.agent import AgentConfig, EngineAgent
from meshd.node_agent import NodeAgent, engine_configs
from meshd.shards import parse_shard, shard_for


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "agent",
        help="publish an engine's (or a node's engines') state and KV-cache digest to the "
        "control plane",
        description="Run next to a vLLM or SGLang engine: scrape its /metrics and /health, "
        "follow its KV events (ZMQ), read its GPUs via NVML when present, and publish "
        "EndpointState and PrefixDigest to every --control-plane.",
    )
    p.add_argument("--engine", default="http://127.0.0.1:8000", help="engine base URL")
    p.add_argument("--name", help="the engine's resource name (required without --engines)")
    p.add_argument(
        "--engines",
        metavar="FILE",
        type=Path,
        help="a YAML list of this node's engines, each a mapping of the per-engine flags "
        "(name, engine, address, pool, model, flavor, kv_events, kv_events_replay, "
        "kv_events_topic, kv_events_bind, gpu, gpu_count, gpu_memory_gib, gpu_index); one "
        "process serves them all and their updates share publish messages",
    )
    p.add_argument("--address", help="host:port clients reach the engine at (default: --engine)")
    p.add_argument("--pool", default="")
    p.add_argument("--model", default="", help="default: the engine's model_name label")
    p.add_argument("--flavor", choices=("vllm", "sglang"), help="default: detect")
    p.add_argument(
        "--control-plane",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a control plane to publish to (repeatable: every one gets every update)",
    )
    p.add_argument(
        "--shard",
        action="append",
        default=[],
        metavar="HOST:PORT[,HOST:PORT...]",
        help="a control-plane shard, its replicas comma-separated (repeatable): each engine "
        "publishes to the replicas of one shard, chosen by a stable hash of its name "
        "(meshd/shards.py), so N shards each ingest 1/N of the fleet",
    )
    p.add_argument("--interval", type=float, default=0.1, help="seconds between scrapes")
    p.add_argument("--heartbeat", type=float, default=2.0, help="republish at least this often")
    p.add_argument("--scrape-timeout", type=float, default=0.5)
    p.add_argument("--kv-events", metavar="ENDPOINT", help="the engine's KV event PUB endpoint")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT", help="its replay ROUTER endpoint")
    p.add_argument("--kv-events-topic", default="")
    p.add_argument(
        "--kv-events-bind",
        action="store_true",
        help="bind the SUB socket (when vLLM's endpoint is a concrete tcp:// address, it "
        "connects to it)",
    )
    p.add_argument("--resync", type=float, default=30.0, help="seconds between full digests")
    p.add_argument("--gpu", help="GPU generation when NVML cannot tell (H100, A100, ...)")
    p.add_argument("--gpu-count", type=int, default=0)
    p.add_argument("--gpu-memory-gib", type=float, help="total GPU memory when NVML cannot tell")
    p.add_argument("--gpu-index", type=int, action="append", default=[], help="NVML indices")
    p.add_argument("--no-nvml", action="store_true")
    p.add_argument(
        "--tls-ca", metavar="PEM", help="CA of the control planes' certificates (TLS on)"
    )
    p.add_argument(
        "--tls-cert", metavar="PEM", help="client certificate, for control planes that verify"
    )
    p.add_argument("--tls-key", metavar="PEM", help="the client certificate's private key")
    p.add_argument(
        "--no-publish-frames",
        action="store_true",
        help="publish over gRPC only, not over the frames port a control plane advertises "
        "(which costs it a fifth of the CPU a message)",
    )
    p.add_argument("--otlp-endpoint", metavar="HOST:PORT", help="export traces over OTLP/gRPC")
    p.add_argument(
        "--trace-sample-ratio", type=float, default=1.0, help="share of traces kept (0..1)"
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)


def node_configs(args: argparse.Namespace) -> list[AgentConfig]:
    """The engines of --engines FILE, each with the node's flags. SystemExit names the file,
    the entry and the key of a mistake."""
    try:
        engines: Any = yaml.safe_load(args.engines.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"meshd agent: --engines {args.engines}: {exc}") from None
    if not isinstance(engines, list):
        raise SystemExit(f"meshd agent: --engines {args.engines}: expected a YAML list")
    node = config_from_args(args, name=args.name or "node")
    try:
        configs = engine_configs(node, engines)
    except ValueError as exc:
        raise SystemExit(f"meshd agent: --engines {args.engines}: {exc}") from None
    return [dataclasses.replace(c, control_planes=control_planes(args, c.name)) for c in configs]


def control_planes(args: argparse.Namespace, name: str) -> tuple[str, ...]:
    """Where engine `name` publishes: every --control-plane, and the replicas of its shard
    among the --shard ones."""
    try:
        shards = [parse_shard(s) for s in args.shard]
    except ValueError as exc:
        raise SystemExit(f"meshd agent: --shard: {exc}") from None
    targets = list(args.control_plane)
    if shards:
        targets += [t for t in shard_for(name, shards) if t not in targets]
    if not targets:
        raise SystemExit("meshd agent: give --control-plane or --shard (where to publish)")
    return tuple(targets)


def config_from_args(args: argparse.Namespace, name: str | None = None) -> AgentConfig:
    if name is None:
        if not args.name:
            raise SystemExit("meshd agent: --name is required (or --engines FILE)")
        name = args.name
    address = args.address or args.engine.split("://", 1)[-1].rstrip("/")
    mem = args.gpu_memory_gib
    return AgentConfig(
        name=name,
        engine_url=args.engine,
        address=address,
        control_planes=control_planes(args, name),
        pool=args.pool,
        model=args.model,
        flavor=args.flavor,
        interval_s=args.interval,
        heartbeat_s=args.heartbeat,
        scrape_timeout_s=args.scrape_timeout,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_topic=args.kv_events_topic,
        kv_events_bind=args.kv_events_bind,
        resync_s=args.resync,
        gpu=args.gpu,
        gpu_count=args.gpu_count,
        memory_total_bytes=int(mem * 2**30) if mem is not None else None,
        nvml=not args.no_nvml,
        gpu_indices=tuple(args.gpu_index),
        otlp_endpoint=args.otlp_endpoint,
        trace_sample_ratio=args.trace_sample_ratio,
        tls_ca_file=args.tls_ca,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        publish_frames=not args.no_publish_frames,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    configs = node_configs(args) if args.engines is not None else [config_from_args(args)]

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            agent: EngineAgent | NodeAgent = (
                NodeAgent(configs) if args.engines is not None else EngineAgent(configs[0])
            )
        except ValueError as exc:  # a TLS file named by a flag
            raise SystemExit(f"meshd agent: {exc}") from None
        async with agent:
            names = ", ".join(f"{c.name} ({c.engine_url})" for c in configs)
            print(f"meshd agent for {names}", flush=True)
            await stop.wait()

    asyncio.run(serve())
    return 0
