"""Sidecar injection as pure functions: a Pod (or a workload's pod template) in, the mutated
object and the RFC 6902 JSON Patch that makes it out. The admission webhook (meshd/webhook.py)
and the offline `meshd inject` command (below) are two drivers of the same functions.

What a client pod gets, the shape learned from Istio's injection template
(istio/istio manifests/charts/istio-control/istio-discovery/files/injection-template.yaml) and
Kubernetes native sidecars (KEP-753, `restartPolicy: Always` on an init container, GA in 1.33):

- `meshd-init`, first init container: `meshd iptables --apply ...` with NET_ADMIN/NET_RAW,
  redirecting outbound TCP to the inference ports to the transparent listener, the sidecar's
  own UID excluded (see meshd/iptables.py).
- `meshd-proxy`, second init container, a native sidecar: starts before the app's own init
  containers (its startup probe gates them, so they can already reach engines through it),
  runs as the dedicated UID, probes on the admin port, config mounted read-only.
- engine pods (`meshd.io/role: engine`) get `meshd-agent` (`meshd agent`) instead and no
  iptables: the agent serves the engine's state, it does not intercept the app's traffic.

Opt in: namespace label or pod annotation/label `meshd.io/inject: "true"`; opt out: the pod
annotation/label `"false"` always wins. Already injected (the `meshd.io/status` annotation or
one of our container names present) -> unchanged. hostNetwork pods are skipped: their iptables
would be the node's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import yaml

from meshd import __version__
from meshd.iptables import Wildcard, parse_cidrs, parse_ports

ANNOTATION_INJECT = "meshd.io/inject"
ANNOTATION_STATUS = "meshd.io/status"
ANNOTATION_ROLE = "meshd.io/role"
ANNOTATION_INCLUDE_PORTS = "meshd.io/include-ports"
ANNOTATION_EXCLUDE_PORTS = "meshd.io/exclude-ports"
ANNOTATION_EXCLUDE_CIDRS = "meshd.io/exclude-cidrs"
# Holds the sidecar config when it is delivered inline (downward API), see InjectionConfig.
ANNOTATION_CONFIG = "meshd.io/config"
# Set on injected pods so monitors can select them (the value is the role).
LABEL_PROXY = "meshd.io/proxy"

INIT_NAME = "meshd-init"
PROXY_NAME = "meshd-proxy"
AGENT_NAME = "meshd-agent"
CONFIG_VOLUME = "meshd-config"
OUR_CONTAINERS = frozenset({INIT_NAME, PROXY_NAME, AGENT_NAME})

Role = Literal["client", "engine"]

# Where each workload kind keeps its pod template (RFC 6901 pointer tokens, from the root).
TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
}


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
    """

    image: str = f"ghcr.io/meshd/meshd:{__version__}"
    image_pull_policy: str = "IfNotPresent"
    proxy_uid: int = 1337
    proxy_gid: int = 1337
    admin_port: int = 15000
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
    engine_port: int = 8000
    # Extra environment of the injected containers (e.g. OTEL_EXPORTER_OTLP_ENDPOINT).
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("proxy_uid", "proxy_gid"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                # UID 0 would make the owner exclusion exclude root, i.e. most apps.
                raise InjectionError(f"{name} must be a positive integer, got {value!r}")
        ports = [self.admin_port, self.outbound_port, self.transparent_port]
        for port in ports:
            if not isinstance(port, int) or not 0 < port < 65536:
                raise InjectionError(f"ports must be integers in 1..65535, got {port!r}")
        if len(set(ports)) != 3:
            raise InjectionError(
                f"admin_port, outbound_port and transparent_port must differ, got {ports}"
            )
        if not self.image:
            raise InjectionError("image must not be empty")
        listed = [] if self.include_ports == "*" else list(self.include_ports)
        for port in [*listed, *self.exclude_ports]:
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise InjectionError(f"include/exclude ports must be 1..65535, got {port!r}")
        if self.include_ports != "*" and not self.include_ports:
            raise InjectionError("include_ports is empty: nothing would be redirected (use '*')")


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
    for key in ("exclude_ports", "exclude_cidrs"):
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


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether to inject a pod, as what, and why (the reason is shown to the user)."""

    inject: bool
    role: Role
    reason: str


@dataclass(frozen=True, slots=True)
class InjectionResult:
    """The mutated object, the patch from the original to it, and what happened."""

    obj: dict[str, Any]
    patch: list[dict[str, Any]]
    injected: bool
    reason: str


def _flag(meta: Mapping[str, Any], key: str) -> str | None:
    # The annotation wins over the label when both are set.
    for part in ("annotations", "labels"):
        value = (meta.get(part) or {}).get(key)
        if value is not None:
            return str(value)
    return None


def role_of(meta: Mapping[str, Any]) -> Role:
    return "engine" if (_flag(meta, ANNOTATION_ROLE) or "").lower() == "engine" else "client"


def is_injected(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
    if ANNOTATION_STATUS in (meta.get("annotations") or {}):
        return True
    names = {c.get("name") for c in (spec.get("initContainers") or [])}
    names |= {c.get("name") for c in (spec.get("containers") or [])}
    return bool(names & OUR_CONTAINERS)


def decide(
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    *,
    namespace_opt_in: bool = False,
    force: bool = False,
) -> Decision:
    """Inject or not, in this order: already injected, opt-out, hostNetwork, opt-in.

    namespace_opt_in: the pod's namespace carries `meshd.io/inject: "true"`. force: inject
    unless opted out (what `meshd inject` does: asking for it is the opt-in).
    """
    role = role_of(meta)
    if is_injected(meta, spec):
        return Decision(False, role, "already injected")
    flag = _flag(meta, ANNOTATION_INJECT)
    if flag is not None and flag.lower() not in ("true", "false"):
        return Decision(False, role, f'{ANNOTATION_INJECT}={flag!r}: expected "true" or "false"')
    if flag is not None and flag.lower() == "false":
        return Decision(False, role, f'opted out ({ANNOTATION_INJECT}: "false")')
    if spec.get("hostNetwork"):
        return Decision(
            False, role, "hostNetwork pod: its iptables rules would be the node's, not the pod's"
        )
    if flag is not None and flag.lower() == "true":
        return Decision(True, role, f'opted in ({ANNOTATION_INJECT}: "true")')
    if namespace_opt_in:
        return Decision(True, role, "opted in by namespace label")
    if force:
        return Decision(True, role, "injection requested")
    return Decision(False, role, f"not opted in (no {ANNOTATION_INJECT} label or annotation)")


# ---------------------------------------------------------------- container templates


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
        return {"httpGet": {"path": path, "port": cfg.admin_port}, **timing}

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
    return [{"name": CONFIG_VOLUME, "mountPath": cfg.config_mount_path, "readOnly": True}]


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


def proxy_container(cfg: InjectionConfig) -> dict[str, Any]:
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
            # The kubelet probes the pod IP, so the admin listener cannot stay on loopback.
            "--admin",
            f"0.0.0.0:{cfg.admin_port}",
            "--listen",
            f"127.0.0.1:{cfg.outbound_port}",
            "--set",
            "listeners.transparent.enabled=true",
            "--set",
            f"listeners.transparent.port={cfg.transparent_port}",
        ],
        "ports": [{"name": "meshd-admin", "containerPort": cfg.admin_port, "protocol": "TCP"}],
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
            "--control-plane",
            cfg.control_plane,
        ],
        "env": downward + _env(cfg).get("env", []),
        "resources": cfg.agent_resources.to_k8s(),
        "securityContext": _nonroot(cfg),
    }


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


# ---------------------------------------------------------------- patch building


def _escape(token: str) -> str:
    """RFC 6901 section 3: '~' is written '~0' and '/' is written '~1'."""
    return token.replace("~", "~0").replace("/", "~1")


def _pointer(tokens: Iterable[str]) -> str:
    return "".join("/" + _escape(t) for t in tokens)


def _apply_adds(obj: dict[str, Any], patch: Sequence[Mapping[str, Any]]) -> None:
    # Our patches only ever `add`; applying them here keeps obj and patch one truth.
    for op in patch:
        assert op["op"] == "add"
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        target: Any = obj
        for token in tokens[:-1]:
            target = target[int(token)] if isinstance(target, list) else target[token]
        last = tokens[-1]
        value = copy.deepcopy(op["value"])
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), value)
        else:
            target[last] = value


def _template_of(obj: Mapping[str, Any]) -> tuple[str, ...]:
    kind = obj.get("kind")
    if kind not in TEMPLATE_PATHS:
        raise InjectionError(
            f"cannot inject kind {kind!r}: expected one of {', '.join(TEMPLATE_PATHS)}"
        )
    return TEMPLATE_PATHS[str(kind)]


def _at(obj: Mapping[str, Any], tokens: Sequence[str]) -> Mapping[str, Any]:
    node: Any = obj
    for token in tokens:
        if not isinstance(node, Mapping) or not isinstance(node.get(token), Mapping):
            raise InjectionError(f"{obj.get('kind')} has no {_pointer(tokens)}")
        node = node[token]
    return node


def _status(role: Role, cfg: InjectionConfig) -> str:
    init = [INIT_NAME, PROXY_NAME] if role == "client" else [AGENT_NAME]
    return json.dumps(
        {"version": __version__, "role": role, "initContainers": init, "volumes": [CONFIG_VOLUME]},
        separators=(",", ":"),
    )


def inject(
    obj: Mapping[str, Any],
    cfg: InjectionConfig,
    *,
    namespace_opt_in: bool = False,
    force: bool = False,
) -> InjectionResult:
    """Inject one Pod or workload. Never mutates `obj`; the patch applies to `obj` itself.

    Raises InjectionError for objects that are not pods/workloads or carry bad annotations.
    """
    base = _template_of(obj)
    template = _at(obj, base) if base else obj
    meta: Mapping[str, Any] = template.get("metadata") or {}
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        raise InjectionError(f"{obj.get('kind')} has no pod spec at {_pointer((*base, 'spec'))}")
    decision = decide(meta, spec, namespace_opt_in=namespace_opt_in, force=force)
    if not decision.inject:
        return InjectionResult(copy.deepcopy(dict(obj)), [], False, decision.reason)

    annotations: Mapping[str, Any] = meta.get("annotations") or {}
    if decision.role == "client":
        ours = [init_container(cfg, annotations), proxy_container(cfg)]
    else:
        ours = [agent_container(cfg)]
    new_annotations = {ANNOTATION_STATUS: _status(decision.role, cfg)}
    if cfg.sidecar_config is not None:
        new_annotations[ANNOTATION_CONFIG] = cfg.sidecar_config

    patch: list[dict[str, Any]] = []
    if "metadata" not in template:
        patch.append({"op": "add", "path": _pointer((*base, "metadata")), "value": {}})
    if not meta.get("annotations"):
        path = _pointer((*base, "metadata", "annotations"))
        patch.append({"op": "add", "path": path, "value": new_annotations})
    else:
        for key, value in new_annotations.items():
            path = _pointer((*base, "metadata", "annotations", key))
            patch.append({"op": "add", "path": path, "value": value})
    if not meta.get("labels"):
        path = _pointer((*base, "metadata", "labels"))
        patch.append({"op": "add", "path": path, "value": {LABEL_PROXY: decision.role}})
    else:
        path = _pointer((*base, "metadata", "labels", LABEL_PROXY))
        patch.append({"op": "add", "path": path, "value": decision.role})
    spec_path = (*base, "spec")
    if spec.get("initContainers"):
        # Ours go first: iptables before anything, then the proxy so the app's own init
        # containers already run behind it.
        for i, container in enumerate(ours):
            path = _pointer((*spec_path, "initContainers", str(i)))
            patch.append({"op": "add", "path": path, "value": container})
    else:
        path = _pointer((*spec_path, "initContainers"))
        patch.append({"op": "add", "path": path, "value": ours})
    volume = config_volume(cfg)
    if any(v.get("name") == CONFIG_VOLUME for v in spec.get("volumes") or []):
        raise InjectionError(f"the pod already has a volume named {CONFIG_VOLUME!r}")
    if spec.get("volumes"):
        patch.append({"op": "add", "path": _pointer((*spec_path, "volumes", "-")), "value": volume})
    else:
        patch.append({"op": "add", "path": _pointer((*spec_path, "volumes")), "value": [volume]})

    mutated = copy.deepcopy(dict(obj))
    _apply_adds(mutated, patch)
    return InjectionResult(mutated, patch, True, decision.reason)


def inject_documents(
    docs: Iterable[Any], cfg: InjectionConfig
) -> tuple[list[Any], list[tuple[str, str]]]:
    """Offline injection of parsed YAML documents; others (Services, ...) pass through.

    Returns the documents and, per workload, (kind/name, reason) for the report on stderr.
    """
    out: list[Any] = []
    notes: list[tuple[str, str]] = []
    for doc in docs:
        if (
            isinstance(doc, dict)
            and doc.get("kind") == "List"
            and isinstance(doc.get("items"), list)
        ):
            items, sub = inject_documents(doc["items"], cfg)
            out.append({**doc, "items": items})
            notes += sub
        elif isinstance(doc, dict) and doc.get("kind") in TEMPLATE_PATHS:
            result = inject(doc, cfg, force=True)
            out.append(result.obj)
            name = (doc.get("metadata") or {}).get("name", "?")
            notes.append((f"{doc['kind']}/{name}", result.reason))
        else:
            out.append(doc)
    return out, notes


# ---------------------------------------------------------------- command line


def load_config_file(path: str | None) -> InjectionConfig:
    if path is None:
        return InjectionConfig()
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise InjectionError(f"{path}: expected a mapping of injection settings")
    return config_from_mapping(data)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "inject",
        help="add the meshd sidecar to Kubernetes manifests offline (like istioctl kube-inject)",
        description="Read Pods, Deployments, StatefulSets, DaemonSets, Jobs or CronJobs "
        "(multi-document YAML) and print them with meshd injected, as the admission webhook "
        'would. Pods that opt out (meshd.io/inject: "false"), use hostNetwork or are '
        "already injected are printed unchanged; the reason goes to stderr.",
    )
    p.add_argument("-f", "--filename", required=True, help="manifest file, or - for stdin")
    p.add_argument("--config", help="injection settings (inject.yaml, InjectionConfig keys)")
    p.add_argument("--image", help="meshd image to inject (overrides the config)")
    p.add_argument(
        "--sidecar-config",
        metavar="FILE",
        help="meshd sidecar config to deliver inline (annotation + downward API) "
        "instead of the ConfigMap",
    )
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config_file(args.config)
        overrides: dict[str, Any] = {}
        if args.image:
            overrides["image"] = args.image
        if args.sidecar_config:
            with open(args.sidecar_config, encoding="utf-8") as fh:
                overrides["sidecar_config"] = fh.read()
        if overrides:
            cfg = config_from_mapping({**config_to_mapping(cfg), **overrides})
        if args.filename == "-":
            text = sys.stdin.read()
        else:
            with open(args.filename, encoding="utf-8") as fh:
                text = fh.read()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        out, notes = inject_documents(docs, cfg)
    except (OSError, yaml.YAMLError, InjectionError) as exc:
        print(f"meshd inject: {exc}", file=sys.stderr)
        return 1
    for what, reason in notes:
        print(f"{what}: {reason}", file=sys.stderr)
    rendered = yaml.safe_dump_all(out, sort_keys=False, default_flow_style=False)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(rendered)
    else:
        sys.stdout.write(rendered)
    return 0
