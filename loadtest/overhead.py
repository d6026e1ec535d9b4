"""Data-plane overhead benchmark: the same stub backends reached directly, through the meshd
sidecar, and through Envoy (static round robin), in one run. Prints the latency each proxy
adds (TTFB, TTLB), saturation throughput, proxy CPU per request and peak RSS, meshd/Envoy.

Run: `python -m loadtest.overhead [--rates 50,100,200] [--duration 10] [--quick] [--json F]
[--placement shared,sidecar,proxy-alone]`.

Placement (where the kernel may run each process; `--placement` takes one or several, and
several are run in turn and compared at the end):

- `shared` (default): backends, proxy and load generator all share every CPU. On a small
  VM the kernel may stack the proxy onto the vCPU where a zero-delay backend is bursting
  out its answer, and the proxy then reads the first token only once the burst is over:
  the figure measures the scheduler as much as the proxy.
- `sidecar`: the backends on CPUs of their own (the engine on its GPU server), the proxy
  and the load generator sharing the rest (the app and its sidecar in one pod). This is
  how a sidecar is deployed.
- `proxy-alone` (`--pin`): the proxy alone on one CPU, backends and load generator on the
  rest (a sidecar with a CPU reserved for it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest import procstats
from loadtest.envoy_bin import (
    REPO_ROOT,
    EnvoyNotInstalled,
    EnvoyProcess,
    envoy_version,
    render_static_config,
    start_envoy,
)
from loadtest.openloop import (
    Endpoint,
    LoadGenerator,
    Summary,
    completion_request,
    install_fast_loop,
    summarize,
)

TARGETS = ("direct", "meshd", "envoy")
# The targets for meshd.
TARGET_ADDED_P50_TTFB_MS = 1.0
TARGET_ADDED_TTFB_RATE = 100.0
TARGET_CPU_RATIO = 3.0
TARGET_PEAK_RSS_MB = 80.0
MB = 1024 * 1024
_START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Settings:
    """What one benchmark run does."""

    rates: tuple[float, ...]
    duration_s: float
    serial_s: float
    saturation_s: float
    concurrency: int
    backends: int
    tokens: int
    envoy_concurrency: int
    warmup_s: float
    quick: bool
    hotpath: bool
    meshd_overrides: tuple[str, ...]
    token_delay_ms: float = 0.0
    seed: int = 1
    placement: str = "shared"


def process_settings(*, tokens: int, backends: int, rate: float | None = None) -> Settings:
    """Settings for a script that only starts this benchmark's processes (start_backends,
    start_meshd) and drives them itself."""
    return Settings(
        rates=() if rate is None else (rate,),
        duration_s=0.0,
        serial_s=0.0,
        saturation_s=0.0,
        concurrency=1,
        backends=backends,
        tokens=tokens,
        envoy_concurrency=1,
        warmup_s=0.0,
        quick=True,
        hotpath=False,
        meshd_overrides=(),
    )


@dataclass(frozen=True, slots=True)
class Phase:
    """One measured run against one target, with what the processes spent on it."""

    target: str
    kind: str  # "serial" (one at a time), "open" or "saturation"
    rate: float | None
    summary: Summary
    proxy_cpu_s: float | None
    backend_cpu_s: float
    # Machine-wide CPU seconds the phase saw spent outside the benchmark's own processes
    # (other jobs on the machine) and stolen by the hypervisor; None without /proc/stat.
    other_cpu_s: float | None = None
    steal_s: float | None = None
    wall_s: float = 0.0


@dataclass
class Target:
    """A way to reach the backends; `error` says why it could not be measured."""

    name: str
    endpoints: tuple[Endpoint, ...] = ()
    pid: int | None = None
    version: str = ""
    error: str = ""
    peak_rss: int | None = None
    phases: list[Phase] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return not self.error and bool(self.endpoints)


class StartError(RuntimeError):
    """A process did not come up; the message says why."""


@dataclass(frozen=True, slots=True)
class Child:
    """A started helper process and the JSON ready line it printed."""

    name: str
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    stderr_path: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_child(name: str, cmd: Sequence[str], workdir: Path, timeout_s: float) -> Child:
    """Start `cmd` and wait for its `{"event": "ready", ...}` stdout line (event, not poll)."""
    stderr_path = workdir / f"{name}.stderr"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
    ready: dict[str, Any] = {}
    seen = threading.Event()

    def read() -> None:
        # Reads to EOF, so a chatty child never blocks on a full pipe.
        assert proc.stdout is not None
        for line in proc.stdout:
            if seen.is_set():
                continue
            with contextlib.suppress(ValueError):
                obj = json.loads(line)
                if isinstance(obj, dict) and obj.get("event") == "ready":
                    ready.update(obj)
                    seen.set()
        seen.set()

    threading.Thread(target=read, name=f"{name}-stdout", daemon=True).start()
    if not seen.wait(timeout_s) or not ready:
        code = proc.poll()
        if code is None:
            proc.kill()
            proc.wait()
        why = f"exited with {code}" if code is not None else f"no ready line in {timeout_s:g} s"
        raise StartError(f"{name} {why}; stderr:\n{_tail(stderr_path)}")
    return Child(name, proc, ready, stderr_path)


def _hostport(value: str) -> Endpoint:
    return Endpoint.parse(value)


def start_backends(settings: Settings, workdir: Path) -> list[Child]:
    children = []
    for i in range(settings.backends):
        cmd = [
            sys.executable,
            "-m",
            "loadtest.stub_backend",
            "--port",
            "0",
            "--tokens",
            str(settings.tokens),
            "--token-delay-ms",
            str(settings.token_delay_ms),
        ]
        children.append(start_child(f"backend{i}", cmd, workdir, _START_TIMEOUT_S))
    return children


def meshd_config(backends: Sequence[Endpoint]) -> dict[str, Any]:
    """The sidecar config the benchmark runs: both listeners on port 0, one pool."""
    return {
        "listeners": {
            "outbound": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
        },
        "pools": [{"name": "default", "endpoints": [f"http://{ep}" for ep in backends]}],
        # Nothing is in flight when the benchmark stops it.
        "drain": {"grace_period_s": 1},
    }


def start_meshd(
    backends: Sequence[Endpoint], settings: Settings, workdir: Path
) -> tuple[Child | None, Target]:
    target = Target("meshd")
    path = workdir / "meshd.yaml"
    path.write_text(yaml.safe_dump(meshd_config(backends), sort_keys=False))
    cmd = [sys.executable, "-m", "meshd.cli", "sidecar", "--config", str(path)]
    for override in settings.meshd_overrides:
        cmd += ["--set", override]
    try:
        child = start_child("meshd", cmd, workdir, _START_TIMEOUT_S)
        outbound = child.ready.get("outbound")
        if not isinstance(outbound, str):
            child.stop()
            raise StartError(f"meshd's ready line has no outbound address: {child.ready}")
    except (StartError, OSError) as exc:
        target.error = f"meshd could not start: {exc}"
        return None, target
    target.endpoints = (_hostport(outbound),)
    target.pid = child.proc.pid
    version = child.ready.get("version", "?")
    target.version = f"{version} (hot path: {child.ready.get('hot_path', '?')})"
    return child, target


def start_envoy_target(
    backends: Sequence[Endpoint], settings: Settings, workdir: Path
) -> tuple[EnvoyProcess | None, Target]:
    target = Target("envoy")
    try:
        config = render_static_config([(ep.host, ep.port) for ep in backends])
        envoy = start_envoy(config, workdir / "envoy", concurrency=settings.envoy_concurrency)
        target.version = f"{envoy_version()} --concurrency {settings.envoy_concurrency}"
    except (EnvoyNotInstalled, RuntimeError, OSError, subprocess.SubprocessError) as exc:
        target.error = f"envoy could not start: {exc}"
        return None, target
    target.endpoints = (Endpoint(*envoy.listener),)
    target.pid = envoy.pid
    return envoy, target


def _cpu(pid: int) -> float:
    return procstats.sample(pid, tree=True).cpu_s


def _backend_cpu(backends: Sequence[Child]) -> float:
    return sum(_cpu(b.proc.pid) for b in backends)


async def _measure(
    target: Target,
    backends: Sequence[Child],
    kind: str,
    settings: Settings,
    rate: float | None,
) -> Phase:
    gen = LoadGenerator(target.endpoints, completion_request(settings.tokens))
    concurrency = 1 if kind == "serial" else settings.concurrency
    duration = settings.serial_s if kind == "serial" else settings.saturation_s
    try:
        await gen.prewarm(4 if rate is not None else max(1, concurrency // 4))
        proxy0 = _cpu(target.pid) if target.pid is not None else None
        backend0 = _backend_cpu(backends)
        gen0 = procstats.self_cpu_seconds()
        machine0 = procstats.machine_cpu()
        wall0 = time.monotonic()
        if rate is not None:
            samples = await gen.open_loop(
                rate, settings.duration_s, seed=settings.seed, progress=True
            )
        else:
            samples = await gen.closed_loop(concurrency, duration, progress=True)
        gen_cpu = procstats.self_cpu_seconds() - gen0
        proxy_cpu = (
            _cpu(target.pid) - proxy0 if target.pid is not None and proxy0 is not None else None
        )
        backend_cpu = _backend_cpu(backends) - backend0
        machine1 = procstats.machine_cpu()
        wall = time.monotonic() - wall0
    finally:
        await gen.close()
    other = steal = None
    if machine0 is not None and machine1 is not None:
        ours = (proxy_cpu or 0.0) + backend_cpu + gen_cpu
        other = max(0.0, machine1[0] - machine0[0] - ours)
        steal = machine1[1] - machine0[1]
    summary = summarize(
        samples,
        "open" if rate is not None else "closed",
        target_rate=rate,
        concurrency=None if rate is not None else concurrency,
        connections=gen.connections_opened,
        generator_cpu_s=gen_cpu,
    )
    return Phase(target.name, kind, rate, summary, proxy_cpu, backend_cpu, other, steal, wall)


async def _warm(target: Target, settings: Settings) -> None:
    """Fill the proxy's upstream pools and the interpreters' caches; not recorded."""
    gen = LoadGenerator(target.endpoints, completion_request(settings.tokens))
    try:
        await gen.closed_loop(8, settings.warmup_s)
    finally:
        await gen.close()


async def run_phases(targets: Sequence[Target], backends: Sequence[Child], s: Settings) -> None:
    live = [t for t in targets if t.available]
    for t in live:
        await _warm(t, s)
    for t in live:
        print(f"  {t.name:<6} one request at a time for {s.serial_s:g} s", file=sys.stderr)
        t.phases.append(await _measure(t, backends, "serial", s, None))
    # Rate-major order interleaves the targets, so slow drift in the machine's background
    # load smears over all of them instead of landing on one.
    for rate in s.rates:
        for t in live:
            print(f"  {t.name:<6} open loop {rate:g}/s for {s.duration_s:g} s", file=sys.stderr)
            t.phases.append(await _measure(t, backends, "open", s, rate))
    for t in live:
        print(
            f"  {t.name:<6} saturation c={s.concurrency} for {s.saturation_s:g} s", file=sys.stderr
        )
        t.phases.append(await _measure(t, backends, "saturation", s, None))


# -- report --------------------------------------------------------------------------


def _phase(t: Target, kind: str, rate: float | None = None) -> Phase | None:
    for p in t.phases:
        if p.kind == kind and p.rate == rate:
            return p
    return None


def _cpu_per_1000(t: Target, kinds: tuple[str, ...]) -> float:
    phases = [p for p in t.phases if p.kind in kinds and p.proxy_cpu_s is not None]
    requests = sum(p.summary.requests for p in phases)
    if not requests:
        return math.nan
    return 1000.0 * sum(p.proxy_cpu_s or 0.0 for p in phases) / requests


def _gen_cpu_per_1000(t: Target) -> float:
    requests = sum(p.summary.requests for p in t.phases)
    cpu = sum(p.summary.generator_cpu_s for p in t.phases)
    return 1000.0 * cpu / requests if requests else math.nan


def _backend_cpu_per_1000(t: Target) -> float:
    requests = sum(p.summary.requests for p in t.phases)
    cpu = sum(p.backend_cpu_s for p in t.phases)
    return 1000.0 * cpu / requests if requests else math.nan


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or b <= 0:
        return math.nan
    return a / b


def _fmt(value: float, digits: int = 3) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: a figure per target and meshd/envoy."""

    label: str
    values: dict[str, float]
    ratio: float
    digits: int = 3
    direct_in_parens: bool = False


