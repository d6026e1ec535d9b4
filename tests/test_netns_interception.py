"""Transparent interception for real: iptables in a network namespace, `meshd iptables`
installing the rules, `meshd sidecar` running as its own UID, unmodified clients.

Two namespaces joined by a veth pair (10.231.0.0/30, reachable from nowhere else): `client`
holds the sidecar (UID 1337) and the clients (root); `server` holds an OpenAI-shaped engine
on :8000 (an inference service in the sidecar's config), an echo server on :7000 (redirected,
not inference: raw TCP passthrough) and one on :2222 (excluded from redirection). Each echo
server reports the source port it saw, which tells whether a connection came straight from
the client or through the sidecar.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from netns import NetnsPair, Process, missing_prerequisites, run

pytestmark = pytest.mark.netns

HERE = Path(__file__).parent
REPO = HERE.parent
SCRIPT = str(HERE / "netns.py")
PROXY_UID = 1337
SERVICE_PORT = 8000
RAW_PORT = 7000
EXCLUDED_PORT = 2222
TRANSPARENT_PORT = 15006


@dataclass
class Mesh:
    pair: NetnsPair
    workdir: Path
    backend_log: Path
    sidecar: Process
    env: dict[str, str]

    def in_client(self, *argv: str) -> Any:
        done = run(self.pair.exec_argv(self.pair.client, [sys.executable, SCRIPT, *argv]))
        return json.loads(done.stdout)

    def requests(self, marker: str) -> list[dict[str, Any]]:
        lines = self.backend_log.read_text().splitlines() if self.backend_log.exists() else []
        return [e for e in map(json.loads, lines) if marker in e["body"]]

    def counter(self, comment: str) -> int:
        """Packets that matched the MESHD_OUTPUT rule with this comment (nat: one per
        new connection)."""
        out = run(self.pair.exec_argv(
            self.pair.client, ["iptables", "-w", "-t", "nat", "-S", "MESHD_OUTPUT", "-v"]
        )).stdout  # fmt: skip
        for line in out.splitlines():
            if f'"meshd: {comment}"' in line:
                found = re.search(r"-c (\d+) \d+", line)
                assert found is not None, line
                return int(found.group(1))
        raise AssertionError(f"no rule {comment!r} in:\n{out}")


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    reason = missing_prerequisites()
    if reason is not None:
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="meshd-netns-"))
    # The sidecar runs as UID 1337 and must read its config.
    workdir.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    procs: list[Process] = []
    pair = NetnsPair()

    def start(ns: str, name: str, argv: list[str]) -> Process:
        proc = Process(pair.exec_argv(ns, argv), stderr_path=workdir / f"{name}.log", env=env)
        procs.append(proc)
        return proc

    try:
        pair.create()
        backend_log = workdir / "engine-requests.jsonl"
        ip = pair.server_ip
        servers = [
            start(pair.server, "engine", [sys.executable, SCRIPT, "http-backend",
                  "--host", ip, "--port", str(SERVICE_PORT), "--log", str(backend_log)]),
            start(pair.server, "echo-raw", [sys.executable, SCRIPT, "echo",
                  "--host", ip, "--port", str(RAW_PORT)]),
            start(pair.server, "echo-excluded", [sys.executable, SCRIPT, "echo",
                  "--host", ip, "--port", str(EXCLUDED_PORT)]),
        ]  # fmt: skip
        config = workdir / "sidecar.yaml"
        config.write_text(
            f"""\
listeners:
  outbound: {{host: 127.0.0.1, port: 15001}}
  transparent: {{enabled: true, host: 0.0.0.0, port: {TRANSPARENT_PORT}}}
  admin: {{host: 127.0.0.1, port: 15000}}
pools:
  - name: default
    endpoints: ["http://{ip}:{SERVICE_PORT}"]
transparent:
  services:
    - {{address: "{ip}:{SERVICE_PORT}", pool: default}}
