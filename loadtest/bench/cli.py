"""`meshd bench` and `meshd demo`: command lines over the benchmark runner.

Imported by `meshd --help` for every command, so it imports nothing heavy at module level
(no aiohttp, no matplotlib): the runner loads only when a command runs.
Also runnable as `python -m loadtest.bench.cli [bench options]`.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from loadtest.bench.report import BenchReport
    from loadtest.bench.runner import BenchConfig

T = TypeVar("T")
EXIT_INTERRUPTED = 130

DEFAULT_ENGINES = 8
DEFAULT_GPUS = "H100,A100"
# `meshd demo`: 8 engines of two GPU generations, the demo mix, round robin vs meshd.
# About 50 s of load per policy plus start-up and drain: under 3 minutes in all.
DEMO_POLICIES = ("round-robin", "meshd")
DEMO_DURATION_S = 45.0
DEMO_QUICK_DURATION_S = 15.0
QUICK_DURATION_S = 20.0
# Small KV caches (blocks of 16 tokens) so that a 1-minute run evicts and where a request
# lands changes what is cached: 8 system prompts of 512 tokens are 256 blocks.
DEMO_KV_BLOCKS = 512


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _scalar(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return text


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    from loadtest.bench.policies import DEFAULT_POLICIES, POLICIES
    from loadtest.workloads import WORKLOADS

    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="demo", choices=sorted(WORKLOADS), help="default: demo")
    w.add_argument("--rate", type=float, help="arrival rate, requests/s (generators)")
    w.add_argument("--cap", type=int, help="at most this many requests (traces)")
    w.add_argument(
        "--time-scale",
        type=float,
        help="replay traces this many times faster (arrival times divided by it)",
    )
    w.add_argument("--token-scale", type=float, help="scale trace prompt lengths by this")
    w.add_argument("--seed", type=int, help="workload seed")
    w.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other keyword of the workload (repeatable), e.g. --arg load=2",
    )
    f = p.add_argument_group("fleet")
    f.add_argument("--engines", type=int, default=DEFAULT_ENGINES, help="default: 8")
    f.add_argument(
        "--gpus",
        default=DEFAULT_GPUS,
        help="GPU generations, cycled over the engines (default: H100,A100)",
    )
    f.add_argument(
        "--fleet",
        choices=("auto", "sim", "stub"),
        default="auto",
        help="sim: the vLLM engine simulator; stub: instant tokens, no cache "
        "(auto: sim when present)",
    )
    f.add_argument("--kv-blocks", type=int, help="KV-cache blocks per simulated engine")
    f.add_argument(
        "--engine-time-scale",
        type=float,
        default=1.0,
        help="simulated seconds per wall second (default 1)",
    )
    r = p.add_argument_group("run")
    r.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated, from: {', '.join(POLICIES)} "
        f"(default: {','.join(DEFAULT_POLICIES)})",
    )
    r.add_argument("--duration", type=float, help="send nothing after this many seconds")
    r.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    r.add_argument("--concurrency", type=int, default=256, help="client-side in-flight cap")
    r.add_argument("--out", type=Path, help="output dir (default results/bench-<timestamp>/)")
    r.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument(
        "--quick", action="store_true", help=f"a short run: sends stop at {QUICK_DURATION_S:g} s"
    )
    r.add_argument(
        "--virtual-clock",
        action="store_true",
        help="a discrete-event run: simulated time, no sockets, the same engine model and "
        "routers (meshd's own policies; peers are skipped). 100s of engines in seconds",
    )


def _workload_args(args: argparse.Namespace) -> dict[str, Any]:
    from loadtest.bench.runner import workload_parameters

    out: dict[str, Any] = {}
    for flag, key in (
        ("rate", "rate"),
        ("cap", "cap"),
        ("time_scale", "time_scale"),
        ("token_scale", "token_scale"),
        ("seed", "seed"),
    ):
        value = getattr(args, flag)
        if value is not None:
            out[key] = value
    for item in args.arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--arg expects KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = _scalar(value.strip())
    accepted = workload_parameters(args.workload)
    if args.quick and args.workload == "demo" and "duration_s" not in out:
        out["duration_s"] = QUICK_DURATION_S
    unknown = sorted(set(out) - set(accepted))
    if unknown:
        raise ValueError(
            f"workload {args.workload!r} takes no {', '.join(unknown)}; "
            f"it takes: {', '.join(accepted)}"
        )
    return out


def config_from_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> BenchConfig:
    from loadtest.bench.client import ClientSettings
    from loadtest.bench.fleet import FleetSpec, fleet_gpus, sim_unavailable
    from loadtest.bench.runner import BenchConfig

    notes: list[str] = []
    kind = args.fleet
    if kind == "auto":
        reason = sim_unavailable()
        kind = "sim" if reason is None else "stub"
        if reason is not None:
            notes.append(f"stub engines (no cache, no queue): {reason}")
    if args.engines < 1:
        raise ValueError("--engines must be >= 1")
    duration = args.duration
    if args.quick and duration is None:
        duration = QUICK_DURATION_S
    fleet = FleetSpec(
        gpus=fleet_gpus(args.engines, _csv(args.gpus)),
        kind=kind,
        time_scale=args.engine_time_scale,
        kv_blocks=args.kv_blocks,
    )
    client = ClientSettings(
        timeout_s=args.timeout,
        max_concurrency=args.concurrency,
        duration_s=duration,
        drain_s=min(60.0, args.timeout),
        progress=not args.no_progress,
    )
    words = list(argv if argv is not None else sys.argv[1:])
    if words[:1] == ["bench"]:
        words = words[1:]
    command = "meshd bench " + shlex.join(words)
    return BenchConfig(
        fleet=fleet,
        workload=args.workload,
        workload_args=_workload_args(args),
        policies=tuple(_csv(args.policies)),
        client=client,
        out_dir=args.out,
        plots=not args.no_plots,
        command=command.strip(),
        notes=tuple(notes),
    )


class Interrupted(Exception):
    """SIGTERM or SIGINT ended the run; every fleet and router was stopped first."""


async def _cancel_on_signals(coro: Coroutine[Any, Any, T]) -> T:
    # SIGTERM (and SIGINT, when not ignored) cancel the run, so the runner's finally
    # blocks stop every fleet and router child instead of leaving them behind.
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    signals = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signals.append(signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, task.cancel)
    try:
        return await coro
    except asyncio.CancelledError:
        raise Interrupted() from None
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_cancel_on_signals(coro))
    return uvloop.run(_cancel_on_signals(coro))


def print_summary(report: BenchReport, path: Path) -> None:
    from loadtest.bench.report import comparison_table

    print(comparison_table(report))
    print(f"\nReport: {path}")


def bench(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    from loadtest.bench.policies import resolve_policies
    from loadtest.bench.runner import run_bench

    try:
        config = config_from_args(args, argv)
        resolve_policies(config.policies)
    except ValueError as exc:
        print(f"meshd bench: {exc}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "virtual_clock", False):
            from loadtest.bench.virtual import run_virtual_bench

            report, path = run_virtual_bench(config)
        else:
            report, path = _run(run_bench(config))
    except ValueError as exc:
        print(f"meshd bench: {exc}", file=sys.stderr)
        return 2
    except Interrupted:
        print("meshd bench: interrupted; fleets and routers stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    print_summary(report, path)
    return 0 if report.ran else 1


async def run_demo(
    out_dir: Path | None = None,
    *,
    quick: bool = False,
    progress: bool = True,
    plots: bool = True,
) -> int:
    """`meshd demo`: a short bench on the embedded default; prints the comparison table.

    8 simulated engines (4 x H100, 4 x A100), the "demo" workload (shared-prefix questions
    plus agentic tasks) shrunk to fit, round robin vs meshd. Returns 0 when both ran.
    """
    from loadtest.bench.client import ClientSettings
    from loadtest.bench.fleet import FleetSpec, fleet_gpus, sim_unavailable
    from loadtest.bench.runner import BenchConfig, run_bench

    reason = sim_unavailable()
    notes = [] if reason is None else [f"stub engines (no cache, no queue): {reason}"]
    duration = DEMO_QUICK_DURATION_S if quick else DEMO_DURATION_S
    config = BenchConfig(
        fleet=FleetSpec(
            gpus=fleet_gpus(DEFAULT_ENGINES, _csv(DEFAULT_GPUS)),
            kind="sim" if reason is None else "stub",
            kv_blocks=DEMO_KV_BLOCKS,
        ),
        workload="demo",
        workload_args={"duration_s": duration},
        policies=DEMO_POLICIES,
        client=ClientSettings(
            timeout_s=30.0, duration_s=duration + 5.0, drain_s=20.0, progress=progress
        ),
        out_dir=out_dir,
        plots=plots,
        title="meshd demo: round robin vs meshd",
        command="meshd demo" + (" --quick" if quick else ""),
        notes=tuple(notes),
    )
    report, path = await run_bench(config)
    print_summary(report, path)
    return 0 if len(report.ran) == len(DEMO_POLICIES) else 1


def demo_main(args: argparse.Namespace | None = None) -> int:
    """Sync entry point for `meshd demo` (reads --out, --quick, --no-plots if present)."""
    out = getattr(args, "out", None)
    quick = bool(getattr(args, "quick", False))
    plots = not getattr(args, "no_plots", False)
    progress = not getattr(args, "no_progress", False)
    try:
        return _run(run_demo(out, quick=quick, progress=progress, plots=plots))
    except Interrupted:
        print("meshd demo: interrupted; fleets and routers stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `meshd bench`."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark routing policies on a simulated fleet",
        description="Start a fleet of simulated vLLM engines, the router under test and the "
        "load, once per policy (fresh fleet, cold caches), and write results.json plus a "
        "Markdown report with plots. Peers (Envoy, sglang-router, vllm-router) run when "
        "installed and are skipped with a reason otherwise.",
        epilog="Example: meshd bench --workload shared-prefix --rate 8 "
        "--policies round-robin,meshd,envoy-rr --quick",
    )
    add_bench_arguments(p)
    p.set_defaults(func=bench)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="output dir (default results/bench-<timestamp>/)")
    p.add_argument("--quick", action="store_true", help="a 15 s load per policy")
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def register_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `meshd demo` (for meshd/demo.py to re-export as its `register`)."""
    p = subparsers.add_parser(
        "demo",
        help="round robin vs meshd on 8 simulated engines, in under 3 minutes",
        description="Run a short bench on an embedded default: 8 simulated engines of two GPU "
        "generations (H100, A100), a shared-prefix plus agentic workload, round robin vs "
        "meshd; prints the comparison table and where the report was written.",
    )
    add_demo_arguments(p)
    p.set_defaults(func=demo_main)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m loadtest.bench.cli [bench options]`, or `... demo [demo options]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        parser = argparse.ArgumentParser(prog="python -m loadtest.bench.cli demo")
        add_demo_arguments(parser)
        return demo_main(parser.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.cli", description=__doc__)
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    return bench(args, argv)


if __name__ == "__main__":
    sys.exit(main())
