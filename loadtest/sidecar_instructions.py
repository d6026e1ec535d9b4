"""Sidecar instructions per request under callgrind: a figure that holds still on a shared
machine, where wall time and CPU time drift by 2x between runs. Two stub backends and the
sidecar (under `valgrind --tool=callgrind --instr-atstart=no`) are started, the sidecar
is warmed up, and instrumentation is on for exactly N one-at-a-time streamed completions.

Run: `python -m loadtest.sidecar_instructions [--requests 400] [--tokens 200]`. Needs
valgrind (callgrind_control too). Counts user-space instructions only (not the kernel's
socket work), and under valgrind the sidecar reads bigger pieces of each stream than at
full speed, so it weighs per-request work more than per-read work. Compare two trees by
running it in each: figures of one tree differ by ~0.5% between runs of 400 requests
(by up to ~1.5% with 100; 2026-12, the shared 2-core dev machine).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from loadtest.openloop import Endpoint, LoadGenerator, completion_request
from loadtest.overhead import Child, meshd_config, process_settings, start_backends, start_child

# Valgrind makes the sidecar ~50x slower: every wait on it is generous.
_VALGRIND_START_S = 120.0
_REQUEST_TIMEOUT_S = 120.0


def total_instructions(path: Path) -> int:
    """The instruction count of a callgrind output file: the larger of its `totals:` and
    `summary:` lines (with --instr-atstart=no, valgrind 3.19 writes `summary: 0` and the
    count on `totals:`; older ones write only `summary:`)."""
    counts = []
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("totals", "summary") and rest.split():
            counts.append(int(rest.split()[0]))
    if not counts:
        raise ValueError(f"{path}: no totals or summary line (is it a callgrind output file?)")
    return max(counts)


async def _drive(child: Child, endpoint: Endpoint, tokens: int, warmup: int, n: int) -> None:
    gen = LoadGenerator((endpoint,), completion_request(tokens), timeout_s=_REQUEST_TIMEOUT_S)
    try:
        for _ in range(warmup):
            await gen.one()
        subprocess.run(["callgrind_control", "-i", "on", str(child.proc.pid)], check=True,
                       capture_output=True)  # fmt: skip
        for _ in range(n):
            sample = await gen.one()
            if not sample.ok:
                raise RuntimeError(f"a measured request failed: {sample}")
        subprocess.run(["callgrind_control", "-i", "off", str(child.proc.pid)], check=True,
                       capture_output=True)  # fmt: skip
    finally:
        await gen.close()


def measure(
    requests: int,
    tokens: int,
    warmup: int,
    overrides: Sequence[str] = (),
    keep: Path | None = None,
) -> float:
    """Sidecar instructions per request over `requests` serial streamed completions.
    `keep`: where to copy the callgrind output (for callgrind_annotate)."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="meshd-callgrind-"))
    backends: list[Child] = []
    sidecar: Child | None = None
    try:
        settings = process_settings(tokens=tokens, backends=2)
        backends = start_backends(settings, workdir)
        eps = [Endpoint("127.0.0.1", int(b.ready["port"])) for b in backends]
        config = meshd_config(eps)
        config["upstream"] = {"first_byte_timeout_s": _REQUEST_TIMEOUT_S}
        for item in overrides:
            key, _, value = item.partition("=")
            *parents, leaf = key.split(".")
            node = config
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = yaml.safe_load(value)
        path = workdir / "meshd.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        out = workdir / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={out}", sys.executable, "-m", "meshd.cli", "sidecar",
               "--config", str(path)]  # fmt: skip
        sidecar = start_child("meshd", cmd, workdir, _VALGRIND_START_S)
        endpoint = Endpoint.parse(str(sidecar.ready["outbound"]))
        asyncio.run(_drive(sidecar, endpoint, tokens, warmup, requests))
        sidecar.stop(timeout_s=_VALGRIND_START_S)
        sidecar = None
        if keep is not None:
            shutil.copyfile(out, keep)
        return total_instructions(out) / requests
    finally:
        if sidecar is not None:
            sidecar.stop()
        for b in backends:
            b.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.sidecar_instructions", description=__doc__
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=400,
        help="measured requests (100 spread runs of one tree by ~1.5%%, 400 by ~0.5%%)",
    )
    parser.add_argument("--tokens", type=int, default=200, help="streamed tokens per answer")
    parser.add_argument("--warmup", type=int, default=50, help="requests before measuring")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="a sidecar config key for the run (YAML value), e.g. routing.policy=round-robin",
    )
    parser.add_argument(
        "--keep", type=Path, metavar="FILE", help="copy the callgrind output here (annotate it)"
    )
    args = parser.parse_args(argv)
    try:
        per_request = measure(args.requests, args.tokens, args.warmup, args.set, args.keep)
    except (RuntimeError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"sidecar instructions per request: {per_request / 1e6:.3f} M "
        f"({args.requests} serial {args.tokens}-token streamed completions, callgrind"
        + "".join(f", {item}" for item in args.set)
        + ")"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
