"""Where a streamed request's time to first byte goes, hop by hop, and on which CPU.

Each process of loadtest.overhead's set-up (stub backends, the meshd sidecar, this load
generator) writes a timestamp (CLOCK_MONOTONIC, shared by all processes) and the CPU it ran
on at every hop of a request: client send -> sidecar reads the request -> sidecar writes it
upstream -> backend reads it -> backend's first write -> sidecar reads it -> sidecar's first
write to the client -> client reads it. The table gives each hop's p50/p90 and the share of
requests whose hops all ran on one CPU; the same run without the sidecar is the baseline.

The probes are function wrappers installed by a `sitecustomize` module in the children's
PYTHONPATH (aiohttp's server protocol and writer, meshd's upstream connection and direct
chunk writer): each costs a few microseconds, so absolute figures are a little above an
unprobed run's. It answers "is the time in the proxy's own work, or waiting for a CPU?".
On the 2-vCPU VM of 2026-12 with every process free to run anywhere (`--placement shared`):
the backend's first write -> the sidecar's read took 0.77 ms p50 of meshd's ~1.2 ms, with
all hops on one vCPU in 60% of requests: the kernel woke the sidecar on the vCPU where the
backend was still writing its zero-delay 200-token burst. The sidecar's own hops took
~0.27 ms (request in -> upstream write) and ~0.1 ms (answer in -> client write).

Run: `python -m loadtest.ttfb_hops [--rate 100] [--duration 6] [--placement shared]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtest import procstats
from loadtest.openloop import Endpoint, LoadGenerator, completion_request
from loadtest.overhead import (
    PLACEMENTS,
    Child,
    Target,
    meshd_config,
    pin_processes,
    placement_split,
    process_settings,
    start_backends,
    start_child,
)

# Installed as sitecustomize in every child: wraps the hop functions when PROBE_DIR is set.
PROBE = """
import ctypes, importlib.abc, importlib.util, os, sys, time
_dir = os.environ.get("MESHD_HOPS_DIR")
if _dir:
    _cpu = ctypes.CDLL(None).sched_getcpu
    _fd = []
    def ev(tag):
        if not _fd:
            _fd.append(os.open(f"{_dir}/{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND))
        os.write(_fd[0], f"{time.perf_counter_ns()} {tag} {_cpu()}\\n".encode())
    def wrap(cls, name, tag):
        orig = getattr(cls, name)
        def probed(self, *a, **k):
            ev(tag)
            return orig(self, *a, **k)
        setattr(cls, name, probed)
    def web_protocol(m):
        wrap(m.RequestHandler, "data_received", "srv_recv")
    def http_writer(m):
        wrap(m.StreamWriter, "_write", "srv_write")
        wrap(m.StreamWriter, "_writelines", "srv_write")
    def upstream(m):
        wrap(m.UpstreamConnection, "send", "up_send")
        wrap(m.UpstreamConnection, "data_received", "up_recv")
    def listener(m):
        wrap(m._Connection, "data_received", "srv_recv")
        wrap(m._Connection, "write", "srv_write")
    PATCH = {"aiohttp.web_protocol": web_protocol, "aiohttp.http_writer": http_writer,
             "meshd.upstream_connection": upstream, "meshd.listener": listener}
    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            patch = PATCH.pop(name, None)
            if patch is None:
                return None
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module
            def exec_module(module, run=run, patch=patch):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _Finder())
"""

# (process, event) in the order a proxied request meets them; direct skips the sidecar's.
PROXIED = (
    ("client", "cl_send"),
    ("sidecar", "srv_recv"),
    ("sidecar", "up_send"),
    ("backend", "srv_recv"),
    ("backend", "srv_write"),
    ("sidecar", "up_recv"),
    ("sidecar", "srv_write"),
    ("client", "cl_recv"),
)
DIRECT = tuple(h for h in PROXIED if h[0] != "sidecar")


@dataclass(frozen=True, slots=True)
class Event:
    t_ns: int
    process: str
    tag: str
    cpu: int


@dataclass(frozen=True, slots=True)
class Hops:
    """Per request, the time of each hop and the CPU it ran on."""

    chain: tuple[tuple[str, str], ...]
    times_ns: list[list[int]]
    cpus: list[list[int]]

    def gaps_us(self, i: int) -> list[float]:
        return sorted((t[i + 1] - t[i]) / 1e3 for t in self.times_ns)

    def total_us(self) -> list[float]:
        return sorted((t[-1] - t[0]) / 1e3 for t in self.times_ns)

    def one_cpu_share(self) -> float:
        if not self.cpus:
            return float("nan")
        return sum(len(set(c)) == 1 for c in self.cpus) / len(self.cpus)


def read_events(folder: Path, roles: dict[int, str], since_ns: int) -> list[Event]:
    """Every probe line in `folder` at or after `since_ns`, in time order; `roles` names each
    pid's process (others are backends)."""
    events: list[Event] = []
    for path in folder.glob("*.log"):
        role = roles.get(int(path.stem), "backend")
        for line in path.read_text().splitlines():
            t, tag, cpu = line.split()
            if int(t) >= since_ns:
                events.append(Event(int(t), role, tag, int(cpu)))
    events.sort(key=lambda e: e.t_ns)
    return events


def follow(events: Sequence[Event], chain: Sequence[tuple[str, str]]) -> Hops:
    """Each client send opens a window up to the next send; within it the request's hops are
    the first events of each (process, tag) in chain order. Windows missing a hop (a
    request still running when the next was sent) are left out."""
    sends = [i for i, e in enumerate(events) if (e.process, e.tag) == chain[0]]
    times: list[list[int]] = []
    cpus: list[list[int]] = []
    for n, start in enumerate(sends):
        end = sends[n + 1] if n + 1 < len(sends) else len(events)
        t, c = [events[start].t_ns], []
        j = start + 1
        for hop in chain[1:]:
            while j < end and (events[j].process, events[j].tag) != hop:
                j += 1
            if j >= end:
                break
            t.append(events[j].t_ns)
            c.append(events[j].cpu)
            j += 1
        if len(t) == len(chain):
            times.append(t)
            cpus.append(c)
    return Hops(tuple(chain), times, cpus)


def _q(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def format_hops(name: str, hops: Hops) -> str:
    lines = [f"{name}: {len(hops.times_ns)} requests"]
    for i, (a, b) in enumerate(zip(hops.chain, hops.chain[1:], strict=False)):
        gaps = hops.gaps_us(i)
        lines.append(
            f"  {a[0]:>7}:{a[1]:<9} -> {b[0]:>7}:{b[1]:<9}  p50 {_q(gaps, 0.5):7.1f} us"
            f"  p90 {_q(gaps, 0.9):7.1f} us"
        )
    total = hops.total_us()
    lines.append(
        f"  client send -> first byte read           p50 {_q(total, 0.5):7.1f} us"
        f"  p90 {_q(total, 0.9):7.1f} us"
    )
    lines.append(f"  every hop on one CPU: {hops.one_cpu_share():.0%} of requests")
    return "\n".join(lines)


def _fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _probe_client(ev: Callable[[str], None]) -> Callable[[], None]:
    """The load generator (this process) records its own sends and reads; returns what
    takes the probes out again."""
    from loadtest import openloop

    conn: Any = openloop._Connection
    send, received = conn.send, conn.data_received

    def probed_send(self: Any, *a: Any, **k: Any) -> Any:
        ev("cl_send")
        return send(self, *a, **k)

    def probed_received(self: Any, data: bytes) -> None:
        ev("cl_recv")
        received(self, data)

    conn.send, conn.data_received = probed_send, probed_received

    def restore() -> None:
        conn.send, conn.data_received = send, received

    return restore


def measure(
    target: str, rate: float, duration_s: float, placement: str, tokens: int, backends: int
) -> Hops:
    import ctypes

    cpu_of = ctypes.CDLL(None).sched_getcpu
    with tempfile.TemporaryDirectory(prefix="meshd-hops-") as tmp:
        work = Path(tmp)
        probe_dir, log_dir = work / "probe", work / "logs"
        probe_dir.mkdir()
        log_dir.mkdir()
        (probe_dir / "sitecustomize.py").write_text(PROBE)
        old_env = {k: os.environ.get(k) for k in ("PYTHONPATH", "MESHD_HOPS_DIR")}
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(probe_dir), old_env["PYTHONPATH"]])
        )
        os.environ["MESHD_HOPS_DIR"] = str(log_dir)
        fd = os.open(log_dir / f"{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)

        def ev(tag: str) -> None:
            os.write(fd, f"{time.perf_counter_ns()} {tag} {cpu_of()}\n".encode())

        children: list[Child] = []
        unprobe: Callable[[], None] | None = None
        roles = {os.getpid(): "client"}
        cpus = os.sched_getaffinity(0)
        try:
            settings = process_settings(tokens=tokens, backends=backends)
            children += start_backends(settings, work)
            eps = tuple(Endpoint("127.0.0.1", int(b.ready["port"])) for b in children)
            targets = eps
            proxy: Child | None = None
            if target == "meshd":
                path = work / "meshd.yaml"
                path.write_text(yaml.safe_dump(meshd_config(eps), sort_keys=False))
                cmd = [sys.executable, "-m", "meshd.cli", "sidecar", "--config", str(path)]
                proxy = start_child("meshd", cmd, work, 60)
                children.append(proxy)
                roles[proxy.proc.pid] = "sidecar"
                targets = (Endpoint.parse(str(proxy.ready["outbound"])),)
            proxies = {} if proxy is None else {"meshd": Target("meshd", pid=proxy.proc.pid)}
            backends_only = [c for c in children if c is not proxy]
            pin_processes(proxies, backends_only, placement_split(placement, cpus))
            unprobe = _probe_client(ev)
            # uvloop for this run only: installing its policy would outlive the call.
            with asyncio.Runner(loop_factory=_fast_loop_factory()) as runner:
                since = runner.run(_drive(targets, tokens, rate, duration_s))
        finally:
            if unprobe is not None:
                unprobe()
            for c in children:
                c.stop()
            os.close(fd)
            procstats.pin(os.getpid(), cpus)
            for k, v in old_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        events = read_events(log_dir, roles, since)
    return follow(events, PROXIED if target == "meshd" else DIRECT)


async def _drive(targets: Sequence[Endpoint], tokens: int, rate: float, duration_s: float) -> int:
    gen = LoadGenerator(tuple(targets), completion_request(tokens), timeout_s=30)
    try:
        for _ in range(50):  # warm: connections made, code paths run once
            await gen.one()
        since = time.perf_counter_ns()
        await gen.open_loop(rate, duration_s)
    finally:
        await gen.close()
    return since


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.ttfb_hops", description=__doc__)
    parser.add_argument("--rate", type=float, default=100.0, help="open-loop requests/s")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of open loop")
    parser.add_argument("--tokens", type=int, default=200, help="streamed tokens per answer")
    parser.add_argument("--backends", type=int, default=2, help="stub backend processes")
    parser.add_argument(
        "--placement",
        default="shared",
        choices=PLACEMENTS,
        help="where processes may run (loadtest.overhead --placement)",
    )
    args = parser.parse_args(argv)
    if args.placement != "shared" and len(os.sched_getaffinity(0)) < 2:
        parser.error(f"--placement {args.placement} needs at least 2 CPUs")
    print(
        f"{args.tokens}-token streamed completions at {args.rate:g}/s for {args.duration:g} s, "
        f"placement {args.placement}; hop times include the probes' own few microseconds"
    )
    for target in ("direct", "meshd"):
        hops = measure(target, args.rate, args.duration, args.placement, args.tokens, args.backends)
        print(format_hops(target, hops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