def build_rows(targets: dict[str, Target], settings: Settings) -> list[Row]:
    direct = targets["direct"]
    rows: list[Row] = []
    runs: list[tuple[str, str, float | None]] = [("serial", "one at a time", None)]
    runs += [("open", f"@ {rate:g}/s", rate) for rate in settings.rates]
    for kind, where, rate in runs:
        base = _phase(direct, kind, rate)
        for metric, attr, q in (
            ("TTFB p50", "ttfb_ms", "p50"),
            ("TTFB p99", "ttfb_ms", "p99"),
            ("TTLB p50", "ttlb_ms", "p50"),
            ("TTLB p99", "ttlb_ms", "p99"),
        ):
            values: dict[str, float] = {}
            base_v = getattr(getattr(base.summary, attr), q) if base else math.nan
            values["direct"] = base_v
            for name in ("meshd", "envoy"):
                p = _phase(targets[name], kind, rate)
                v = getattr(getattr(p.summary, attr), q) if p else math.nan
                values[name] = v - base_v
            rows.append(
                Row(
                    f"added {metric} {where} (ms)",
                    values,
                    _ratio(values["meshd"], values["envoy"]),
                    direct_in_parens=True,
                )
            )
    sat = {
        name: (p.summary.throughput if (p := _phase(t, "saturation")) else math.nan)
        for name, t in targets.items()
    }
    rows.append(
        Row(
            f"req/s at saturation (c={settings.concurrency})",
            sat,
            _ratio(sat["meshd"], sat["envoy"]),
            1,
        )
    )
    for label, kinds in (
        ("proxy CPU s / 1000 req (all)", ("serial", "open", "saturation")),
        ("proxy CPU s / 1000 req (open loop)", ("open",)),
        ("proxy CPU s / 1000 req (saturation)", ("saturation",)),
    ):
        cpu = {name: _cpu_per_1000(t, kinds) for name, t in targets.items()}
        rows.append(Row(label, cpu, _ratio(cpu["meshd"], cpu["envoy"])))
    rss = {
        name: (t.peak_rss / MB if t.peak_rss is not None else math.nan)
        for name, t in targets.items()
    }
    rows.append(Row("proxy peak RSS (MB)", rss, _ratio(rss["meshd"], rss["envoy"]), 1))
    gen = {name: _gen_cpu_per_1000(t) for name, t in targets.items()}
    rows.append(Row("load generator CPU s / 1000 req", gen, math.nan))
    backend = {name: _backend_cpu_per_1000(t) for name, t in targets.items()}
    rows.append(Row("backends CPU s / 1000 req", backend, math.nan))
    errors = {
        name: float(sum(p.summary.errors for p in t.phases)) if t.phases else math.nan
        for name, t in targets.items()
    }
    rows.append(Row("errors (all phases)", errors, math.nan, 0))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    width = max(len(r.label) for r in rows) + 2
    head = f"{'':<{width}}{'direct':>10}{'meshd':>10}{'envoy':>10}{'meshd/envoy':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        direct = _fmt(r.values.get("direct", math.nan), r.digits)
        if r.direct_in_parens and direct != "-":
            direct = f"({direct})"
        cells = [direct] + [_fmt(r.values.get(n, math.nan), r.digits) for n in ("meshd", "envoy")]
        ratio = _fmt(r.ratio, 2)
        lines.append(f"{r.label:<{width}}" + "".join(f"{c:>10}" for c in cells) + f"{ratio:>13}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Check:
    """One of the issue's targets and whether this run met it."""

    name: str
    verdict: str  # PASS, FAIL or SKIP
    detail: str


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else text


def checks(targets: dict[str, Target], settings: Settings) -> list[Check]:
    meshd, envoy, direct = targets["meshd"], targets["envoy"], targets["direct"]
    out: list[Check] = []
    name = f"added p50 TTFB at {TARGET_ADDED_TTFB_RATE:g}/s < {TARGET_ADDED_P50_TTFB_MS:g} ms"
    if not meshd.phases:
        out.append(Check(name, "SKIP", _first_line(meshd.error) or "meshd not measured"))
    else:
        rate = min(settings.rates, key=lambda r: abs(r - TARGET_ADDED_TTFB_RATE))
        m, d = _phase(meshd, "open", rate), _phase(direct, "open", rate)
        added = m.summary.ttfb_ms.p50 - d.summary.ttfb_ms.p50 if m and d else math.nan
        at = "" if rate == TARGET_ADDED_TTFB_RATE else f" (measured at {rate:g}/s)"
        verdict = "PASS" if added < TARGET_ADDED_P50_TTFB_MS else "FAIL"
        out.append(Check(name, verdict, f"meshd adds {_fmt(added)} ms{at}"))
    name = f"meshd CPU per request <= {TARGET_CPU_RATIO:g}x Envoy's"
    if not meshd.phases or not envoy.phases:
        why = _first_line(meshd.error or envoy.error) or "not measured"
        out.append(Check(name, "SKIP", why))
    else:
        ratio = _ratio(
            _cpu_per_1000(meshd, ("open", "saturation")),
            _cpu_per_1000(envoy, ("open", "saturation")),
        )
        verdict = "PASS" if ratio <= TARGET_CPU_RATIO else "FAIL"
        out.append(Check(name, verdict, f"meshd/envoy = {_fmt(ratio, 2)}x"))
    name = f"meshd peak RSS < {TARGET_PEAK_RSS_MB:g} MB"
    if meshd.peak_rss is None:
        out.append(Check(name, "SKIP", _first_line(meshd.error) or "not measured"))
    else:
        mb = meshd.peak_rss / MB
        verdict = "PASS" if mb < TARGET_PEAK_RSS_MB else "FAIL"
        out.append(Check(name, verdict, f"{mb:.1f} MB"))
    return out


def _cores(cpu_s: float | None, wall_s: float) -> str:
    return "-" if cpu_s is None or wall_s <= 0 else f"{cpu_s / wall_s:.2f}"


def other_work(targets: dict[str, Target]) -> tuple[float, float] | None:
    """Mean CPU cores busy outside the benchmark, and stolen, over every measured phase."""
    phases = [p for t in targets.values() for p in t.phases if p.other_cpu_s is not None]
    wall = sum(p.wall_s for p in phases)
    if not phases or wall <= 0:
        return None
    return (
        sum(p.other_cpu_s or 0.0 for p in phases) / wall,
        sum(p.steal_s or 0.0 for p in phases) / wall,
    )


def format_details(targets: dict[str, Target]) -> str:
    lines = ["per phase (absolute ms; offered/achieved rate; errors):"]
    for t in targets.values():
        for p in t.phases:
            s = p.summary
            what = f"open {p.rate:g}/s" if p.rate is not None else f"{p.kind} c={s.concurrency}"
            lines.append(
                f"  {t.name:<6} {what:<16} n={s.requests:<5} ok={s.ok:<5} "
                f"TTFB p50/p99 {s.ttfb_ms.p50:7.3f}/{s.ttfb_ms.p99:7.3f}  "
                f"TTLB p50/p99 {s.ttlb_ms.p50:7.3f}/{s.ttlb_ms.p99:7.3f}  "
                f"rate {s.offered_rate:6.1f}/{s.throughput:6.1f}  "
                f"lag p99 {s.lag_p99_ms:5.2f}  err {s.error_kinds or 0}  "
                f"other work {_cores(p.other_cpu_s, p.wall_s)} cores, "
                f"steal {_cores(p.steal_s, p.wall_s)}"
            )
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in load],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _summary_dict(p: Phase) -> dict[str, Any]:
    d = asdict(p)
    d["summary"] = p.summary.to_dict()
    return d


