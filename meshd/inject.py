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
  runs as the dedicated UID, its admin listener on loopback and the kubelet's probes on a
  port of their own (/healthz, /readyz; /metrics opt-in), config mounted read-only.
- engine pods (`meshd.io/role: engine`) get `meshd-agent` (`meshd agent`) instead and no
  iptables: the agent serves the engine's state, it does not intercept the app's traffic.

Opt in: namespace label or pod annotation/label `meshd.io/inject: "true"`; opt out: the pod
annotation/label `"false"` always wins. Already injected (the `meshd.io/status` annotation or
one of our container names present) -> unchanged. hostNetwork pods are skipped: their iptables
would be the node's.

This file decides and builds the patch; the containers are meshd/inject_containers.py's, the
settings meshd/inject_config.py's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from meshd import __version__
from meshd.inject_config import (
    InjectionConfig,
    InjectionError,
    config_from_mapping,
    config_to_mapping,
    load_config_file,
)
from meshd.inject_containers import (
    AGENT_NAME,
    ANNOTATION_CONFIG,
    CONFIG_VOLUME,
    INIT_NAME,
    MTLS_VOLUME,
    OUR_CONTAINERS,
    PROXY_NAME,
    agent_container,
    config_volume,
    init_container,
    mtls_volume,
    proxy_container,
)

ANNOTATION_INJECT = "meshd.io/inject"
ANNOTATION_STATUS = "meshd.io/status"
ANNOTATION_ROLE = "meshd.io/role"
# Set on injected pods so monitors can select them (the value is the role).
LABEL_PROXY = "meshd.io/proxy"

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
        values = meta.get(part) or {}
        if not isinstance(values, Mapping):
            raise InjectionError(f"metadata.{part} must be a map, got {type(values).__name__}")
        value = values.get(key)
        if value is not None:
            return str(value)
    return None


def role_of(meta: Mapping[str, Any]) -> Role:
    return "engine" if (_flag(meta, ANNOTATION_ROLE) or "").lower() == "engine" else "client"


def is_injected(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
    if ANNOTATION_STATUS in (meta.get("annotations") or {}):
        return True
    names = _container_names(spec, "initContainers") | _container_names(spec, "containers")
    return bool(names & OUR_CONTAINERS)


def _container_names(spec: Mapping[str, Any], key: str) -> set[str]:
    """The names of spec[key]'s containers; InjectionError for a shape Kubernetes would
    not accept (found by the webhook fuzz target: a name that was a map raised TypeError)."""
    items = spec.get(key) or []
    if not isinstance(items, list):
        raise InjectionError(f"spec.{key} must be a list, got {type(items).__name__}")
    names: set[str] = set()
    for i, c in enumerate(items):
        if not isinstance(c, Mapping):
            raise InjectionError(f"spec.{key}[{i}] must be a map, got {type(c).__name__}")
        name = c.get("name")
        if name is None:
            continue
        if not isinstance(name, str):
            raise InjectionError(
                f"spec.{key}[{i}].name must be a string, got {type(name).__name__}"
            )
        names.add(name)
    return names


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
    if not isinstance(kind, str) or kind not in TEMPLATE_PATHS:
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
    volumes = [CONFIG_VOLUME, *([MTLS_VOLUME] if cfg.mtls_secret is not None else [])]
    return json.dumps(
        {"version": __version__, "role": role, "initContainers": init, "volumes": volumes},
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
        ours = [init_container(cfg, annotations), proxy_container(cfg, annotations)]
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
    volumes = [v for v in (config_volume(cfg), mtls_volume(cfg)) if v is not None]
    for volume in volumes:
        if any(v.get("name") == volume["name"] for v in spec.get("volumes") or []):
            raise InjectionError(f"the pod already has a volume named {volume['name']!r}")
    if spec.get("volumes"):
        for volume in volumes:
            path = _pointer((*spec_path, "volumes", "-"))
            patch.append({"op": "add", "path": path, "value": volume})
    else:
        patch.append({"op": "add", "path": _pointer((*spec_path, "volumes")), "value": volumes})

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
