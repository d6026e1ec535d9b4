"""`meshd sim-engine`: run one simulated vLLM engine, or a fleet of them, until a signal."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from dataclasses import replace
from typing import Any

from loadtest.engine.config import (
    DEFAULT_MODEL,
    KV_FETCH_FAILURE_STYLES,
    KV_LOAD_FAILURE_POLICIES,
    PD_PROTOCOLS,
    ROLES,
    ConfigError,
    EngineSpec,
    load_fleet_config,
    mixed_fleet,
)
from loadtest.engine.faults import FaultError, parse_fault
from loadtest.engine.fleet import EngineFleet
from loadtest.engine.profiles import GPUS

DESCRIPTION = """\
Run simulated vLLM engines: vLLM's OpenAI-compatible HTTP API (/v1/completions,
/v1/chat/completions, streaming or not), /metrics with vLLM's metric names, KV events
over ZMQ in vLLM's wire format, and a timing model of continuous batching on an
A100/H100/H200/B200 serving Llama-3-8B. Output text is a pure function of (prompt, seed).
Faults can be injected with POST /admin/fault (see loadtest/engine/faults.py).
Prefill/decode disaggregation (vLLM's NIXL protocol, loadtest/engine/kv_transfer.py):
--roles gives each engine a role, prefill steps pin their KV for --kv-hold seconds, and
decode steps fetch it over a --kv-link-gbps link. --pd-protocol sglang speaks SGLang's
protocol instead: the same request, with bootstrap_host/port/room, to both engines at once.

examples:
  meshd sim-engine --port 8001 --gpu H100
  meshd sim-engine --fleet 16 --gpus H100,A100,H200,B200 --port 8100 \\
      --kv-events-endpoint 'tcp://*:5600' --time-scale 0.25
  meshd sim-engine --fleet 4 --roles prefill,decode --port 8200 --kv-hold 60
  meshd sim-engine --fleet 2 --roles prefill,decode --pd-protocol sglang --port 8300
  meshd sim-engine --config fleet.yaml
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim-engine",
        help="run simulated vLLM engines (one, or a fleet on consecutive ports)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port of the first engine; a fleet uses consecutive ports; 0 = any",
    )
    p.add_argument(
        "--gpu",
        default="H100",
        choices=sorted(GPUS) + [g.lower() for g in GPUS],
        metavar="GPU",
        help=f"GPU profile: {', '.join(GPUS)} (default H100)",
    )
    p.add_argument(
        "--gpus",
        default=None,
        help="comma-separated GPU profiles a fleet cycles through, e.g. H100,A100",
    )
    p.add_argument("--fleet", type=int, default=1, metavar="N", help="number of engines")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for requests that carry none (output = f(prompt, seed))",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV cache size in blocks (default: from the GPU profile)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-model-len", type=int, default=8192, help="context window")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="max running requests (default: vLLM's for the GPU)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (default: vLLM's for the GPU)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="simulated seconds per wall second (2 = twice as fast as the GPU)",
    )
    p.add_argument(
        "--cold-start",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="weights-loading delay before the engines accept connections",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="ZMQ PUB endpoint, e.g. tcp://*:5557 (port +i for engine i)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ ROUTER replay endpoint, e.g. tcp://*:5558 (port +i)",
    )
    p.add_argument("--kv-events-topic", default="", help="ZMQ topic of KV event batches")
    p.add_argument(
        "--kv-events-format",
        default="map",
        choices=("map", "array"),
        help="event encoding: map (vLLM >= 0.10, default) or array (older)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="a tokenizer.json (needs the tokenizers package); default: word level",
    )
    p.add_argument(
        "--eos-rate",
        type=float,
        default=0.0,
        help="chance per token of ending the answer (requests without ignore_eos)",
    )
    p.add_argument(
        "--role",
        default="both",
        choices=sorted(ROLES),
        help="prefill/decode role: both (default, vLLM's kv_both), prefill or decode",
    )
    p.add_argument(
        "--roles",
        default=None,
        help="comma-separated roles a fleet cycles through, e.g. prefill,prefill,decode",
    )
    p.add_argument(
        "--kv-hold",
        type=float,
        default=480.0,
        metavar="SECONDS",
        help="how long a prefill step's KV stays pinned for its decode step "
        "(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, default 480)",
    )
    p.add_argument(
        "--kv-link-gbps",
        type=float,
        default=50.0,
        metavar="GB/S",
        help="KV transfer link, gigabytes per second (default 50: a 400 Gb/s RDMA NIC)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        default="fail",
        choices=KV_LOAD_FAILURE_POLICIES,
        help="a decode step whose KV cannot be fetched: fail (410, default) or recompute",
    )
    p.add_argument(
        "--kv-fetch-failure-style",
        default="410",
        choices=KV_FETCH_FAILURE_STYLES,
        help="how such a step fails: 410 (KVTransferError before any byte, default) or vllm "
        "(as vLLM: 500 InternalServerError; streamed, 200 then an error event)",
    )
    p.add_argument(
        "--pd-protocol",
        default="vllm-nixl",
        choices=PD_PROTOCOLS,
        help="the disaggregated-serving protocol: vllm-nixl (kv_transfer_params, default) "
        "or sglang (bootstrap host/port/room, both legs at once)",
    )
    p.add_argument(
        "--bootstrap-port",
        type=int,
        default=None,
        help="sglang: the bootstrap port (default: the engine's HTTP port; +1 per fleet copy)",
    )
    p.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="sglang: how long a decode step waits for its room's KV (default 300)",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="JSON",
        help='a fault for every engine, e.g. \'{"kind":"slowdown","factor":3,"at":60}\'',
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a YAML/JSON fleet file (see loadtest/engine/config.py); "
        "replaces the per-engine options",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level")
    p.set_defaults(func=run)