def _no_nan(value: Any) -> Any:
    """NaN (a figure that could not be measured) as JSON null, which every reader accepts."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def run_hotpath(timeout_s: float = 120.0) -> str | None:
    """Output of loadtest/hotpath_bench.py (Cython vs pure Python), when that script exists."""
    if not (REPO_ROOT / "loadtest" / "hotpath_bench.py").exists():
        return None
    try:
        out = subprocess.run(
            [sys.executable, "-m", "loadtest.hotpath_bench"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO_ROOT,
        )
    except subprocess.TimeoutExpired:
        return f"loadtest.hotpath_bench ran past {timeout_s:g} s"
    text = out.stdout.strip()
    if out.returncode != 0:
        text += f"\n(exit {out.returncode}) {out.stderr.strip()[-2000:]}"
    return text


PLACEMENTS = ("shared", "sidecar", "proxy-alone")


@dataclass(frozen=True, slots=True)
class Split:
    """Which CPUs each kind of process may run on (None: unpinned, every CPU)."""

    placement: str
    proxy: frozenset[int] | None = None
    backends: frozenset[int] | None = None
    load: frozenset[int] | None = None

    def describe(self) -> str:
        if self.proxy is None:
            return "shared: backends, proxy and load generator on every CPU"
        assert self.backends is not None and self.load is not None
        return (
            f"{self.placement}: proxy on CPU {sorted(self.proxy)}, backends on "
            f"{sorted(self.backends)}, load generator on {sorted(self.load)}"
        )


def split_cpus(cpus: set[int]) -> tuple[set[int], set[int]]:
    """proxy-alone: (the proxy's CPU, everyone else's): the lowest CPU alone, the rest shared."""
    ordered = sorted(cpus)
    return {ordered[0]}, set(ordered[1:])


def placement_split(placement: str, cpus: set[int]) -> Split:
    """The CPU sets of one placement (see the module docstring) on these CPUs."""
    if placement == "shared":
        return Split(placement)
    if len(cpus) < 2:
        raise ValueError(f"placement {placement!r} needs at least 2 CPUs, this process has 1")
    ordered = sorted(cpus)
    if placement == "proxy-alone":
        alone, rest = split_cpus(cpus)
        return Split(placement, frozenset(alone), frozenset(rest), frozenset(rest))
    if placement == "sidecar":
        # The engines get the lower half (their own machine); the app and its sidecar the
        # upper half, together, as containers of one pod share the pod's CPUs.
        half = len(ordered) // 2
        engine, pod = frozenset(ordered[:half]), frozenset(ordered[half:])
        return Split(placement, pod, engine, pod)
    raise ValueError(f"unknown placement {placement!r}: one of {', '.join(PLACEMENTS)}")


def pin_processes(targets: dict[str, Target], backends: Sequence[Child], split: Split) -> None:
    """Pins this load generator, the backends and the proxies as `split` says (each process's
    threads and children too)."""
    if split.proxy is None:
        return
    assert split.backends is not None and split.load is not None
    procstats.pin(os.getpid(), set(split.load))  # this load generator
    for b in backends:
        procstats.pin(b.proc.pid, set(split.backends))
    for t in targets.values():
        if t.pid is not None:
            procstats.pin(t.pid, set(split.proxy))
    print(f"pinned: {split.describe()}", file=sys.stderr)


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, list[str], str | None]:
    parser = argparse.ArgumentParser(prog="python -m loadtest.overhead", description=__doc__)
    parser.add_argument("--rates", default="50,100,200", help="open-loop rates, requests/s")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per open-loop run")
    parser.add_argument(
        "--serial", type=float, default=3.0, help="seconds of one-request-at-a-time runs"
    )
    parser.add_argument("--saturation", type=float, default=5.0, help="seconds of closed loop")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--backends", type=int, default=2, help="stub backend processes")
    parser.add_argument("--tokens", type=int, default=200, help="streamed tokens per answer")
    parser.add_argument("--envoy-concurrency", type=int, default=1, help="Envoy worker threads")
    parser.add_argument(
        "--token-delay-ms", type=float, default=0.0, help="backend pause between tokens"
    )
    parser.add_argument(
        "--meshd-set", action="append", default=[], metavar="KEY=VALUE", help="meshd --set"
    )
    parser.add_argument("--quick", action="store_true", help="one rate, short runs (< 60 s)")
    parser.add_argument("--no-hotpath", action="store_true", help="skip loadtest.hotpath_bench")
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    parser.add_argument(
        "--placement",
        default="shared",
        help="where processes may run, one or several (comma-separated, run in turn and "
        "compared): shared (every process on every CPU; default), sidecar (backends on CPUs "
        "of their own, as an engine on its GPU server; proxy and load generator together, "
        "as an app and its sidecar in one pod), proxy-alone (the proxy alone on one CPU). "
        "The last two need 2+ CPUs",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the same as --placement proxy-alone",
    )
    args = parser.parse_args(argv)
    rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    duration, serial, saturation = args.duration, args.serial, args.saturation
    if args.quick:
        rates = (TARGET_ADDED_TTFB_RATE,)
        duration, serial, saturation = min(duration, 5.0), min(serial, 2.0), min(saturation, 3.0)
    settings = Settings(
        rates=rates,
        duration_s=duration,
        serial_s=serial,
        saturation_s=saturation,
        concurrency=args.concurrency,
        backends=args.backends,
        tokens=args.tokens,
        envoy_concurrency=args.envoy_concurrency,
        warmup_s=0.5 if args.quick else 1.0,
        quick=args.quick,
        hotpath=not args.no_hotpath and not args.quick,
        meshd_overrides=tuple(args.meshd_set),
        token_delay_ms=args.token_delay_ms,
    )
    placements = ["proxy-alone"] if args.pin else [p.strip() for p in args.placement.split(",")]
    if args.pin and args.placement != "shared":
        parser.error("--pin is --placement proxy-alone: give one of them")
    for p in placements:
        if p not in PLACEMENTS:
            parser.error(f"--placement: unknown {p!r}, choose from {', '.join(PLACEMENTS)}")
        if p != "shared" and len(os.sched_getaffinity(0)) < 2:
            parser.error(f"--placement {p} needs at least 2 CPUs (this process has 1)")
    if len(set(placements)) != len(placements):
        parser.error("--placement: each placement once")
    return settings, placements, args.json


@dataclass
class Run:
    """One placement's measurements."""

    split: Split
    targets: dict[str, Target]
    rows: list[Row]
    verdicts: list[Check]
    elapsed_s: float
    env_before: dict[str, Any]
    env_after: dict[str, Any]


