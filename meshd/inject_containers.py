"""What an injected pod gets: the `meshd-init` (iptables), `meshd-proxy` and `meshd-agent`
containers and the config volume, built from an InjectionConfig and the pod's annotations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshd.inject_config import InjectionConfig, InjectionError
from meshd.iptables import Wildcard, parse_cidrs, parse_ports

ANNOTATION_INCLUDE_PORTS = "meshd.io/include-ports"
ANNOTATION_EXPOSE_METRICS = "meshd.io/expose-metrics"
ANNOTATION_EXCLUDE_PORTS = "meshd.io/exclude-ports"
ANNOTATION_EXCLUDE_CIDRS = "meshd.io/exclude-cidrs"
# Holds the sidecar config when it is delivered inline (downward API), see InjectionConfig.
ANNOTATION_CONFIG = "meshd.io/config"

INIT_NAME = "meshd-init"
PROXY_NAME = "meshd-proxy"
AGENT_NAME = "meshd-agent"
CONFIG_VOLUME = "meshd-config"
MTLS_VOLUME = "meshd-mtls"  # the Secret InjectionConfig.mtls_secret, when set
OUR_CONTAINERS = frozenset({INIT_NAME, PROXY_NAME, AGENT_NAME})


def _annotation_ports(
    annotations: Mapping[str, Any], key: str, default: tuple[int, ...] | Wildcard, wildcard: bool
) -> tuple[int, ...] | Wildcard:
    if key not in annotations:
        return default
    try:
        ports = parse_ports(str(annotations[key]), key, allow_wildcard=wildcard)
    except ValueError as exc:
        raise InjectionError(str(exc)) from None
    if wildcard and ports == ():
        raise InjectionError(f"{key} is empty: nothing would be redirected (use '*')")
    return ports


def iptables_args(cfg: InjectionConfig, annotations: Mapping[str, Any]) -> list[str]:
    """Arguments of `meshd iptables` for this pod (flags as in meshd/iptables.py)."""
    include = _annotation_ports(annotations, ANNOTATION_INCLUDE_PORTS, cfg.include_ports, True)
    exclude = _annotation_ports(annotations, ANNOTATION_EXCLUDE_PORTS, cfg.exclude_ports, False)
    cidrs: tuple[str, ...] = cfg.exclude_cidrs
    if ANNOTATION_EXCLUDE_CIDRS in annotations:
        try:
            parsed = parse_cidrs(
                str(annotations[ANNOTATION_EXCLUDE_CIDRS]),
                ANNOTATION_EXCLUDE_CIDRS,
                allow_wildcard=False,
            )
        except ValueError as exc:
            raise InjectionError(str(exc)) from None
        assert parsed != "*"
        cidrs = parsed
    args = [
        "iptables",
        "--apply",
        "--proxy-port",
        str(cfg.transparent_port),
        "--proxy-uid",
        str(cfg.proxy_uid),
        "--proxy-gid",
        str(cfg.proxy_gid),
        "--include-ports",
        include if include == "*" else ",".join(map(str, include)),
    ]
    if exclude:
        assert exclude != "*"
        args += ["--exclude-ports", ",".join(map(str, exclude))]
    if cidrs:
        args += ["--exclude-cidrs", ",".join(cidrs)]
    return args


def _probes(cfg: InjectionConfig) -> dict[str, Any]:
    def get(path: str, **timing: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": cfg.probe_port}, **timing}

    # The startup probe gates the next init container, so it polls fast.
    return {
        "startupProbe": get("/readyz", periodSeconds=1, failureThreshold=60),
        "readinessProbe": get("/readyz", periodSeconds=5, failureThreshold=3),
        "livenessProbe": get("/healthz", periodSeconds=10, failureThreshold=3),
    }


def _env(cfg: InjectionConfig) -> dict[str, Any]:
    return {"env": [{"name": k, "value": v} for k, v in cfg.env]} if cfg.env else {}


def _config_path(cfg: InjectionConfig) -> str:
    return f"{cfg.config_mount_path.rstrip('/')}/{cfg.config_key}"


def _mount(cfg: InjectionConfig) -> list[dict[str, Any]]:
    return [
        {"name": CONFIG_VOLUME, "mountPath": cfg.config_mount_path, "readOnly": True},
        *_mtls_mount(cfg),
    ]


def _mtls_mount(cfg: InjectionConfig) -> list[dict[str, Any]]:
    if cfg.mtls_secret is None:
        return []
    return [{"name": MTLS_VOLUME, "mountPath": cfg.mtls_mount_path, "readOnly": True}]


def mtls_files(cfg: InjectionConfig) -> dict[str, str]:
    """Where the mounted client certificate's files are in the pod (the Secret's keys
    ca.crt, tls.crt, tls.key), as the sidecar's control_plane.tls keys."""
    base = cfg.mtls_mount_path.rstrip("/")
    return {
        "ca_file": f"{base}/ca.crt",
        "cert_file": f"{base}/tls.crt",
        "key_file": f"{base}/tls.key",
    }


