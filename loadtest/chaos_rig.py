"""The processes of one fault-campaign scenario (loadtest/chaos.py): simulated engines, the
meshd sidecar, control planes and engine agents, each a real child process that can be
killed (SIGKILL), stopped (SIGTERM) and started again on the same port; where a scenario
asks, a delay proxy (loadtest/chaos_delay.py) in front of each engine; plus iptables in a
network namespace and the probe that says whether it works here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.bench.fleet import log_tail, stop_process
from loadtest.bench.scrape import RUNNING, WAITING, parse_metrics
from loadtest.chaos_delay import DelayProxy

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
READY_TIMEOUT_S = 30.0
ATTEMPTS = "meshd_upstream_attempts"
REQUEST_SUCCESS = "vllm:request_success"
RESUMES = "meshd_stream_resumes"


@dataclass(frozen=True, slots=True)
class RigSettings:
    """What one scenario runs: `engines` simulated H100s (`time_scale` simulated seconds
    per wall second, `max_num_seqs` running requests each), the sidecar's config on top of
    the campaign's (`sidecar`, merged), control planes / agents when asked for, and with
    `delay_proxies` the sidecar reaching each engine through a DelayProxy (the others
    connect to the engines directly: a proxy is one more hop and the campaign's CPU)."""

    engines: int = 3
    time_scale: float = 2.0
    max_num_seqs: int = 8
    control_planes: int = 0
    agents: bool = False
    delay_proxies: bool = False
    sidecar: dict[str, Any] = field(default_factory=dict)


async def _readline_matching(
    proc: asyncio.subprocess.Process, pattern: re.Pattern[str], what: str, log: Path
) -> re.Match[str]:
    """The first stdout line of `proc` matching `pattern`; the process is stopped on failure."""
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            while line := await proc.stdout.readline():
                if m := pattern.search(line.decode(errors="replace")):
                    return m
    except BaseException:
        await stop_process(proc, 2.0)
        raise
    await proc.wait()
    raise RuntimeError(f"{what} exited ({proc.returncode}) before it was ready:\n{log_tail(log)}")


async def _discard(stream: asyncio.StreamReader | None) -> None:
    if stream is None:
        return
    with contextlib.suppress(Exception):
        while await stream.read(65536):
            pass


class Child:
    """A `python -m meshd.cli ...` child: started, killed, stopped, started again with the
    same argv (so on the same port)."""

    pattern: re.Pattern[str] = re.compile(r".")

    def __init__(self, name: str, argv: Sequence[str], workdir: Path) -> None:
        self.name = name
        self.argv = [sys.executable, "-m", "meshd.cli", *argv]
        self.log = workdir / f"{name}.log"
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self.ready: re.Match[str] | None = None

    async def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )
        self.ready = await _readline_matching(self.proc, self.pattern, self.name, self.log)
        self._reader = asyncio.create_task(_discard(self.proc.stdout))
        self.bound(self.ready)

    def bound(self, ready: re.Match[str]) -> None:
        """Called once the child is ready: a child started on port 0 keeps the port it got,
        so that a restart listens where its clients already connect."""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            await self.proc.wait()

    async def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.proc.wait(), timeout_s)
        return None

    async def stop(self) -> None:
        if self.proc is not None:
            await stop_process(self.proc, 5.0)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class Engine(Child):
    """One simulated vLLM engine (`meshd sim-engine`) on a fixed port."""

    pattern = re.compile(r"url=(\S+)")

    def __init__(self, index: int, rig: RigSettings, workdir: Path) -> None:
        argv = ["sim-engine", "--port", "0", "--gpu", "H100", "--seed", "0"]
        argv += ["--time-scale", f"{rig.time_scale:g}", "--max-num-seqs", str(rig.max_num_seqs)]
        super().__init__(f"engine-{index}", argv, workdir)
        self.url = ""
        self.port = 0

    def bound(self, ready: re.Match[str]) -> None:
        self.url = ready.group(1)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.argv[self.argv.index("--port") + 1] = str(self.port)

    async def fault(self, session: aiohttp.ClientSession, doc: dict[str, Any]) -> None:
        async with session.post(self.url + "/admin/fault", json=doc) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.name}: fault {doc} refused: {await r.text()}")

    async def served(self, session: aiohttp.ClientSession) -> float:
        """Requests finished, running or waiting so far (0 when it does not answer)."""
        names = (RUNNING, WAITING, REQUEST_SUCCESS)
        try:
            async with session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(2)) as r:
                return sum(parse_metrics(await r.text(), names).values())
        except (aiohttp.ClientError, TimeoutError):
            return 0.0

    async def in_flight(self, session: aiohttp.ClientSession) -> float | None:
        """Requests the engine runs or queues now (None: it does not answer)."""
        try:
            async with session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(2)) as r:
                m = parse_metrics(await r.text(), (RUNNING, WAITING))
        except (aiohttp.ClientError, TimeoutError):
            return None
        return m.get(RUNNING, 0.0) + m.get(WAITING, 0.0)