def run_placement(settings: Settings, placement: str, cpus: set[int]) -> Run:
    """Starts the backends, meshd and Envoy afresh, places them and measures every phase."""
    started = time.monotonic()
    env_before = environment()
    split = placement_split(placement, cpus)
    workdir = Path(tempfile.mkdtemp(prefix="meshd-overhead-"))
    backends: list[Child] = []
    meshd_child: Child | None = None
    envoy: EnvoyProcess | None = None
    try:
        backends = start_backends(settings, workdir)
        backend_eps = [Endpoint("127.0.0.1", int(b.ready["port"])) for b in backends]
        direct = Target("direct", endpoints=tuple(backend_eps), version="client round robin")
        meshd_child, meshd = start_meshd(backend_eps, settings, workdir)
        envoy, envoy_t = start_envoy_target(backend_eps, settings, workdir)
        targets = {"direct": direct, "meshd": meshd, "envoy": envoy_t}
        for t in targets.values():
            if t.error:
                print(f"!! {t.error}", file=sys.stderr)
        pin_processes(targets, backends, split)
        install_fast_loop()
        asyncio.run(run_phases(list(targets.values()), backends, settings))
        for t in targets.values():
            if t.pid is not None and t.phases:
                t.peak_rss = procstats.sample(t.pid, tree=True).peak_rss
    finally:
        if meshd_child is not None:
            meshd_child.stop()
        if envoy is not None:
            envoy.stop()
        for b in backends:
            b.stop()
        if split.proxy is not None:
            procstats.pin(os.getpid(), cpus)  # the next placement starts from every CPU
        shutil.rmtree(workdir, ignore_errors=True)
    return Run(
        split,
        targets,
        build_rows(targets, settings),
        checks(targets, settings),
        time.monotonic() - started,
        env_before,
        environment(),
    )