def specs_from_args(args: argparse.Namespace) -> tuple[str, tuple[EngineSpec, ...]]:
    if args.config:
        cfg = load_fleet_config(args.config)
        return args.host or cfg.host, cfg.engines
    try:
        faults = tuple(parse_fault(json.loads(f)) for f in args.fault)
    except (ValueError, FaultError) as exc:
        raise ConfigError(f"--fault: {exc}") from None
    base = EngineSpec(
        gpu=args.gpu.upper(),
        model=args.model,
        seed=args.seed,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        time_scale=args.time_scale,
        cold_start_s=args.cold_start,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_format=args.kv_events_format,
        tokenizer=args.tokenizer,
        eos_rate=args.eos_rate,
        faults=faults,
        role=args.role,
        kv_hold_s=args.kv_hold,
        kv_link_gbps=args.kv_link_gbps,
        kv_load_failure_policy=args.kv_load_failure_policy,
        kv_fetch_failure_style=args.kv_fetch_failure_style,
        pd_protocol=args.pd_protocol,
        bootstrap_port=args.bootstrap_port,
        bootstrap_timeout_s=args.bootstrap_timeout,
    )
    gpus = [g.strip().upper() for g in args.gpus.split(",")] if args.gpus else [base.gpu]
    roles = [r.strip().lower() for r in args.roles.split(",")] if args.roles else None
    specs = mixed_fleet(
        args.fleet, gpus, base=replace(base, port=args.port), port=args.port, roles=roles
    )
    return args.host or "127.0.0.1", specs


async def serve(host: str, specs: tuple[EngineSpec, ...]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with EngineFleet(specs, host=host) as fleet:
        for e in fleet:
            line = (
                f"{e.name} gpu={e.profile.gpu} role={e.replica.role} "
                f"kv_blocks={e.core.pool.num_blocks} url={e.url}"
            )
            if e.publisher is not None:
                line += f" kv_events={e.publisher.bound_endpoint()}"
            print(line, flush=True)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s")
    try:
        host, specs = specs_from_args(args)
    except (ConfigError, OSError) as exc:
        print(f"meshd sim-engine: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(serve(host, specs))
    except OSError as exc:
        print(f"meshd sim-engine: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtest.engine.cli ...`: the same command without the meshd package."""
    parser = argparse.ArgumentParser(prog="meshd")
    register(parser.add_subparsers())
    args = parser.parse_args(["sim-engine", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
