"""mTLS as the chart installs it, run for real: helm/meshd rendered with mtls.enabled
(mode generate: the certificates are Helm's own, genCA/genSignedCert), the injected pods
made by `meshd inject` from the chart's inject.yaml and sidecar.yaml, and then
`meshd control-plane`, `meshd agent` and `meshd sidecar` run as processes with exactly the
arguments, files and config those manifests give them. What a cluster would change is
mapped, and only that: the Secrets' files are written to a temporary directory standing
for their mount points, listen ports are free local ones, and the control plane's Service
address is 127.0.0.1 (the kubelet's $(MESHD_POD_IP) too).

The control plane's certificate names its Service (<release>-control-plane.<ns>.svc and the
rest), which does not resolve here, and meshd has no TLS target-name override. So the
chart is rendered with `mtls.extraIPs: [127.0.0.1]` (a value for exactly this: a name or
address the certificate must carry besides the Service's) and the processes dial
127.0.0.1, which gRPC checks against that IP SAN. That the Service's own names verify
(and a wrong name does not) is checked in-process, with grpc's ssl_target_name_override,
against the same running control plane. A client without a certificate, or with one of
another CA, is refused."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web

try:
    import helm_python as helm

    helm.helm_sdk_version()
except Exception as exc:
    pytest.skip(f"helm-python-sdk cannot run here: {exc}", allow_module_level=True)

from meshd.inject import inject_documents
from meshd.inject_config import config_from_mapping, config_to_mapping, load_config_file
from xds.client import Backoff, Subscriber
from xds.resources import ENDPOINT_STATE_TYPE

CHART = Path(__file__).parent.parent / "helm" / "meshd"
RELEASE, NAMESPACE, APPS = "meshd", "meshd-system", "apps"
SERVICE_DNS = f"meshd-control-plane.{NAMESPACE}.svc"
CP_MOUNT = "/etc/meshd/mtls"  # the control plane's Secret (controlplane.yaml)
POD_MOUNT = "/var/run/secrets/meshd.io/mtls"  # the injected pods' (InjectionConfig)
ENGINE = "vllm-0"
# `meshd ARGS...`, the image's entry point, with this interpreter.
MAIN = "import sys; from meshd.cli import main; sys.exit(main(sys.argv[1:]))"
WAIT_S = 15.0
METRICS = """\
vllm:num_requests_running{model_name="tiny"} 2
vllm:num_requests_waiting{model_name="tiny"} 5
vllm:kv_cache_usage_perc{model_name="tiny"} 0.25
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        d
        for path, text in manifests.items()
        if not path.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if d
    ]


def find(docs: list[dict[str, Any]], kind: str, name: str, ns: str = NAMESPACE) -> Any:
    (doc,) = [
        d
        for d in docs
        if d["kind"] == kind and d["metadata"]["name"] == name and d["metadata"]["namespace"] == ns
    ]
    return doc


def write_secret(secret: dict[str, Any], where: Path) -> None:
    where.mkdir(parents=True)
    for key, value in secret["data"].items():
        (where / key).write_bytes(base64.b64decode(value))


def workload(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": APPS},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, **labels}},
                "spec": {"containers": [{"name": name, "image": "app"}]},
            },
        },
    }


def container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    spec = obj["spec"]["template"]["spec"]
    (c,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return c


class Mapper:
    """Rewrites what a cluster gives (mount points, Service names, pod IP, ports) to what
    stands for it here; everything else in an argument or config passes unchanged."""

    def __init__(self, subs: dict[str, str], ports: dict[int, int]) -> None:
        self.subs = subs
        self.ports = ports

    def __call__(self, text: str) -> str:
        for old, new in self.subs.items():
            text = text.replace(old, new)
        # host:PORT, or a bare port argument/value (--set listeners.probes.port=15021).
        return re.sub(
            r"(?<![0-9])(" + "|".join(map(str, self.ports)) + r")(?![0-9])",
            lambda m: str(self.ports[int(m.group(1))]),
            text,
        )


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.popen.terminate()
        for p in procs:
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()


def start(procs: list[Proc], tmp: Path, name: str, c: dict[str, Any], env: dict[str, str],
          mapped: Mapper) -> Proc:  # fmt: skip
    assert c["command"] == ["meshd"]
    argv = [mapped(a) for a in c["args"]]
    log = tmp / f"{name}.log"
    # Every variable the container sets; $(VAR) expanded from them, as the kubelet does.
    own = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    full = {**own, **env}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: full[m.group(1)], a) for a in argv]
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-c", MAIN, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **full},
        )
    proc = Proc(name, popen, log)
    procs.append(proc)
    return proc