def print_run(run: Run, settings: Settings) -> None:
    targets, env_before = run.targets, run.env_before
    print()
    delay = (
        "no backend delay"
        if not settings.token_delay_ms
        else f"{settings.token_delay_ms:g} ms between tokens"
    )
    print(
        f"meshd data-plane overhead: {settings.tokens}-token streamed /v1/completions, "
        f"{settings.backends} stub backend process(es), {delay}"
    )
    print(
        f"runs per target: one request at a time for {settings.serial_s:g} s; open loop "
        f"(Poisson) at {', '.join(f'{r:g}' for r in settings.rates)} req/s for "
        f"{settings.duration_s:g} s each; saturation: {settings.concurrency} closed-loop clients "
        f"for {settings.saturation_s:g} s. Whole run took {run.elapsed_s:.0f} s."
    )
    if run.split.proxy is not None:
        print(
            f"machine: {env_before['cpus']} CPUs; placement {run.split.describe()} (load "
            f"average {env_before['loadavg'][0]} at start). Saturation is then bounded by "
            "the CPUs each side has as much as by the proxy."
        )
    else:
        print(
            f"machine: {env_before['cpus']} CPUs shared by the backends, the proxy, this load "
            f"generator and any other work (placement shared; load average "
            f"{env_before['loadavg'][0]} at start): saturation and CPU figures are "
            "contended, ratios mean more than absolutes."
        )
    for t in targets.values():
        state = f"error: {t.error}" if t.error else t.version
        print(f"  {t.name:<6} {state}")
    contention = other_work(targets)
    if contention is not None:
        print(
            f"other work on the machine during the phases: {contention[0]:.2f} CPU cores busy "
            f"outside the benchmark, {contention[1]:.2f} stolen by the hypervisor (of "
            f"{env_before['cpus']}). While other work holds a core, a proxy shares the other "
            "with its backend, and the latency rows measure the scheduler as much as the proxy."
        )
    print()
    print(format_table(run.rows))
    print("  (direct) = the direct figure itself; other latency cells are added to it.")
    print(
        "  Envoy reads a busy socket until EAGAIN before forwarding, so against a zero-delay\n"
        "  backend its first byte leaves late at low rates (envoy/README.md); try --token-delay-ms."
    )
    print()
    for c in run.verdicts:
        print(f"{c.verdict:<4}  [{run.split.placement}] {c.name}: {c.detail}")
    print()
    print(format_details(targets))