def _agent_tls_args(cfg: InjectionConfig) -> list[str]:
    if cfg.mtls_secret is None:
        return []
    files = mtls_files(cfg)
    return [
        "--tls-ca",
        files["ca_file"],
        "--tls-cert",
        files["cert_file"],
        "--tls-key",
        files["key_file"],
    ]


def _nonroot(cfg: InjectionConfig) -> dict[str, Any]:
    return {
        "runAsUser": cfg.proxy_uid,
        "runAsGroup": cfg.proxy_gid,
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def init_container(cfg: InjectionConfig, annotations: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": INIT_NAME,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": ["meshd"],
        "args": iptables_args(cfg, annotations),
        "resources": cfg.init_resources.to_k8s(),
        "securityContext": {
            # iptables needs root with NET_ADMIN (rules) and NET_RAW (raw sockets); explicit
            # runAsNonRoot: false overrides a pod-level runAsNonRoot for this container only.
            "runAsUser": 0,
            "runAsGroup": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            # iptables takes its lock under /run.
            "readOnlyRootFilesystem": False,
            "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
        },
    }


def expose_metrics(cfg: InjectionConfig, annotations: Mapping[str, Any]) -> bool:
    value = annotations.get(ANNOTATION_EXPOSE_METRICS)
    if value is None:
        return cfg.expose_metrics
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise InjectionError(
            f'{ANNOTATION_EXPOSE_METRICS} must be "true" or "false", got {value!r}'
        )
    return text == "true"


def proxy_container(cfg: InjectionConfig, annotations: Mapping[str, Any]) -> dict[str, Any]:
    ports = [{"name": "meshd-probes", "containerPort": cfg.probe_port, "protocol": "TCP"}]
    probe_args = ["--set", "listeners.probes.enabled=true", "--set",
                  f"listeners.probes.port={cfg.probe_port}"]  # fmt: skip
    if expose_metrics(cfg, annotations):
        probe_args += ["--set", "listeners.probes.metrics=true"]
    return {
        "name": PROXY_NAME,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "restartPolicy": "Always",
        "command": ["meshd"],
        "args": [
            "sidecar",
            "--config",
            _config_path(cfg),
            # The admin listener (/config, /endpoints) stays on loopback; the kubelet probes
            # the pod IP on the probe listener, which serves /healthz and /readyz only.
            "--admin",
            f"127.0.0.1:{cfg.admin_port}",
            *probe_args,
            "--listen",
            f"127.0.0.1:{cfg.outbound_port}",
            "--set",
            "listeners.transparent.enabled=true",
            "--set",
            f"listeners.transparent.port={cfg.transparent_port}",
        ],
        "ports": ports,
        **_env(cfg),
        "resources": cfg.proxy_resources.to_k8s(),
        "securityContext": _nonroot(cfg),
        "volumeMounts": _mount(cfg),
        **_probes(cfg),
    }


def agent_container(cfg: InjectionConfig) -> dict[str, Any]:
    """The engine agent: scrapes the engine on loopback, publishes its state to the control
    plane under the pod's name and IP (downward API). It serves no port, so it has no probes:
    a native sidecar that exits is restarted by the kubelet."""
    downward = [
        {"name": "MESHD_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "MESHD_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    return {
        "name": AGENT_NAME,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "restartPolicy": "Always",
        "command": ["meshd"],
        "args": [
            "agent",
            "--name",
            "$(MESHD_POD_NAME)",
            "--engine",
            f"http://127.0.0.1:{cfg.engine_port}",
            "--address",
            f"$(MESHD_POD_IP):{cfg.engine_port}",
            *(
                [a for shard in cfg.control_plane_shards for a in ("--shard", shard)]
                if cfg.control_plane_shards
                else ["--control-plane", cfg.control_plane]
            ),
            *_agent_tls_args(cfg),
        ],
        "env": downward + _env(cfg).get("env", []),
        "resources": cfg.agent_resources.to_k8s(),
        "securityContext": _nonroot(cfg),
        **({"volumeMounts": _mtls_mount(cfg)} if cfg.mtls_secret is not None else {}),
    }


def mtls_volume(cfg: InjectionConfig) -> dict[str, Any] | None:
    """The client certificate's Secret, from the pod's own namespace; not optional, so a
    namespace without it shows as the pod's FailedMount event naming the Secret."""
    if cfg.mtls_secret is None:
        return None
    return {"name": MTLS_VOLUME, "secret": {"secretName": cfg.mtls_secret}}


def config_volume(cfg: InjectionConfig) -> dict[str, Any]:
    if cfg.sidecar_config is not None:
        return {
            "name": CONFIG_VOLUME,
            "downwardAPI": {
                "items": [
                    {
                        "path": cfg.config_key,
                        "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_CONFIG}']"},
                    }
                ]
            },
        }
    return {
        "name": CONFIG_VOLUME,
        "configMap": {
            "name": cfg.config_map,
            "items": [{"key": cfg.config_key, "path": cfg.config_key}],
        },
    }