@contextlib.asynccontextmanager
async def engine_app() -> AsyncIterator[int]:
    """A stand-in engine: vLLM's /health and a /metrics page the agent scrapes."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield port
    finally:
        await runner.cleanup()


async def readyz(session: aiohttp.ClientSession, port: int) -> dict[str, Any] | None:
    try:
        async with session.get(f"http://127.0.0.1:{port}/readyz") as r:
            body: dict[str, Any] = await r.json()
            return body
    except aiohttp.ClientError:
        return None


def grpc_credentials(files: Path, *, client_cert: bool = True) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(files / "ca.crt").read_bytes(),
        private_key=(files / "tls.key").read_bytes() if client_cert else None,
        certificate_chain=(files / "tls.crt").read_bytes() if client_cert else None,
    )


async def subscribe(target: str, creds: grpc.ChannelCredentials, name: str | None) -> bool:
    """Whether a Subscriber with these credentials, dialling `target` under the TLS name
    `name`, is sent the engine's state within a couple of seconds."""
    options = [("grpc.ssl_target_name_override", name)] if name else []
    sub = Subscriber(
        target,
        {ENDPOINT_STATE_TYPE: None},
        credentials=creds,
        backoff=Backoff(base_s=0.05, max_s=0.2),
        channel_options=options,
    )
    sub.start()
    try:
        await asyncio.wait_for(
            sub.wait_until(lambda: sub.get(ENDPOINT_STATE_TYPE, ENGINE) is not None), 2.0
        )
        return True
    except TimeoutError:
        return False
    finally:
        await sub.close()


UNAVAILABLE, CONNECTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED


async def probe(
    target: str, creds: grpc.ChannelCredentials | None, name: str | None
) -> grpc.StatusCode:
    """One RPC to a method the control plane does not serve: UNIMPLEMENTED means the
    connection (and its handshake) went through, UNAVAILABLE that it was refused."""
    options = [("grpc.ssl_target_name_override", name)] if name else []
    channel = (
        grpc.aio.secure_channel(target, creds, options=options)
        if creds is not None
        else grpc.aio.insecure_channel(target)
    )
    try:
        await channel.unary_unary("/meshd.test.Nothing/Here")(b"", timeout=5.0)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        await channel.close()
    return grpc.StatusCode.OK


async def test_rendered_mtls_install_connects_sidecar_and_agent_and_refuses_the_rest(
    tmp_path: Path,
) -> None:
    async with engine_app() as engine_port:
        await _run(tmp_path, engine_port)