def comparison_rows(
    runs: Sequence[Run], settings: Settings
) -> list[tuple[str, str, str, str, str]]:
    """Per placement, the headline figures side by side: meshd's and Envoy's added TTFB p50
    at the target rate (or the rate nearest it), their ratio, and meshd/Envoy CPU."""
    rate = min(settings.rates, key=lambda r: abs(r - TARGET_ADDED_TTFB_RATE), default=None)
    ttfb_label = f"added TTFB p50 @ {rate:g}/s (ms)"
    out = []
    for run in runs:
        by_label = {r.label: r for r in run.rows}
        ttfb, cpu = by_label.get(ttfb_label), by_label.get("proxy CPU s / 1000 req (all)")
        out.append(
            (
                run.split.placement,
                "-" if ttfb is None else _fmt(ttfb.values["meshd"]),
                "-" if ttfb is None else _fmt(ttfb.values["envoy"]),
                "-" if ttfb is None else _fmt(ttfb.ratio, 2),
                "-" if cpu is None else _fmt(cpu.ratio, 2),
            )
        )
    return out


def _run_report(run: Run) -> dict[str, Any]:
    return {
        "placement": run.split.placement,
        "cpus": None
        if run.split.proxy is None
        else {
            "proxy": sorted(run.split.proxy),
            "backends": sorted(run.split.backends or ()),
            "load": sorted(run.split.load or ()),
        },
        "environment": {"start": run.env_before, "end": run.env_after},
        "elapsed_s": run.elapsed_s,
        "targets": {
            name: {
                "endpoints": [str(e) for e in t.endpoints],
                "version": t.version,
                "error": t.error,
                "peak_rss_bytes": t.peak_rss,
                "phases": [_summary_dict(p) for p in t.phases],
            }
            for name, t in run.targets.items()
        },
        "table": [asdict(r) for r in run.rows],
        "checks": [asdict(c) for c in run.verdicts],
    }