class ControlPlaneChild(Child):
    pattern = re.compile(r"control plane on (\S+)")

    def __init__(self, index: int, workdir: Path) -> None:
        argv = ["control-plane", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]
        super().__init__(f"control-plane-{index}", [*argv, "--log-level", "warning"], workdir)
        self.address = ""

    def bound(self, ready: re.Match[str]) -> None:
        self.address = ready.group(1)
        self.argv[self.argv.index("--listen") + 1] = self.address


class AgentChild(Child):
    pattern = re.compile(r"meshd agent for")

    def __init__(self, engine: Engine, planes: Sequence[str], workdir: Path) -> None:
        argv = ["agent", "--engine", engine.url, "--name", engine.name, "--pool", "default"]
        argv += ["--gpu", "H100", "--no-nvml", "--interval", "0.5", "--heartbeat", "1"]
        for p in planes:
            argv += ["--control-plane", p]
        super().__init__(f"agent-{engine.name}", [*argv, "--log-level", "warning"], workdir)


class SidecarChild(Child):
    """`meshd sidecar --config FILE`; after its first start it keeps its ports, so a
    restart listens where clients already send."""

    pattern = re.compile(r'(\{"event": "ready".*\})')

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.config_path = workdir / "meshd-sidecar.yaml"
        self.config = config
        super().__init__("sidecar", ["sidecar", "--config", str(self.config_path)], workdir)
        self.url = ""
        self.admin_url = ""

    async def start(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        await super().start()
        assert self.ready is not None
        doc = json.loads(self.ready.group(1))
        self.url, self.admin_url = f"http://{doc['outbound']}", f"http://{doc['admin']}"
        host, _, port = doc["outbound"].rpartition(":")
        ahost, _, aport = doc["admin"].rpartition(":")
        self.config["listeners"]["outbound"] = {"host": host, "port": int(port)}
        self.config["listeners"]["admin"] = {"host": ahost, "port": int(aport)}

    async def counters(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """Upstream attempts and resumed streams so far (empty when it does not answer)."""
        try:
            async with session.get(
                self.admin_url + "/metrics", timeout=aiohttp.ClientTimeout(3)
            ) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            return {}
        resumed = 0.0
        for line in text.splitlines():
            if line.startswith(RESUMES + "_total{") and 'outcome="resumed"' in line:
                resumed += float(line.rsplit(" ", 1)[1])
        return {"attempts": parse_metrics(text, (ATTEMPTS,)).get(ATTEMPTS, 0.0), "resumed": resumed}


def sidecar_config(endpoints: Sequence[str], planes: Sequence[str]) -> dict[str, Any]:
    """The campaign's sidecar, reaching the engines at `endpoints`: meshd's defaults, but
    timeouts that fit 10-20 s scenarios (a silent engine is left after 2 s, a request gets
    15 s in all) and small limits that the client scenarios can reach."""
    config: dict[str, Any] = {
        "listeners": {
            "outbound": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
        },
        "pools": [{"name": "default", "endpoints": [{"url": u, "gpu": "H100"} for u in endpoints]}],
        "upstream": {
            "connect_timeout_s": 1,
            "first_byte_timeout_s": 4,
            "idle_timeout_s": 2,
            "request_timeout_s": 15,
        },
        "limits": {
            "max_body_bytes": 65536,
            "client_header_timeout_s": 3,
            "client_body_timeout_s": 3,
        },
        "drain": {"grace_period_s": 5},
        "log_level": "warning",
    }
    if planes:
        config["control_plane"] = {"addresses": list(planes), "stale_after_s": 5}
    return config


class Rig:
    """Engines, control planes, agents and the sidecar of one scenario; `async with`
    starts them all and stops whatever is left."""

    def __init__(self, settings: RigSettings, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.workdir = workdir
        self.engines = [Engine(i, settings, workdir) for i in range(settings.engines)]
        self.planes = [ControlPlaneChild(i, workdir) for i in range(settings.control_planes)]
        # Built once the engines and control planes have their ports.
        self.agents: list[AgentChild] = []
        self.proxies: list[DelayProxy] = []
        self._sidecar: SidecarChild | None = None

    @property
    def sidecar(self) -> SidecarChild:
        assert self._sidecar is not None, "the rig is not started"
        return self._sidecar

    def children(self) -> list[Child]:
        tail = [self._sidecar] if self._sidecar is not None else []
        return [*self.engines, *self.planes, *self.agents, *tail]

    def proxy(self, engine: Engine) -> DelayProxy:
        """The delay proxy the sidecar reaches `engine` through (RigSettings.delay_proxies)."""
        assert self.proxies, "this rig has no delay proxies"
        return self.proxies[self.engines.index(engine)]

    async def __aenter__(self) -> Rig:
        from meshd.config import deep_merge

        try:
            await asyncio.gather(*(e.start() for e in self.engines))
            if self.settings.delay_proxies:
                self.proxies = [DelayProxy("127.0.0.1", e.port) for e in self.engines]
                await asyncio.gather(*(p.start() for p in self.proxies))
            endpoints = [p.url for p in self.proxies] or [e.url for e in self.engines]
            await asyncio.gather(*(p.start() for p in self.planes))
            addresses = [p.address for p in self.planes]
            if self.settings.agents:
                self.agents = [AgentChild(e, addresses, self.workdir) for e in self.engines]
            await asyncio.gather(*(a.start() for a in self.agents))
            config = deep_merge(sidecar_config(endpoints, addresses), self.settings.sidecar)
            self._sidecar = SidecarChild(config, self.workdir)
            await self._sidecar.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.children()), return_exceptions=True)
        await asyncio.gather(*(p.close() for p in self.proxies), return_exceptions=True)


# ---- the network ----------------------------------------------------------------------


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=30)


