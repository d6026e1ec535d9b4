"""The engine fleet of one benchmark pass, in a child process of its own.

Engines run apart from the load client and the router so the three use both cores. The
child (`python -m loadtest.bench.fleet --spec JSON`) starts the engines, prints one JSON
line {"event": "ready", "engines": [...]} and serves until SIGTERM or until its stdin
closes (the parent died). Kinds: "sim" (loadtest.engine's vLLM simulator, with prefix
cache, queue and GPU profiles) or "stub" (loadtest.stub_backend: instant tokens, no cache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

FleetKind = Literal["sim", "stub"]
FLEET_KINDS: tuple[FleetKind, ...] = ("sim", "stub")
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
# Specialty-cloud on-demand $/GPU-hour, for stub fleets without the simulator's profiles
# (the same figures as loadtest/engine/profiles.py, which cites its sources).
FALLBACK_PRICES: dict[str, float] = {"A100": 1.30, "H100": 3.00, "H200": 4.00, "B200": 5.50}


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """What engines a pass runs: one GPU name per engine, and how they are simulated.

    time_scale: simulated seconds per wall second (sim only). kv_blocks: KV-cache blocks
    per engine, None for the GPU profile's own (tens of thousands); a small value makes
    eviction, and so routing for cache affinity, matter in a short run.
    """

    gpus: tuple[str, ...]
    kind: FleetKind = "sim"
    model: str | None = None
    time_scale: float = 1.0
    kv_blocks: int | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.gpus:
            raise ValueError("a fleet needs at least one engine")
        if self.kind not in FLEET_KINDS:
            raise ValueError(f"fleet kind must be one of {FLEET_KINDS}, got {self.kind!r}")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["gpus"] = list(self.gpus)
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> FleetSpec:
        return cls(**{**doc, "gpus": tuple(doc["gpus"])})


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """One running engine: where it listens, its GPU and what that GPU costs, and its KV
    cache in tokens where known (a simulated engine's kv_blocks x block_size)."""

    name: str
    url: str
    gpu: str
    price_per_gpu_hour: float
    kv_capacity_tokens: int | None = None


def fleet_gpus(engines: int, gpus: Sequence[str]) -> tuple[str, ...]:
    """`engines` GPU names cycling through `gpus`: (8, [H100, A100]) -> 4 of each."""
    if engines < 1 or not gpus:
        raise ValueError("need engines >= 1 and at least one GPU name")
    names = [g.strip().upper() for g in gpus if g.strip()]
    return tuple(names[i % len(names)] for i in range(engines))


def engine_specs(spec: FleetSpec) -> list[Any]:
    """The loadtest.engine EngineSpecs a sim fleet runs for `spec`, one per GPU name: the
    spec's model, KV blocks, time scale and extras, a seed and a name per engine. The one
    recipe: the fleet child, the virtual clock and the TTFT floor all build engines here."""
    from dataclasses import replace

    from loadtest.engine.config import EngineSpec, mixed_fleet

    kwargs: dict[str, Any] = {"time_scale": spec.time_scale, "kv_blocks": spec.kv_blocks}
    if spec.model:
        kwargs["model"] = spec.model
    kwargs.update(spec.extra)
    base = replace(EngineSpec(), **kwargs)
    return [
        # Names that say the GPU read better in the report than engine-3.
        replace(s, seed=spec.seed + i, name=f"{s.gpu.lower()}-{i}")
        for i, s in enumerate(mixed_fleet(len(spec.gpus), spec.gpus, base=base))
    ]


def sim_unavailable() -> str | None:
    """Why the engine simulator cannot run here, or None when it can."""
    for module in ("loadtest.engine.fleet", "loadtest.engine.config"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"the engine simulator ({module}) is not in this tree"
    return None


def price_of(gpu: str) -> float:
    try:
        from loadtest.engine.profiles import get_profile

        return get_profile(gpu).price_per_gpu_hour
    except (ImportError, ValueError):
        return FALLBACK_PRICES.get(gpu.upper(), 0.0)


class FleetProcess:
    """A running fleet child; `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(
        self, proc: asyncio.subprocess.Process, engines: tuple[EngineInfo, ...], log_path: Path
    ) -> None:
        self.proc = proc
        self.engines = engines
        self.log_path = log_path

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(e.url for e in self.engines)

    async def stop(self) -> None:
        await stop_process(self.proc)


async def stop_process(proc: asyncio.subprocess.Process, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL; closes a stdin pipe first."""
    if proc.stdin is not None:
        with contextlib.suppress(Exception):
            proc.stdin.close()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def read_ready_line(
    proc: asyncio.subprocess.Process, timeout_s: float, what: str, log_path: Path
) -> dict[str, Any]:
    """The first stdout line of `proc` that is JSON with "event": "ready".

    On any failure, cancellation included, the process is stopped before the error
    propagates: a child that never became ready is never left behind.
    """
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(timeout_s):
            while line := await proc.stdout.readline():
                with contextlib.suppress(ValueError):
                    doc = json.loads(line)
                    if isinstance(doc, dict) and doc.get("event") == "ready":
                        return doc
    except TimeoutError:
        await stop_process(proc)
        raise RuntimeError(
            f"{what} was not ready within {timeout_s:g} s; log: {log_path}"
        ) from None
    except BaseException:
        await stop_process(proc)
        raise
    await proc.wait()
    tail = log_tail(log_path)
    raise RuntimeError(f"{what} exited ({proc.returncode}) before it was ready:\n{tail}")


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def start_fleet(spec: FleetSpec, log_path: Path) -> FleetProcess:
    """Start the fleet child and wait for its ready line."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loadtest.bench.fleet",
            "--spec",
            json.dumps(spec.to_json()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
    doc = await read_ready_line(proc, READY_TIMEOUT_S, f"the {spec.kind} fleet", log_path)
    engines = tuple(EngineInfo(**e) for e in doc["engines"])
    return FleetProcess(proc, engines, log_path)


# ---- the child ---------------------------------------------------------------------


async def _serve_stub(spec: FleetSpec, host: str) -> tuple[list[EngineInfo], list[Any]]:
    from aiohttp import web

    from loadtest.stub_backend import StubConfig, make_app

    config = StubConfig(model=spec.model or "stub-model")
    infos, runners = [], []
    for i, gpu in enumerate(spec.gpus):
        runner = web.AppRunner(make_app(config), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, 0, backlog=1024)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        infos.append(EngineInfo(f"stub-{i}", f"http://{host}:{port}", gpu, price_of(gpu)))
        runners.append(runner)
    return infos, runners


async def _serve_sim(spec: FleetSpec, host: str) -> tuple[list[EngineInfo], list[Any]]:
    from loadtest.engine import EngineFleet

    fleet = EngineFleet(engine_specs(spec), host=host)
    await fleet.start()
    return engine_infos(fleet), [fleet]


def engine_infos(fleet: Iterable[Any]) -> list[EngineInfo]:
    """What a started simulator fleet's ready line says of each engine."""
    return [
        EngineInfo(
            e.name,
            e.url,
            e.profile.gpu,
            e.profile.price_per_gpu_hour,
            e.profile.kv_blocks * e.profile.block_size,
        )
        for e in fleet
    ]


async def _child(spec: FleetSpec, host: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if spec.kind == "stub":
        infos, handles = await _serve_stub(spec, host)
    else:
        infos, handles = await _serve_sim(spec, host)
    print(json.dumps({"event": "ready", "engines": [asdict(e) for e in infos]}), flush=True)

    async def stdin_closed() -> None:
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await reader.read()
        stop.set()

    watcher = asyncio.create_task(stdin_closed())
    await stop.wait()
    watcher.cancel()
    for handle in handles:
        with contextlib.suppress(Exception):
            await (handle.cleanup() if spec.kind == "stub" else handle.stop())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.fleet", description=__doc__)
    parser.add_argument("--spec", required=True, help="FleetSpec as JSON")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    spec = FleetSpec.from_json(json.loads(args.spec))
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_child(spec, args.host))
    return uvloop.run(_child(spec, args.host))


if __name__ == "__main__":
    sys.exit(main())