async def _run(tmp: Path, engine_port: int) -> None:
    engine = f"http://127.0.0.1:{engine_port}"
    values = {
        "mtls": {"enabled": True, "namespaces": [APPS], "extraIPs": ["127.0.0.1"]},
        "sidecar": {
            "config": {
                "pools": [{"name": "default", "models": ["*"], "endpoints": [engine]}],
            }
        },
    }
    docs = render(values)

    # The Secrets' files where their volumes would be.
    write_secret(find(docs, "Secret", "meshd-control-plane-tls"), tmp / "cp-tls")
    write_secret(find(docs, "Secret", "meshd-mesh-client", APPS), tmp / "client-tls")
    cm = find(docs, "ConfigMap", "meshd-config")
    (tmp / "inject.yaml").write_text(cm["data"]["inject.yaml"])
    cfg = load_config_file(str(tmp / "inject.yaml"))
    cfg = config_from_mapping(
        {**config_to_mapping(cfg), "sidecar_config": cm["data"]["sidecar.yaml"]}
    )
    assert cfg.mtls_secret == "meshd-mesh-client" and cfg.mtls_mount_path == POD_MOUNT

    # The pods the webhook would make in namespace apps.
    (client, vllm), _ = inject_documents(
        [workload("app", {}), workload("vllm", {"meshd.io/role": "engine"})], cfg
    )
    for obj in (client, vllm):
        vols = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
        assert vols["meshd-mtls"]["secret"]["secretName"] == "meshd-mesh-client"
    proxy, agent = container(client, "meshd-proxy"), container(vllm, "meshd-agent")
    cp = find(docs, "Deployment", "meshd-control-plane")["spec"]["template"]["spec"]
    (cp_container,) = cp["containers"]

    cp_port = free_port()
    ports = {p: free_port() for p in (15000, 15001, 15006, 15011, 15014, 15021)}
    ports[15010] = cp_port
    ports[8000] = engine_port
    mapped = Mapper(
        {
            f"{CP_MOUNT}/": f"{tmp}/cp-tls/",
            f"{POD_MOUNT}/": f"{tmp}/client-tls/",
            "/etc/meshd/config.yaml": str(tmp / "sidecar.yaml"),  # the downward API file
            f"{SERVICE_DNS}:": "127.0.0.1:",
            "0.0.0.0:": "127.0.0.1:",
        },
        ports,
    )
    # The sidecar's config as the downward API writes it: the pod's annotation.
    pod_config = client["spec"]["template"]["metadata"]["annotations"]["meshd.io/config"]
    (tmp / "sidecar.yaml").write_text(mapped(pod_config))
    sidecar_cfg = yaml.safe_load((tmp / "sidecar.yaml").read_text())["control_plane"]
    assert sidecar_cfg["addresses"] == [f"127.0.0.1:{cp_port}"]
    assert sidecar_cfg["tls"]["cert_file"] == f"{tmp}/client-tls/tls.crt"

    pod_env = {"MESHD_POD_NAME": ENGINE, "MESHD_POD_IP": "127.0.0.1"}
    with processes() as procs:
        start(procs, tmp, "control-plane", cp_container, {}, mapped)
        start(procs, tmp, "agent", agent, pod_env, mapped)
        sidecar = start(procs, tmp, "sidecar", proxy, {}, mapped)
        admin = ports[15000]

        state: dict[str, Any] | None = None
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                for p in procs:
                    assert p.popen.poll() is None, f"{p.name} exited:\n{p.output()}"
                body = await readyz(session, admin)
                feed = (body or {}).get("control_plane") or {}
                if feed.get("connected") and feed.get("engines"):
                    state = body
                    break
                await asyncio.sleep(0.1)
            else:
                logs = "\n".join(f"--- {p.name}\n{p.output()}" for p in procs)
                pytest.fail(f"the sidecar got no engine over mTLS; /readyz: {body}\n{logs}")
            async with session.get(f"http://127.0.0.1:{admin}/endpoints") as r:
                endpoints = await r.json()
        assert state is not None
        # The sidecar follows over the advertised frames port, with the same mTLS.
        assert state["control_plane"]["transport"] == "frames", state
        # The engine's own figures, as its agent published them, reached the sidecar.
        (ep,) = endpoints["pools"]["default"]
        assert ep["url"] == engine
        reported = ep["reported"]
        assert (reported["requests_running"], reported["requests_waiting"]) == (2, 5)
        assert reported["kv_usage"] == 0.25 and reported["healthy"] and reported["fresh"]
        # The agent moved to the advertised frames port, over the same mTLS (its next
        # publish: a heartbeat, 2 s at most).
        agent_log = next(p for p in procs if p.name == "agent")
        deadline = time.monotonic() + WAIT_S
        while "publishing over frames" not in agent_log.output():
            assert time.monotonic() < deadline, agent_log.output()
            await asyncio.sleep(0.1)

        target = f"127.0.0.1:{cp_port}"
        files = tmp / "client-tls"
        # The certificate carries the Service's names: a client dialling them verifies it.
        assert await subscribe(target, grpc_credentials(files), SERVICE_DNS)
        assert await subscribe(target, grpc_credentials(files), f"meshd-control-plane.{NAMESPACE}")
        # ... and gRPC checks the name: one the certificate does not carry is refused.
        assert await probe(target, grpc_credentials(files), "evil.example.com") == UNAVAILABLE
        # No client certificate: the control plane refuses the handshake.
        refused = await probe(target, grpc_credentials(files, client_cert=False), SERVICE_DNS)
        assert refused == UNAVAILABLE
        # A certificate of another CA (the chart's webhook CA signed it): refused too.
        write_secret(find(docs, "Secret", "meshd-webhook-tls"), tmp / "rogue")
        (tmp / "rogue" / "ca.crt").write_bytes((files / "ca.crt").read_bytes())
        assert await probe(target, grpc_credentials(tmp / "rogue"), SERVICE_DNS) == UNAVAILABLE
        # No TLS at all.
        assert await probe(target, None, None) == UNAVAILABLE
        # The probe tells a refusal from a connection: with the right files it gets through.
        assert await probe(target, grpc_credentials(files), SERVICE_DNS) == CONNECTED
        assert sidecar.popen.poll() is None