"""
        )
        config.chmod(0o644)
        iptables = [sys.executable, "-m", "meshd.cli", "iptables", "--apply",
                    "--proxy-port", str(TRANSPARENT_PORT), "--proxy-uid", str(PROXY_UID),
                    "--exclude-ports", str(EXCLUDED_PORT)]  # fmt: skip
        # Twice: re-applying must leave one hook and the same chains.
        for _ in range(2):
            run(pair.exec_argv(pair.client, iptables))
        # CAP_DAC_READ_SEARCH only lets UID 1337 read the checkout and interpreter wherever
        # they live (/root, a CI workspace); the owner match sees UID 1337 all the same.
        sidecar = start(pair.client, "sidecar", [
            "setpriv", f"--reuid={PROXY_UID}", f"--regid={PROXY_UID}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--",
            sys.executable, "-m", "meshd.cli", "sidecar", "--config", str(config),
        ])  # fmt: skip
        for proc in servers:
            proc.wait_ready()
        ready = sidecar.wait_ready()
        assert ready["transparent"].endswith(f":{TRANSPARENT_PORT}"), ready
        yield Mesh(pair, workdir, backend_log, sidecar, env)
    finally:
        for proc in reversed(procs):
            proc.stop()
        pair.close()
        shutil.rmtree(workdir, ignore_errors=True)


def test_rules_are_installed_once_even_when_applied_twice(mesh: Mesh) -> None:
    out = run(mesh.pair.exec_argv(mesh.pair.client, ["iptables", "-w", "-t", "nat", "-S"])).stdout
    hooks = [line for line in out.splitlines() if line.startswith("-A OUTPUT")]
    assert hooks == [
        '-A OUTPUT -p tcp -m comment --comment "meshd: outbound capture" -j MESHD_OUTPUT'
    ]
    assert out.count("--uid-owner 1337") == 1
    status = Path(f"/proc/{mesh.sidecar.proc.pid}/status").read_text()
    assert re.search(rf"^Uid:\s+{PROXY_UID}\s", status, re.M), "sidecar must run as UID 1337"


def test_unmodified_client_request_is_intercepted_and_not_looped(mesh: Mesh) -> None:
    marker = f"netns-{uuid.uuid4().hex}"
    body = json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": marker}], "max_tokens": 4}
    )
    captured_before = mesh.counter("capture")
    got = mesh.in_client(
        "http-client", "--host", mesh.pair.server_ip, "--port", str(SERVICE_PORT), "--body", body
    )
    assert got["status"] == 200, (got, mesh.sidecar.stderr())
    doc = json.loads(got["body"])
    assert doc["object"] == "chat.completion"
    assert doc["choices"][0]["message"]["content"] == "hello from the engine"
    # (1) intercepted: the engine saw the request come from the sidecar, which marks it.
    seen = mesh.requests(marker)
    assert len(seen) == 1, seen  # (2) and exactly once: the sidecar's upstream did not loop
    assert seen[0]["via"] == ["1.1 meshd"]
    assert seen[0]["peer"][1] != got["local_port"]
    assert seen[0]["path"] == "/v1/chat/completions"
    # (2) the client's connection was the only one redirected; the sidecar's own connection
    # to the same address:port returned at the owner rule.
    assert mesh.counter("capture") - captured_before == 1
    assert mesh.counter("sidecar traffic") >= 1


def test_excluded_port_goes_straight_to_the_destination(mesh: Mesh) -> None:
    before = mesh.counter("excluded ports")
    got = mesh.in_client(
        "tcp-client", "--host", mesh.pair.server_ip, "--port", str(EXCLUDED_PORT),
        "--size", str(64 * 1024),
    )  # fmt: skip
    # (3) the server saw the client's own socket: no sidecar in between.
    assert got["peer"] == f"peer={mesh.pair.client_ip}:{got['local_port']}"
    assert got["echoed"] and got["trailer"] == "<after-eof>"
    assert mesh.counter("excluded ports") - before == 1


def test_redirected_non_inference_port_passes_through_as_raw_tcp(mesh: Mesh) -> None:
    captured_before = mesh.counter("capture")
    got = mesh.in_client(
        "tcp-client", "--host", mesh.pair.server_ip, "--port", str(RAW_PORT),
        "--size", str(1 << 20),
    )  # fmt: skip
    # (4) redirected to the sidecar, which connected onward itself (another source port)
    # and moved every byte unchanged, half-close included.
    assert got["peer"].startswith(f"peer={mesh.pair.client_ip}:"), got
    assert got["peer"] != f"peer={mesh.pair.client_ip}:{got['local_port']}"
    assert got["echoed"], (got, mesh.sidecar.stderr())
    assert got["trailer"] == "<after-eof>"
    assert mesh.counter("capture") - captured_before == 1


@pytest.mark.skipif(missing_prerequisites() is not None, reason=str(missing_prerequisites()))
def test_cleanup_removes_every_rule_and_can_run_twice() -> None:
    with NetnsPair() as pair:
        base = [sys.executable, "-m", "meshd.cli", "iptables", "--proxy-uid", "1337", "--ipv6"]
        env_argv = pair.exec_argv(pair.client, [*base, "--apply"])
        run(env_argv)
        before = run(pair.exec_argv(pair.client, ["iptables-save", "-t", "nat"])).stdout
        assert "MESHD_OUTPUT" in before
        for _ in range(2):
            run(pair.exec_argv(pair.client, [*base, "--apply", "--cleanup"]))
        for tool in ("iptables", "ip6tables"):
            out = run(pair.exec_argv(pair.client, [tool, "-w", "-t", "nat", "-S"])).stdout
            assert "MESHD" not in out, out