def main(argv: Sequence[str] | None = None) -> int:
    settings, placements, json_path = parse_args(argv)
    cpus = os.sched_getaffinity(0)
    runs: list[Run] = []
    for placement in placements:
        run = run_placement(settings, placement, cpus)
        print_run(run, settings)
        runs.append(run)
    if len(runs) > 1:
        print("\nplacements compared: added TTFB p50 (ms) at the target rate, meshd/envoy")
        print(f"  {'placement':<12} {'meshd':>8} {'envoy':>8} {'meshd/envoy':>12} {'CPU m/e':>8}")
        for name, m, e, ratio, cpu in comparison_rows(runs, settings):
            print(f"  {name:<12} {m:>8} {e:>8} {ratio:>12} {cpu:>8}")

    hotpath: str | None = None
    if settings.hotpath:
        hotpath = run_hotpath()
        if hotpath is not None:
            print("\nCython vs pure Python (loadtest.hotpath_bench):\n" + hotpath)
    if json_path:
        report: dict[str, Any] = {"settings": asdict(settings), "hotpath": hotpath}
        if len(runs) == 1:
            report.update(_run_report(runs[0]))
        else:
            report["runs"] = [_run_report(r) for r in runs]
        Path(json_path).write_text(json.dumps(_no_nan(report), indent=2, default=str))
        print(f"\nwrote {json_path}")
    return 1 if any(c.verdict == "FAIL" for r in runs for c in r.verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