def netns_unavailable() -> str | None:
    """Why a scenario cannot run in a network namespace with iptables here, or None."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace and install iptables rules"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command"
    ns = f"meshd-chaos-probe-{os.getpid()}"
    done = _run(["ip", "netns", "add", ns])
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    try:
        done = _run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-j", "ACCEPT"])
        if done.returncode != 0:
            return f"iptables in a namespace failed: {done.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", ns])
    return None


HOST_NETNS_ENV = "MESHD_CHAOS_HOST_NETNS"


def netns_id() -> str:
    """This process's network namespace (the inode of /proc/self/ns/net)."""
    return str(os.stat("/proc/self/ns/net").st_ino)


def _own_namespace() -> None:
    """Refuse to touch the campaign's own network (iptables, qdiscs): only a process in
    another namespace than the one that started it (HOST_NETNS_ENV says which) may."""
    host = os.environ.get(HOST_NETNS_ENV)
    if host is None or host == netns_id():
        raise RuntimeError("refusing to change this host's network: not in a namespace of its own")


def partition(port: int, on: bool) -> None:
    """Drop every TCP packet to or from `port` on this namespace's loopback (on), or
    remove those rules. Only for a process inside a namespace of its own."""
    _own_namespace()
    op = "-I" if on else "-D"
    for match in ("--dport", "--sport"):
        done = _run(["iptables", op, "INPUT", "-p", "tcp", match, str(port), "-j", "DROP"])
        if done.returncode != 0 and on:
            raise RuntimeError(f"iptables failed: {done.stderr.strip()}")


def in_namespace(ns: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]
