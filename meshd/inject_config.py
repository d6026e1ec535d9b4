"""How pods are injected: `InjectionConfig`, loaded from inject.yaml (the Helm chart's
`injection` values, `meshd inject --config`) with every key checked, and its inverse mapping.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import yaml

from meshd import __version__
from meshd.iptables import Wildcard

# A Secret's name: lowercase RFC 1123 subdomain, at most 253 characters.
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")


class InjectionError(ValueError):
    """The object cannot be injected as asked (bad annotation value, not a workload)."""


@dataclass(frozen=True, slots=True)
class Resources:
    """Kubernetes resource requests/limits of one injected container."""

    cpu_request: str = "100m"
    memory_request: str = "128Mi"
    cpu_limit: str | None = None
    memory_limit: str | None = "512Mi"

    def to_k8s(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {
            "requests": {"cpu": self.cpu_request, "memory": self.memory_request}
        }
        limits = {k: v for k, v in (("cpu", self.cpu_limit), ("memory", self.memory_limit)) if v}
        if limits:
            out["limits"] = limits
        return out


@dataclass(frozen=True, slots=True)
class InjectionConfig:
    """How pods are injected. Loaded from inject.yaml (same snake_case keys) or defaults.

    include_ports: the inference ports whose outbound traffic is redirected ("*" for all
    TCP); the defaults are vLLM's (8000) and SGLang's (30000). Pods override them with the
    include/exclude-ports annotations. The sidecar config reaches the pod one of two ways:
    `sidecar_config` (YAML text) inline, projected from an annotation by the downward API, so
    no per-namespace ConfigMap is needed (what the webhook does); or else the ConfigMap named
    `config_map`, which must exist in the pod's namespace.

    mtls_secret: the control plane requires client certificates (the chart's mtls.enabled):
    every injected pod mounts this Secret of its own namespace (keys tls.crt, tls.key and
    ca.crt: a client certificate of the mesh CA, the CA) read-only at `mtls_mount_path`, in
    the proxy and the agent; the agent gets --tls-ca/--tls-cert/--tls-key on those files, the
    sidecar reads them from its config (control_plane.tls, filled in by the chart). The
    Secret is a required volume: a pod whose namespace lacks it does not start (the
    kubelet's FailedMount event names the Secret) rather than run a sidecar that cannot
    reach the control plane.
    """

    image: str = f"ghcr.io/meshd/meshd:{__version__}"
    image_pull_policy: str = "IfNotPresent"
    proxy_uid: int = 1337
    proxy_gid: int = 1337
    admin_port: int = 15000  # the admin listener, on the pod's loopback
    # The kubelet's probes (/healthz, /readyz) on the pod IP; /metrics there too when
    # expose_metrics (or the pod's meshd.io/expose-metrics: "true"): a Prometheus that
    # scrapes pod IPs. /config and /endpoints stay on loopback.
    probe_port: int = 15021
    expose_metrics: bool = False
    outbound_port: int = 15001
    transparent_port: int = 15006
    include_ports: tuple[int, ...] | Wildcard = (8000, 30000)
    exclude_ports: tuple[int, ...] = ()
    exclude_cidrs: tuple[str, ...] = ("169.254.169.254/32",)
    proxy_resources: Resources = field(default_factory=Resources)
    init_resources: Resources = field(
        default_factory=lambda: Resources("10m", "32Mi", None, "64Mi")
    )
    agent_resources: Resources = field(default_factory=Resources)
    config_map: str = "meshd-sidecar"
    config_key: str = "config.yaml"
    config_mount_path: str = "/etc/meshd"
    sidecar_config: str | None = None
    # Where engine agents publish (meshd agent --control-plane) and the engine's own port
    # in its pod (the agent scrapes it on loopback and advertises it on the pod IP).
    control_plane: str = "meshd-control-plane.meshd-system.svc:18000"
    # Control-plane shards instead (each "host:port[,replica...]"): every engine publishes
    # to one, by a stable hash of its name (meshd agent --shard; meshd/shards.py).
    control_plane_shards: tuple[str, ...] = ()
    engine_port: int = 8000
    # Extra environment of the injected containers (e.g. OTEL_EXPORTER_OTLP_ENDPOINT).
    env: tuple[tuple[str, str], ...] = ()
    mtls_secret: str | None = None
    mtls_mount_path: str = "/var/run/secrets/meshd.io/mtls"

    def __post_init__(self) -> None:
        for name in ("proxy_uid", "proxy_gid"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                # UID 0 would make the owner exclusion exclude root, i.e. most apps.
                raise InjectionError(f"{name} must be a positive integer, got {value!r}")
        ports = [self.admin_port, self.outbound_port, self.transparent_port, self.probe_port]
        for port in ports:
            if not isinstance(port, int) or not 0 < port < 65536:
                raise InjectionError(f"ports must be integers in 1..65535, got {port!r}")
        if len(set(ports)) != len(ports):
            raise InjectionError(
                "admin_port, outbound_port, transparent_port and probe_port must differ, "
                f"got {ports}"
            )
        if not isinstance(self.expose_metrics, bool):
            raise InjectionError(
                f"expose_metrics must be true or false, got {self.expose_metrics!r}"
            )
        if not self.image:
            raise InjectionError("image must not be empty")
        listed = [] if self.include_ports == "*" else list(self.include_ports)
        for port in [*listed, *self.exclude_ports]:
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise InjectionError(f"include/exclude ports must be 1..65535, got {port!r}")
        if self.include_ports != "*" and not self.include_ports:
            raise InjectionError("include_ports is empty: nothing would be redirected (use '*')")
        if self.mtls_secret is not None and not _DNS_SUBDOMAIN.fullmatch(str(self.mtls_secret)):
            raise InjectionError(
                f"mtls_secret must name a Secret (a DNS subdomain), got {self.mtls_secret!r}"
            )
        if not str(self.mtls_mount_path).startswith("/"):
            raise InjectionError(f"mtls_mount_path must be absolute, got {self.mtls_mount_path!r}")
        a, b = (p.rstrip("/") + "/" for p in (self.mtls_mount_path, self.config_mount_path))
        if a.startswith(b) or b.startswith(a):
            # A mount inside a read-only one needs a mount point the runtime cannot make.
            raise InjectionError(
                f"mtls_mount_path {self.mtls_mount_path!r} and config_mount_path "
                f"{self.config_mount_path!r} must not contain one another"
            )


def config_from_mapping(data: Mapping[str, Any]) -> InjectionConfig:
    """Build an InjectionConfig from a parsed inject.yaml; unknown keys are an error."""
    known = {f.name for f in fields(InjectionConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InjectionError(f"unknown injection config key(s): {', '.join(unknown)}")
    kwargs: dict[str, Any] = dict(data)
    if "include_ports" in kwargs:
        inc = kwargs["include_ports"]
        kwargs["include_ports"] = "*" if inc == "*" else tuple(inc)
    for key in ("exclude_ports", "exclude_cidrs", "control_plane_shards"):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key] or ())
    if "env" in kwargs:
        env = kwargs["env"] or {}
        if not isinstance(env, Mapping):
            raise InjectionError("env must be a mapping of variable name to value")
        kwargs["env"] = tuple((str(k), str(v)) for k, v in sorted(env.items()))
    for key in ("proxy_resources", "init_resources", "agent_resources"):
        if key in kwargs:
            try:
                kwargs[key] = Resources(**kwargs[key])
            except TypeError as exc:
                raise InjectionError(f"{key}: {exc}") from None
    try:
        return InjectionConfig(**kwargs)
    except TypeError as exc:
        raise InjectionError(str(exc)) from None


def config_to_mapping(cfg: InjectionConfig) -> dict[str, Any]:
    """The inverse of config_from_mapping (tuples as lists), for inject.yaml files."""
    out = asdict(cfg)
    for key, value in out.items():
        if isinstance(value, tuple):
            out[key] = list(value)
    out["env"] = dict(cfg.env)
    return out


def load_config_file(path: str | None) -> InjectionConfig:
    if path is None:
        return InjectionConfig()
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise InjectionError(f"{path}: expected a mapping of injection settings")
    return config_from_mapping(data)
