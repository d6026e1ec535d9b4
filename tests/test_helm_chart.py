"""helm/meshd rendered by Helm's own engine (helm-python-sdk, Helm v4 SDK through ctypes),
linted, and every manifest validated against the Kubernetes schemas (kubernetes-validate,
strict) for every version from 1.29 to the newest it ships. The generated webhook certificate
is then served by a real `meshd webhook` and trusted through the rendered caBundle."""

from __future__ import annotations

import base64
import copy
import json
import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

try:
    import helm_python as helm

    helm.helm_sdk_version()  # loads the bundled native library
except Exception as exc:
    pytest.skip(f"helm-python-sdk cannot run here: {exc}", allow_module_level=True)

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
x509 = pytest.importorskip("cryptography.x509", reason="cryptography is not installed")

from kubernetes_validate.utils import all_versions, major_minor  # noqa: E402

from meshd.config import load_config  # noqa: E402
from meshd.inject_config import load_config_file  # noqa: E402
from meshd.webhook import WebhookServer  # noqa: E402

CHART = Path(__file__).parent.parent / "helm" / "meshd"
REVIEW = Path(__file__).parent / "k8s" / "admission_review_pod.json"
ENGINE_REVIEW = Path(__file__).parent / "k8s" / "admission_review_engine_pod.json"
NAMESPACE = "meshd-system"
# Custom resources (cert-manager, Prometheus Operator): no schema in kubernetes-validate.
CRD_KINDS = {
    "Certificate",
    "Issuer",
    "ClusterIssuer",
    "ServiceMonitor",
    "PodMonitor",
    "ScaledObject",
}
# KEDA's ScaledObject schema (its CRD's openAPIV3Schema, vendored: source and license there).
KEDA_SCHEMA = Path(__file__).parent / "data" / "keda" / "scaledobject-v1alpha1.schema.yaml"
AUTOSCALED_ENGINES = [
    {"pool": "default", "deployment": "vllm-llama", "namespace": "models", "maxReplicas": 8},
    {"pool": "small.v2", "deployment": "vllm-small", "minReplicas": 0, "maxReplicas": 4},
]

# Namespaces whose injected pods get the mesh client certificate (mtls.namespaces).
MESH_NAMESPACES = ["apps", "models"]
OTLP = "http://otel-collector.observability.svc:4317"

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "sharded": {"controlPlane": {"shards": 3}},
    "ha": {
        "controlPlane": {"replicas": 3},
        "webhook": {"replicas": 2, "failurePolicy": "Fail"},
        "picker": {"enabled": True, "replicas": 2, "endpoints": ["10.0.0.5:8000=H100"]},
    },
    "picker": {"picker": {"enabled": True, "endpoints": ["10.0.0.5:8000", "10.0.0.6:8000=A100"]}},
    "mtls": {
        "mtls": {"enabled": True, "namespaces": MESH_NAMESPACES},
        "picker": {"enabled": True, "endpoints": ["10.0.0.5:8000"]},
    },
    "mtls-sharded": {
        "mtls": {"enabled": True, "namespaces": ["apps"], "extraDNSNames": ["cp.example.com"]},
        "controlPlane": {"shards": 2},
    },
    "cert-manager": {
        "webhook": {"tls": {"mode": "certManager"}},
        "mtls": {"enabled": True, "mode": "certManager", "namespaces": MESH_NAMESPACES},
        "telemetry": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "otlp": {"endpoint": OTLP},
        },
        "injection": {"includePorts": ["*"], "excludePorts": [22]},
    },
    "no-discovery": {"controlPlane": {"discoverEndpoints": False}},
    # Every flag of the picker and the control plane that the chart sets.
    "all-flags": {
        "controlPlane": {"resourceTTLSeconds": 0, "eds": False},
        "picker": {
            "enabled": True,
            "endpoints": ["10.0.0.5:8000=H100", "10.0.0.6:8000=H100", "10.0.0.7:8000=A100"],
            "fallbacks": 2,
            "trustRoutingHeaders": True,
            "maxInFlight": 64,
            "traceSampleRatio": 0.25,
        },
        "telemetry": {"otlp": {"endpoint": OTLP, "sampleRatio": 0.5}},
        "sidecar": {"controlPlane": {"connect": False}},
    },
    "autoscaling": {"autoscaling": {"enabled": True, "engines": AUTOSCALED_ENGINES}},
    "autoscaling-prometheus": {
        "autoscaling": {
            "enabled": True,
            "scaler": "prometheus",
            "prometheusAddress": "http://prometheus-operated.monitoring.svc:9090",
            "engines": AUTOSCALED_ENGINES[:1],
        },
        "telemetry": {"serviceMonitor": {"enabled": True}},
    },
    "user-secret": {
        "webhook": {"tls": {"mode": "secret", "secretName": "my-tls", "caBundle": "Q0E="}}
    },
}


_VALID: set[tuple[str, str]] = set()  # (version, manifest JSON) already validated


def k8s_versions() -> list[str]:
    ours = sorted(
        {major_minor(v) for v in all_versions() if int(major_minor(v).split(".")[1]) >= 29},
        key=lambda v: int(v.split(".")[1]),
    )
    return ours


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests: dict[str, str] = chart.render(
        values, name="meshd", namespace=NAMESPACE, is_install=True
    )
    docs: list[dict[str, Any]] = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


@pytest.fixture(scope="module")
def rendered(chart: Any) -> dict[str, list[dict[str, Any]]]:
    return {name: render(chart, values) for name, values in VALUE_SETS.items()}


# ---------------------------------------------------------------- engine checks


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_manifest_validates_against_kubernetes(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    docs = rendered[name]
    assert docs
    checked = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        key = json.dumps(doc, sort_keys=True)
        for version in k8s_versions():
            if (version, key) in _VALID:  # the same manifest from another value set
                continue
            try:
                kv.validate(doc, version, strict=True)
                _VALID.add((version, key))
            except kv.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                pytest.fail(
                    f"{doc['kind']}/{doc['metadata']['name']} on {version}: {path}: {exc.message}"
                )
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize(
    "name",
    [
        "defaults",
        "ha",
        "mtls",
        "mtls-sharded",
        "cert-manager",
        "all-flags",
        "autoscaling-prometheus",
    ],
)
def test_helm_lint_is_clean(name: str) -> None:
    report = helm.lint(str(CHART), VALUE_SETS[name], namespace=NAMESPACE, kube_version="v1.29.0")
    assert report["errors"] == []
    # Severity 2 is a warning, 3 an error; "icon is recommended" (1, info) is fine.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"webhook": {"failurePolicy": "Sometimes"}}, "/webhook/failurePolicy"),
        ({"injection": {"proxyUID": 0}}, "/injection/proxyUID"),
        ({"controlPlane": {"replicas": 0}}, "/controlPlane/replicas"),
        ({"webhok": {"replicas": 2}}, "webhok"),
        ({"injection": {"includePorts": [70000]}}, "/injection/includePorts"),
        ({"webhook": {"tls": {"mode": "secret"}}}, "/webhook/tls/secretName"),
        ({"telemetry": {"otlp": {"endpoint": "otel:4317"}}}, "/telemetry/otlp/endpoint"),
        ({"sidecar": {"config": {"pools": []}}}, "/sidecar/config/pools"),
        ({"picker": {"enabled": True}}, "endpoints"),
        ({"picker": {"enabled": True, "endpoints": ["no-port"]}}, "/picker/endpoints/0"),
        ({"picker": {"fallbacks": -1}}, "/picker/fallbacks"),
        ({"picker": {"maxInFlight": 0}}, "/picker/maxInFlight"),
        ({"picker": {"traceSampleRatio": 1.5}}, "/picker/traceSampleRatio"),
        ({"controlPlane": {"resourceTTLSeconds": -1}}, "/controlPlane/resourceTTLSeconds"),
        ({"controlPlane": {"eds": "no"}}, "/controlPlane/eds"),
        ({"sidecar": {"controlPlane": {"conect": True}}}, "conect"),
        ({"autoscaling": {"scaler": "hpa"}}, "/autoscaling/scaler"),
        ({"autoscaling": {"enabled": True, "scaler": "prometheus"}}, "prometheusAddress"),
        ({"autoscaling": {"engines": [{"pool": "p"}]}}, "deployment"),
        (
            {"autoscaling": {"engines": [{"pool": "p", "deployment": "d", "maxReplicas": 0}]}},
            "/autoscaling/engines/0/maxReplicas",
        ),
        (
            {"sidecar": {"config": {"control_plane": {"addresses": ["http://cp:15010"]}}}},
            "/sidecar/config/control_plane/addresses/0",
        ),
        ({"mtls": {"namespaces": ["Apps"]}}, "/mtls/namespaces/0"),
        ({"mtls": {"namespaces": ["a", "a"]}}, "/mtls/namespaces"),
        ({"mtls": {"clientSecretName": "Bad_Name"}}, "/mtls/clientSecretName"),
        ({"mtls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}, "kind"),
        ({"mtls": {"certManager": {"issureRef": {}}}}, "issureRef"),
    ],
)
def test_bad_values_are_rejected_by_the_schema(
    chart: Any, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name="meshd", namespace=NAMESPACE)
    assert where in str(info.value)


# ---------------------------------------------------------------- what the chart says


def test_ha_runs_replicas_with_disruption_budgets(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["ha"]
    cp = find(docs, "StatefulSet", "meshd-control-plane")[0]  # pods addressed by name
    assert cp["spec"]["replicas"] == 3
    assert cp["spec"]["template"]["spec"]["topologySpreadConstraints"]
    pdbs = {d["metadata"]["name"] for d in find(docs, "PodDisruptionBudget")}
    assert pdbs == {"meshd-control-plane", "meshd-webhook", "meshd-picker"}
    assert find(rendered["defaults"], "PodDisruptionBudget") == []
    (mwc,) = find(docs, "MutatingWebhookConfiguration")
    assert {w["failurePolicy"] for w in mwc["webhooks"]} == {"Fail"}


def test_picker_is_optional(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert find(rendered["defaults"], "Deployment", "meshd-picker") == []
    (svc,) = find(rendered["picker"], "Service", "meshd-picker")
    assert svc["spec"]["ports"][0]["port"] == 9002


@pytest.mark.parametrize(
    ("value_set", "kind", "name", "container"),
    [
        ("picker", "Deployment", "meshd-picker", "picker"),
        ("all-flags", "Deployment", "meshd-picker", "picker"),
        ("mtls", "Deployment", "meshd-control-plane", "control-plane"),
        ("mtls-sharded", "StatefulSet", "meshd-control-plane", "control-plane"),
        ("all-flags", "Deployment", "meshd-control-plane", "control-plane"),
        ("defaults", "Deployment", "meshd-webhook", "webhook"),
    ],
)
def test_rendered_commands_are_accepted_by_meshd_itself(
    rendered: dict[str, list[dict[str, Any]]], value_set: str, kind: str, name: str, container: str
) -> None:
    from meshd.cli import build_parser

    (deploy,) = find(rendered[value_set], kind, name)
    (c,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    assert c["command"] == ["meshd"]
    args = build_parser().parse_args(c["args"])  # exits (fails the test) on an unknown flag
    assert callable(args.func)


def _args(docs: list[dict[str, Any]], name: str) -> Any:
    from meshd.cli import build_parser

    (deploy,) = find(docs, "Deployment", name)
    return build_parser().parse_args(deploy["spec"]["template"]["spec"]["containers"][0]["args"])


def test_control_plane_flags_follow_the_values(rendered: dict[str, list[dict[str, Any]]]) -> None:
    default = _args(rendered["defaults"], "meshd-control-plane")
    assert (default.resource_ttl_s, default.no_eds) == (30.0, False)
    changed = _args(rendered["all-flags"], "meshd-control-plane")
    assert (changed.resource_ttl_s, changed.no_eds) == (0.0, True)


def test_the_frames_publish_port_is_served_and_exposed_or_off(
    rendered: dict[str, list[dict[str, Any]]], chart: Any
) -> None:
    def ports(docs: list[dict[str, Any]]) -> tuple[int, list[int], list[int]]:
        (deploy,) = find(docs, "Deployment", "meshd-control-plane")
        (c,) = deploy["spec"]["template"]["spec"]["containers"]
        (svc,) = find(docs, "Service", "meshd-control-plane")
        return (
            _args(docs, "meshd-control-plane").publish_port,
            [p["containerPort"] for p in c["ports"] if p["name"] == "tcp-publish"],
            [p["port"] for p in svc["spec"]["ports"] if p["name"] == "tcp-publish"],
        )

    assert ports(rendered["defaults"]) == (15011, [15011], [15011])
    assert ports(render(chart, {"controlPlane": {"publishPort": 0}})) == (-1, [], [])


def test_picker_flags_follow_the_values(rendered: dict[str, list[dict[str, Any]]]) -> None:
    plain = _args(rendered["picker"], "meshd-picker")
    assert (plain.fallbacks, plain.trust_routing_headers, plain.max_in_flight) == (0, False, None)
    assert plain.otlp_endpoint is None  # no telemetry.otlp.endpoint: no spans at all
    full = _args(rendered["all-flags"], "meshd-picker")
    assert [e.gpu for e in full.endpoint] == ["H100", "H100", "A100"]
    assert (full.fallbacks, full.trust_routing_headers, full.max_in_flight) == (2, True, 64)
    assert (full.otlp_endpoint, full.trace_sample_ratio) == (OTLP, 0.25)


def test_picker_sample_ratio_defaults_to_the_global_one(chart: Any) -> None:
    """Without its own ratio the picker samples at telemetry.otlp.sampleRatio."""
    docs = render(
        chart,
        {
            "picker": {"enabled": True, "endpoints": ["10.0.0.5:8000"]},
            "telemetry": {"otlp": {"endpoint": OTLP, "sampleRatio": 0.05}},
        },
    )
    args = _args(docs, "meshd-picker")
    assert (args.otlp_endpoint, args.trace_sample_ratio) == (OTLP, 0.05)
    # http/protobuf is not what meshd's exporters speak: no flag rather than a wrong one.
    docs = render(
        chart,
        {
            "picker": {"enabled": True, "endpoints": ["10.0.0.5:8000"]},
            "telemetry": {"otlp": {"endpoint": OTLP, "protocol": "http/protobuf"}},
        },
    )
    assert _args(docs, "meshd-picker").otlp_endpoint is None


def _sidecar_and_injection(docs: list[dict[str, Any]], tmp_path: Path) -> tuple[Any, Any]:
    (cm,) = find(docs, "ConfigMap", "meshd-config")
    (tmp_path / "sidecar.yaml").write_text(cm["data"]["sidecar.yaml"])
    (tmp_path / "inject.yaml").write_text(cm["data"]["inject.yaml"])
    return load_config(str(tmp_path / "sidecar.yaml")), load_config_file(
        str(tmp_path / "inject.yaml")
    )


def test_sidecars_and_agents_reach_the_releases_control_plane(
    rendered: dict[str, list[dict[str, Any]]], chart: Any, tmp_path: Path
) -> None:
    docs = rendered["defaults"]
    (svc,) = find(docs, "Service", "meshd-control-plane")
    (xds,) = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc-xds"]
    address = f"meshd-control-plane.{NAMESPACE}.svc:{xds}"
    sidecar, injection = _sidecar_and_injection(docs, tmp_path)
    assert sidecar.control_plane.addresses == (address,)
    assert sidecar.control_plane.tls is None
    assert injection.control_plane == address  # meshd agent --control-plane
    # mTLS: the sidecar's certificate paths go through as given.
    sidecar, _ = _sidecar_and_injection(rendered["mtls"], tmp_path)
    assert sidecar.control_plane.addresses == (address,)
    assert sidecar.control_plane.tls is not None
    assert sidecar.control_plane.tls.ca_file == "/var/run/secrets/meshd.io/mtls/ca.crt"
    # Addresses the user names are kept; connect=false leaves the sidecars on their own.
    own = {"sidecar": {"config": {"control_plane": {"addresses": ["cp-a:1", "cp-b:2"]}}}}
    sidecar, _ = _sidecar_and_injection(render(chart, own), tmp_path)
    assert sidecar.control_plane.addresses == ("cp-a:1", "cp-b:2")
    sidecar, _ = _sidecar_and_injection(rendered["all-flags"], tmp_path)
    assert sidecar.control_plane.addresses == ()


def test_mtls_points_the_sidecars_and_agents_at_the_mounted_certificate(
    rendered: dict[str, list[dict[str, Any]]], chart: Any, tmp_path: Path
) -> None:
    from meshd.inject_containers import mtls_files

    sidecar, injection = _sidecar_and_injection(rendered["mtls"], tmp_path)
    assert (injection.mtls_secret, injection.mtls_mount_path) == (
        "meshd-mesh-client",
        "/var/run/secrets/meshd.io/mtls",
    )
    tls = sidecar.control_plane.tls
    assert tls is not None
    assert {"ca_file": tls.ca_file, "cert_file": tls.cert_file, "key_file": tls.key_file} == (
        mtls_files(injection)
    )
    _, plain = _sidecar_and_injection(rendered["defaults"], tmp_path)
    assert plain.mtls_secret is None
    # A tls the user gives is kept; connect=false still mounts it for the engine agents.
    own = {"ca_file": "/own/ca.pem", "cert_file": "/own/c.pem", "key_file": "/own/k.pem"}
    values = {
        "mtls": {"enabled": True, "clientSecretName": "mine"},
        "sidecar": {"config": {"control_plane": {"tls": own}}},
    }
    sidecar, injection = _sidecar_and_injection(render(chart, values), tmp_path)
    assert sidecar.control_plane.tls is not None and sidecar.control_plane.tls.ca_file == (
        "/own/ca.pem"
    )
    assert injection.mtls_secret == "mine"
    off = {"mtls": {"enabled": True}, "sidecar": {"controlPlane": {"connect": False}}}
    sidecar, injection = _sidecar_and_injection(render(chart, off), tmp_path)
    assert sidecar.control_plane.tls is None and injection.mtls_secret == "meshd-mesh-client"


def test_otlp_endpoint_reaches_the_sidecars(
    rendered: dict[str, list[dict[str, Any]]], chart: Any, tmp_path: Path
) -> None:
    sidecar, _ = _sidecar_and_injection(rendered["all-flags"], tmp_path)
    tracing = sidecar.telemetry.tracing
    assert (tracing.otlp_endpoint, tracing.sample_ratio, tracing.insecure) == (OTLP, 0.5, True)
    sidecar, _ = _sidecar_and_injection(rendered["defaults"], tmp_path)
    assert sidecar.telemetry.tracing.otlp_endpoint is None
    own = {
        "telemetry": {"otlp": {"endpoint": "https://collector:4317"}},
        "sidecar": {"config": {"telemetry": {"tracing": {"sample_ratio": 1.0}}}},
    }
    sidecar, _ = _sidecar_and_injection(render(chart, own), tmp_path)
    tracing = sidecar.telemetry.tracing
    assert (tracing.otlp_endpoint, tracing.sample_ratio, tracing.insecure) == (
        "https://collector:4317",
        1.0,
        False,
    )


def test_webhook_configuration_selects_opted_in_pods_only(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    (mwc,) = find(rendered["defaults"], "MutatingWebhookConfiguration")
    by_name = {w["name"]: w for w in mwc["webhooks"]}
    ns_hook = by_name["namespace.sidecar-injector.meshd.io"]
    obj_hook = by_name["object.sidecar-injector.meshd.io"]
    assert ns_hook["clientConfig"]["service"]["path"] == "/mutate?namespace-opt-in=true"
    assert obj_hook["clientConfig"]["service"]["path"] == "/mutate"
    for hook in (ns_hook, obj_hook):
        assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
        assert hook["failurePolicy"] == "Ignore"
        assert hook["rules"] == [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]
        names = next(
            e
            for e in hook["namespaceSelector"]["matchExpressions"]
            if e["key"] == "kubernetes.io/metadata.name"
        )
        assert NAMESPACE in names["values"] and "kube-system" in names["values"]
    assert ns_hook["namespaceSelector"]["matchExpressions"][0] == {
        "key": "meshd.io/inject",
        "operator": "In",
        "values": ["true"],
    }


def test_least_privilege_rbac(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    assert find(docs, "Role") == [] and find(docs, "RoleBinding") == []
    (role,) = find(docs, "ClusterRole")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    (binding,) = find(docs, "ClusterRoleBinding")
    assert [s["name"] for s in binding["subjects"]] == ["meshd-control-plane"]
    sas = {d["metadata"]["name"]: d for d in find(docs, "ServiceAccount")}
    assert sas["meshd-webhook"]["automountServiceAccountToken"] is False
    webhook = find(docs, "Deployment", "meshd-webhook")[0]["spec"]["template"]["spec"]
    assert webhook["automountServiceAccountToken"] is False
    assert find(rendered["no-discovery"], "ClusterRole") == []


def test_meshd_never_injects_itself(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for deploy in find(rendered["ha"], "Deployment"):
        assert deploy["spec"]["template"]["metadata"]["annotations"]["meshd.io/inject"] == "false"


def test_config_map_holds_configs_meshd_accepts(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    for name in ("defaults", "cert-manager"):
        (cm,) = find(rendered[name], "ConfigMap", "meshd-config")
        (tmp_path / "sidecar.yaml").write_text(cm["data"]["sidecar.yaml"])
        (tmp_path / "inject.yaml").write_text(cm["data"]["inject.yaml"])
        sidecar = load_config(str(tmp_path / "sidecar.yaml"))
        assert sidecar.pools[0].name == "default"
        cfg = load_config_file(str(tmp_path / "inject.yaml"))
        assert cfg.image == "ghcr.io/meshd/meshd:0.1.0" and cfg.proxy_uid == 1337
    assert cfg.include_ports == "*" and cfg.exclude_ports == (22,)
    assert dict(cfg.env)["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://otel-collector")


def test_otel_endpoint_reaches_the_control_plane(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    cp = find(rendered["cert-manager"], "Deployment", "meshd-control-plane")[0]
    env = {e["name"]: e["value"] for e in cp["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
    assert env["OTEL_SERVICE_NAME"] == "meshd-control-plane"
    kinds = {d["kind"] for d in rendered["cert-manager"]}
    assert {"ServiceMonitor", "PodMonitor", "Certificate", "Issuer"} <= kinds
    (mwc,) = find(rendered["cert-manager"], "MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/meshd-webhook"
    )


def _certs(secret: dict[str, Any]) -> tuple[Any, Any]:
    data = secret["data"]
    leaf = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(data["ca.crt"]))
    return leaf, ca


def _dns_names(cert: Any) -> list[str]:
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names: list[str] = sans.get_values_for_type(x509.DNSName)
    return names


def _usages(cert: Any) -> set[Any]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_mtls_gives_the_control_plane_a_ca_signed_certificate(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["mtls"]
    (secret,) = find(docs, "Secret", "meshd-control-plane-tls")
    leaf, ca = _certs(secret)
    leaf.verify_directly_issued_by(ca)
    assert f"meshd-control-plane.{NAMESPACE}.svc" in _dns_names(leaf)
    assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in _usages(leaf)
    args = find(docs, "Deployment", "meshd-control-plane")[0]["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--tls-cert" in args and "--client-ca" in args
    (root,) = find(docs, "ConfigMap", "meshd-ca-root")
    assert x509.load_pem_x509_certificate(root["data"]["ca.crt"].encode()) == ca
    # The CA, key included, stays in the release namespace for upgrades to sign with.
    (ca_secret,) = find(docs, "Secret", "meshd-mesh-ca")
    assert ca_secret["metadata"]["namespace"] == NAMESPACE
    assert x509.load_pem_x509_certificate(base64.b64decode(ca_secret["data"]["tls.crt"])) == ca
    assert b"PRIVATE KEY" in base64.b64decode(ca_secret["data"]["tls.key"])


def test_mtls_gives_every_mesh_namespace_a_client_certificate_of_the_same_ca(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["mtls"]
    _, ca = _certs(find(docs, "Secret", "meshd-control-plane-tls")[0])
    clients = find(docs, "Secret", "meshd-mesh-client")
    assert sorted(c["metadata"]["namespace"] for c in clients) == MESH_NAMESPACES
    keys = set()
    for secret in clients:
        assert secret["type"] == "kubernetes.io/tls"
        assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
        leaf, client_ca = _certs(secret)
        assert client_ca == ca
        leaf.verify_directly_issued_by(ca)
        assert x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH in _usages(leaf)
        ns = secret["metadata"]["namespace"]
        cn = leaf.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
        assert cn == f"meshd-mesh-client.{ns}"
        assert int(secret["metadata"]["annotations"]["meshd.io/renew-after"]) > 0
        keys.add(secret["data"]["tls.key"])
    assert len(keys) == len(clients)  # a key of its own for each namespace
    assert not find(rendered["defaults"], "Secret", "meshd-mesh-client")


LOOKUP = '{{- lookup "v1" "Secret" (index . 1) (index . 2) | default dict | toJson -}}'
# The chart with lookup answered from .Values.cluster ("namespace/name" -> Secret), and no
# schema (which would refuse that key): upgrades played offline.
PLAYED_LOOKUP = (
    "{{- index ((index . 0).Values.cluster | default dict) "
    '(printf "%s/%s" (index . 1) (index . 2)) | default dict | toJson -}}'
)


@pytest.fixture(scope="module")
def upgradable_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import shutil

    where = tmp_path_factory.mktemp("chart") / "meshd"
    shutil.copytree(CHART, where)
    (where / "values.schema.json").unlink()
    helpers = where / "templates" / "_helpers.tpl"
    text = helpers.read_text()
    assert text.count(LOOKUP) == 1
    helpers.write_text(text.replace(LOOKUP, PLAYED_LOOKUP))
    with helm.Chart.load(str(where)) as loaded:
        yield loaded


def _upgrade(chart: Any, values: dict[str, Any], cluster: list[dict[str, Any]]) -> Any:
    held = {f"{d['metadata']['namespace']}/{d['metadata']['name']}": d for d in cluster}
    manifests = chart.render(
        {**values, "cluster": held}, name="meshd", namespace=NAMESPACE, is_upgrade=True
    )
    docs = [
        d
        for p, t in manifests.items()
        if not p.endswith("NOTES.txt")
        for d in yaml.safe_load_all(t)
        if d
    ]
    return [d for d in docs if d["kind"] == "Secret"]


def _by_name(secrets: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{d['metadata']['namespace']}/{d['metadata']['name']}": d for d in secrets}


def test_mtls_upgrades_keep_the_ca_and_sign_what_changed(upgradable_chart: Any) -> None:
    """The lookup path, played with the Secrets of an install as the cluster: an upgrade
    keeps the CA and every certificate; a namespace added later gets one of the same CA; a
    certificate whose names changed, or that reached meshd.io/renew-after, is signed anew
    by the same CA; a CA Secret gone means a new CA and everything signed again."""
    values: dict[str, Any] = {"mtls": {"enabled": True, "namespaces": ["apps"]}}
    first = _upgrade(upgradable_chart, values, [])
    installed = _by_name(first)
    ca_key = f"{NAMESPACE}/meshd-mesh-ca"
    server_key, apps_key = f"{NAMESPACE}/meshd-control-plane-tls", "apps/meshd-mesh-client"

    again = _by_name(_upgrade(upgradable_chart, values, first))
    for key in (ca_key, server_key, apps_key):
        assert again[key]["data"] == installed[key]["data"], key

    grown = {"mtls": {"enabled": True, "namespaces": ["apps", "models"], "extraIPs": ["10.9.9.9"]}}
    after = _by_name(_upgrade(upgradable_chart, grown, first))
    assert after[ca_key]["data"] == installed[ca_key]["data"]
    assert after[apps_key]["data"] == installed[apps_key]["data"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(installed[ca_key]["data"]["tls.crt"]))
    models, _ = _certs(after["models/meshd-mesh-client"])
    models.verify_directly_issued_by(ca)
    server, _ = _certs(after[server_key])  # its names changed: signed again, same CA
    assert after[server_key]["data"]["tls.crt"] != installed[server_key]["data"]["tls.crt"]
    server.verify_directly_issued_by(ca)
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.9.9.9"]

    due = copy.deepcopy(first)
    for d in due:
        if d["metadata"]["name"] == "meshd-mesh-client":
            d["metadata"]["annotations"]["meshd.io/renew-after"] = "1"
    after = _by_name(_upgrade(upgradable_chart, values, due))
    assert after[apps_key]["data"]["tls.crt"] != installed[apps_key]["data"]["tls.crt"]
    assert after[server_key]["data"] == installed[server_key]["data"]
    renewed, _ = _certs(after[apps_key])
    renewed.verify_directly_issued_by(ca)
    assert int(after[apps_key]["metadata"]["annotations"]["meshd.io/renew-after"]) > 10**9

    lost = [d for d in first if d["metadata"]["name"] != "meshd-mesh-ca"]
    after = _by_name(_upgrade(upgradable_chart, values, lost))
    assert after[ca_key]["data"]["tls.crt"] != installed[ca_key]["data"]["tls.crt"]
    new_ca = x509.load_pem_x509_certificate(base64.b64decode(after[ca_key]["data"]["tls.crt"]))
    for key in (server_key, apps_key):
        leaf, leaf_ca = _certs(after[key])
        assert leaf_ca == new_ca
        leaf.verify_directly_issued_by(new_ca)


def test_mtls_certificate_names_each_control_plane_pod_when_there_are_several(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = rendered["mtls-sharded"]
    leaf, _ = _certs(find(docs, "Secret", "meshd-control-plane-tls")[0])
    names = set(_dns_names(leaf))
    sidecar, injection = _sidecar_and_injection(docs, tmp_path)
    dialled = {a.rsplit(":", 1)[0] for shard in sidecar.control_plane.shards for a in shard}
    dialled |= {a.rsplit(":", 1)[0] for a in injection.control_plane_shards}
    assert len(dialled) == 2 and dialled <= names
    assert "cp.example.com" in names


# What the chart writes of cert-manager.io/v1 (Certificate, ClusterIssuer), as its API
# reference documents those fields; strict: a field it does not name is an error.
_ISSUER_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "kind": {"type": "string"},
        "group": {"type": "string"},
    },
}
_USAGES = ["digital signature", "key encipherment", "server auth", "client auth", "cert sign"]
CERT_MANAGER_SPECS: dict[str, dict[str, Any]] = {
    "Certificate": {
        "type": "object",
        "required": ["secretName", "issuerRef"],
        "properties": {
            "secretName": {"type": "string"},
            "commonName": {"type": "string", "maxLength": 64},
            "dnsNames": {"type": "array", "items": {"type": "string"}},
            "ipAddresses": {"type": "array", "items": {"type": "string"}},
            "duration": {"type": "string", "pattern": "^[0-9]+h$"},
            "isCA": {"type": "boolean"},
            "usages": {"type": "array", "items": {"enum": _USAGES}},
            "privateKey": {
                "type": "object",
                "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                },
            },
            "issuerRef": _ISSUER_REF,
        },
    },
    "ClusterIssuer": {
        "type": "object",
        "minProperties": 1,
        "maxProperties": 1,
        "properties": {
            "selfSigned": {"type": "object"},
            "ca": {
                "type": "object",
                "required": ["secretName"],
                "properties": {"secretName": {"type": "string"}},
            },
        },
    },
}


def test_cert_manager_mtls_issues_every_certificate_from_one_cluster_issuer(
    rendered: dict[str, list[dict[str, Any]]], chart: Any
) -> None:
    import jsonschema

    docs = rendered["cert-manager"]
    for doc in docs:
        if doc["kind"] in CERT_MANAGER_SPECS:
            assert doc["apiVersion"] == "cert-manager.io/v1"
            jsonschema.validate(doc["spec"], _strict(CERT_MANAGER_SPECS[doc["kind"]]))
    issuers = {d["metadata"]["name"]: d for d in find(docs, "ClusterIssuer")}
    assert issuers["meshd-mesh-selfsigned"]["spec"] == {"selfSigned": {}}
    assert issuers["meshd-mesh-ca"]["spec"] == {"ca": {"secretName": "meshd-mesh-ca"}}
    certs = find(docs, "Certificate")
    (root,) = [c for c in certs if c["spec"].get("isCA")]
    # A CA ClusterIssuer reads its Secret in cert-manager's cluster resource namespace.
    assert root["metadata"]["namespace"] == "cert-manager"
    assert root["spec"]["secretName"] == "meshd-mesh-ca"
    assert root["spec"]["issuerRef"]["name"] == "meshd-mesh-selfsigned"
    ca_ref = {"name": "meshd-mesh-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    (server,) = find(docs, "Certificate", "meshd-control-plane")
    assert server["spec"]["secretName"] == "meshd-control-plane-tls"
    assert server["spec"]["issuerRef"] == ca_ref
    assert f"meshd-control-plane.{NAMESPACE}.svc" in server["spec"]["dnsNames"]
    clients = find(docs, "Certificate", "meshd-mesh-client")
    assert sorted(c["metadata"]["namespace"] for c in clients) == MESH_NAMESPACES
    for c in clients:
        assert c["spec"]["secretName"] == "meshd-mesh-client"
        assert c["spec"]["issuerRef"] == ca_ref and "client auth" in c["spec"]["usages"]
    # The webhook's own certificate keeps its namespaced self-signed Issuer.
    assert [i["metadata"]["name"] for i in find(docs, "Issuer")] == ["meshd-selfsigned"]

    # The user's ClusterIssuer signs them all, and the chart makes no CA of its own.
    theirs = {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    values = {
        "mtls": {
            "enabled": True,
            "mode": "certManager",
            "namespaces": ["apps"],
            "certManager": {"issuerRef": theirs},
        }
    }
    docs = render(chart, values)
    assert find(docs, "ClusterIssuer") == [] and find(docs, "Issuer") == []
    assert {c["metadata"]["name"] for c in find(docs, "Certificate")} == {
        "meshd-control-plane",
        "meshd-mesh-client",
    }
    assert all(c["spec"]["issuerRef"] == theirs for c in find(docs, "Certificate"))
    # A namespaced Issuer cannot sign in other namespaces: the install says so.
    values["mtls"]["certManager"] = {"issuerRef": {"name": "mine", "kind": "Issuer"}}
    with pytest.raises(helm.HelmRenderError, match="kind Issuer cannot sign"):
        render(chart, values)


def test_chart_injected_pods_mount_the_client_certificate_and_pass_its_flags(
    rendered: dict[str, list[dict[str, Any]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`meshd inject` with the chart's inject.yaml and sidecar.yaml: a client Deployment and
    an engine Deployment of a mesh namespace, each validated against the Kubernetes schemas;
    the Secret mounted where the sidecar's config and the agent's flags look."""
    from meshd.cli import build_parser
    from meshd.inject import _run

    docs = rendered["mtls"]
    (cm,) = find(docs, "ConfigMap", "meshd-config")
    for key in ("inject.yaml", "sidecar.yaml"):
        (tmp_path / key).write_text(cm["data"][key])

    def deployment(name: str, labels: dict[str, str]) -> dict[str, Any]:
        meta = {"labels": {"app": name, **labels}}
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": "apps"},
            "spec": {
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": meta,
                    "spec": {"containers": [{"name": name, "image": "busybox"}]},
                },
            },
        }

    manifests = [deployment("client", {}), deployment("vllm", {"meshd.io/role": "engine"})]
    (tmp_path / "in.yaml").write_text(yaml.safe_dump_all(manifests))
    argv = ["inject", "-f", str(tmp_path / "in.yaml"), "--config", str(tmp_path / "inject.yaml")]
    argv += ["--sidecar-config", str(tmp_path / "sidecar.yaml")]
    assert _run(build_parser().parse_args(argv)) == 0
    client, engine = list(yaml.safe_load_all(capsys.readouterr().out))
    for obj in (client, engine):
        kv.validate(obj, kv.latest_version(), strict=True)
        pod = obj["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["meshd-mtls"] == {
            "name": "meshd-mtls",
            "secret": {"secretName": "meshd-mesh-client"},  # not optional
        }
    (proxy,) = [
        c
        for c in client["spec"]["template"]["spec"]["initContainers"]
        if c["name"] == "meshd-proxy"
    ]
    mounts = {m["name"]: m for m in proxy["volumeMounts"]}
    assert mounts["meshd-mtls"] == {
        "name": "meshd-mtls",
        "mountPath": "/var/run/secrets/meshd.io/mtls",
        "readOnly": True,
    }
    config = client["spec"]["template"]["metadata"]["annotations"]["meshd.io/config"]
    (tmp_path / "pod.yaml").write_text(config)
    tls = load_config(str(tmp_path / "pod.yaml")).control_plane.tls
    assert tls is not None
    for path in (tls.ca_file, tls.cert_file, tls.key_file):
        assert path is not None and path.startswith("/var/run/secrets/meshd.io/mtls/")
    (agent,) = engine["spec"]["template"]["spec"]["initContainers"]
    assert agent["volumeMounts"] == [mounts["meshd-mtls"]]
    args = build_parser().parse_args(agent["args"])
    assert (args.tls_ca, args.tls_cert, args.tls_key) == (
        "/var/run/secrets/meshd.io/mtls/ca.crt",
        "/var/run/secrets/meshd.io/mtls/tls.crt",
        "/var/run/secrets/meshd.io/mtls/tls.key",
    )


def test_dashboard_has_the_panels_and_meshd_metrics(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    (cm,) = find(rendered["defaults"], "ConfigMap", "meshd-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["meshd.json"])
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for word in ("time to first token", "hit rate", "retries", "breaker", "cost per successful"):
        assert word in titles
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    metrics = set(re.findall(r"\b(meshd_[a-z_]+)", exprs))
    assert {"meshd_time_to_first_token_seconds_bucket", "meshd_upstream_attempts_total"} <= metrics


# ---------------------------------------------------------------- the certificate, for real


async def test_generated_webhook_certificate_serves_a_review(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    docs = rendered["defaults"]
    (secret,) = find(docs, "Secret", "meshd-webhook-tls")
    (mwc,) = find(docs, "MutatingWebhookConfiguration")
    ca_bundle = {w["clientConfig"]["caBundle"] for w in mwc["webhooks"]}
    assert ca_bundle == {secret["data"]["ca.crt"]}
    (cm,) = find(docs, "ConfigMap", "meshd-config")
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    (tmp_path / "inject.yaml").write_text(cm["data"]["inject.yaml"])

    server = WebhookServer(
        load_config_file(str(tmp_path / "inject.yaml")),
        str(tmp_path / "tls.crt"),
        str(tmp_path / "tls.key"),
        "127.0.0.1",
        0,
    )
    await server.start()
    assert server.address is not None
    # Trust only the caBundle, and check the name the API server dials.
    trust = ssl.create_default_context(cadata=base64.b64decode(ca_bundle.pop()).decode())
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"https://127.0.0.1:{server.address[1]}/mutate",
                data=REVIEW.read_bytes(),
                headers={"Content-Type": "application/json"},
                ssl=trust,
                server_hostname=f"meshd-webhook.{NAMESPACE}.svc",
            ) as resp,
        ):
            assert resp.status == 200
            answer = await resp.json()
    finally:
        await server.stop()
    assert answer["response"]["uid"] == json.loads(REVIEW.read_text())["request"]["uid"]
    assert answer["response"]["patchType"] == "JSONPatch"


async def test_the_installed_webhook_wires_pods_to_the_releases_control_plane(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The chart as installed (its webhook paths, certificate and inject.yaml) against
    AdmissionReviews in the v1 shape: an opted-in client pod, a pod of an opted-in namespace,
    an engine pod, an already injected pod and a hostNetwork one. Each patch is applied with
    jsonpatch and the pod validated against the newest Kubernetes schema; the sidecar's config
    and the agent's flags name the release's control plane Service."""
    jsonpatch = pytest.importorskip("jsonpatch", reason="jsonpatch is not installed")
    from meshd import webhook
    from meshd.cli import build_parser
    from meshd.inject_containers import ANNOTATION_CONFIG

    docs = rendered["defaults"]
    (secret,) = find(docs, "Secret", "meshd-webhook-tls")
    (mwc,) = find(docs, "MutatingWebhookConfiguration")
    (cm,) = find(docs, "ConfigMap", "meshd-config")
    paths = {w["name"]: w["clientConfig"]["service"]["path"] for w in mwc["webhooks"]}
    for key in ("tls.crt", "tls.key"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    for key in ("inject.yaml", "sidecar.yaml"):
        (tmp_path / key).write_text(cm["data"][key])
    address = f"meshd-control-plane.{NAMESPACE}.svc:15010"
    # The webhook's own command line, its mounted files here.
    (deploy,) = find(docs, "Deployment", "meshd-webhook")
    argv = [
        re.sub(r"^/etc/meshd/(config|tls)/", f"{tmp_path}/", a)
        for a in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    ]
    args = build_parser().parse_args(argv)
    server = WebhookServer(webhook._load(args), args.cert, args.key, "127.0.0.1", 0)
    await server.start()
    assert server.address is not None
    trust = ssl.create_default_context(cadata=base64.b64decode(secret["data"]["ca.crt"]).decode())

    client = json.loads(REVIEW.read_text())
    in_namespace = copy.deepcopy(client)
    del in_namespace["request"]["object"]["metadata"]["annotations"]["meshd.io/inject"]
    engine = json.loads(ENGINE_REVIEW.read_text())
    host_network = copy.deepcopy(client)
    host_network["request"]["object"]["spec"]["hostNetwork"] = True

    async def admit(session: aiohttp.ClientSession, review: dict[str, Any], hook: str) -> Any:
        async with session.post(
            f"https://127.0.0.1:{server.address[1]}{paths[hook]}",  # type: ignore[index]
            json=review,
            ssl=trust,
            server_hostname=f"meshd-webhook.{NAMESPACE}.svc",
        ) as resp:
            assert resp.status == 200
            answer = await resp.json()
        response = answer["response"]
        assert response["uid"] == review["request"]["uid"] and response["allowed"] is True
        if "patch" not in response:
            return None
        pod = jsonpatch.apply_patch(
            review["request"]["object"], json.loads(base64.b64decode(response["patch"]))
        )
        kv.validate(pod, kv.latest_version(), strict=True)
        return pod

    obj, ns = "object.sidecar-injector.meshd.io", "namespace.sidecar-injector.meshd.io"
    try:
        async with aiohttp.ClientSession() as session:
            pod = await admit(session, client, obj)
            ns_pod = await admit(session, in_namespace, ns)
            engine_pod = await admit(session, engine, ns)
            again = copy.deepcopy(client)
            again["request"]["object"] = pod
            skipped = [
                await admit(session, again, obj),  # already injected: left alone
                await admit(session, host_network, obj),
                await admit(session, in_namespace, obj),  # not opted in by itself
            ]
    finally:
        await server.stop()
    assert skipped == [None, None, None]
    for p in (pod, ns_pod):
        names = [c["name"] for c in p["spec"]["initContainers"]]
        assert names[:2] == ["meshd-init", "meshd-proxy"]
        (tmp_path / "pod.yaml").write_text(p["metadata"]["annotations"][ANNOTATION_CONFIG])
        assert load_config(str(tmp_path / "pod.yaml")).control_plane.addresses == (address,)
    (agent,) = [c for c in engine_pod["spec"]["initContainers"] if c["name"] == "meshd-agent"]
    args = agent["args"]
    assert args[args.index("--control-plane") + 1] == address


def test_sharded_control_planes_a_statefulset_that_agents_and_sidecars_address_by_pod(
    chart: Any, tmp_path: Path
) -> None:
    from meshd.inject_containers import agent_container
    from meshd.shards import parse_shard

    docs = render(chart, {"controlPlane": {"shards": 3}})
    (sts,) = find(docs, "StatefulSet", "meshd-control-plane")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == "meshd-control-plane-headless"
    assert not find(docs, "Deployment", "meshd-control-plane")
    (headless,) = find(docs, "Service", "meshd-control-plane-headless")
    assert headless["spec"]["clusterIP"] == "None"
    pods = [
        f"meshd-control-plane-{i}.meshd-control-plane-headless.{NAMESPACE}.svc:15010"
        for i in range(3)
    ]
    sidecar, injection = _sidecar_and_injection(docs, tmp_path)
    assert sidecar.control_plane.shards == tuple((p,) for p in pods)
    assert sidecar.control_plane.addresses == ()
    assert injection.control_plane_shards == tuple(pods)
    args = agent_container(injection)["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--shard"] == pods
    assert "--control-plane" not in args
    assert [parse_shard(p) for p in pods] == [(p,) for p in pods]
    with pytest.raises(Exception, match=r"controlPlane\.shards and controlPlane\.replicas"):
        render(chart, {"controlPlane": {"shards": 2, "replicas": 2}})


def test_sharded_control_planes_each_serve_envoy_every_shards_engines(chart: Any) -> None:
    """Each shard is told every shard and finds itself by its pod's name, so each serves
    the whole fleet's EDS view (xds/eds_shards.py): Envoy may follow any of them."""
    from meshd.cli import build_parser
    from xds.cli import other_shards

    docs = render(chart, {"controlPlane": {"shards": 3, "resourceTTLSeconds": 45}})
    (sts,) = find(docs, "StatefulSet", "meshd-control-plane")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    pods = [
        f"meshd-control-plane-{i}.meshd-control-plane-headless.{NAMESPACE}.svc:15010"
        for i in range(3)
    ]
    assert args.shard == pods
    assert (args.shard_self, args.shard_stale_s) == ("$(POD_NAME)", 45.0)
    (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # What the kubelet makes of $(POD_NAME) in the second pod:
    assert other_shards(args.shard, "meshd-control-plane-1") == [(pods[0],), (pods[2],)]
    # No EDS, or one shard: nothing to follow.
    for values in ({"shards": 3, "eds": False}, {"shards": 1}, {"replicas": 2}):
        docs = render(chart, {"controlPlane": values})
        (cp,) = find(docs, "StatefulSet", "meshd-control-plane") or find(
            docs, "Deployment", "meshd-control-plane"
        )
        (container,) = cp["spec"]["template"]["spec"]["containers"]
        assert "--shard" not in container["args"], values
        assert all(e["name"] != "POD_NAME" for e in container["env"])


def test_control_plane_replicas_each_get_every_update_and_sidecars_fail_over(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    from meshd.inject_containers import agent_container

    docs = rendered["ha"]  # controlPlane.replicas: 3
    (sts,) = find(docs, "StatefulSet", "meshd-control-plane")
    assert sts["spec"]["replicas"] == 3
    pods = [
        f"meshd-control-plane-{i}.meshd-control-plane-headless.{NAMESPACE}.svc:15010"
        for i in range(3)
    ]
    sidecar, injection = _sidecar_and_injection(docs, tmp_path)
    assert sidecar.control_plane.addresses == tuple(pods)  # one at a time, failing over
    assert injection.control_plane_shards == (",".join(pods),)  # one shard: all replicas
    args = agent_container(injection)["args"]
    assert args[args.index("--shard") + 1] == ",".join(pods)


# ---------------------------------------------------------------- autoscaling (KEDA)


def _strict(schema: Any) -> Any:
    """As kubernetes-validate's strict mode: an object schema without additionalProperties
    refuses fields it does not name (the API server would prune them: a typo is lost)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def keda_validator() -> Any:
    import jsonschema

    schema = _strict(yaml.safe_load(KEDA_SCHEMA.read_text()))
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("name", ["autoscaling", "autoscaling-prometheus"])
def test_scaled_objects_validate_against_kedas_crd(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    validator = keda_validator()
    objs = find(rendered[name], "ScaledObject")
    assert len(objs) == len(VALUE_SETS[name]["autoscaling"]["engines"])
    for doc in objs:
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
        assert errors == []
    # The validation can fail: a misspelt field and a number where KEDA wants a string.
    bad = copy.deepcopy(objs[0])
    bad["spec"]["minReplicas"] = 1
    bad["spec"]["triggers"][0]["metadata"]["targetValue"] = 1
    assert len(list(validator.iter_errors(bad))) == 2


def test_autoscaling_is_off_by_default(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name in VALUE_SETS:
        if not name.startswith("autoscaling"):
            assert find(rendered[name], "ScaledObject") == []


def test_scaled_objects_read_the_control_planes_figure(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["autoscaling"]
    big, small = find(docs, "ScaledObject")
    assert big["metadata"]["namespace"] == "models"  # beside the Deployment it scales
    assert small["metadata"]["namespace"] == NAMESPACE
    assert big["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "vllm-llama",
    }
    assert (big["spec"]["minReplicaCount"], big["spec"]["maxReplicaCount"]) == (1, 8)
    assert (small["spec"]["minReplicaCount"], small["spec"]["maxReplicaCount"]) == (0, 4)
    (svc,) = find(docs, "Service", "meshd-control-plane")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http-metrics")
    (trigger,) = big["spec"]["triggers"]
    assert trigger["type"] == "metrics-api" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["url"] == f"http://meshd-control-plane.{NAMESPACE}.svc:{port}/autoscale"
    assert meta["valueLocation"] == "pools.default.desired_replicas"
    assert meta["targetValue"] == "1"  # one replica per unit: the HPA asks for the figure
    # A pool name with a dot is escaped in the GJSON path KEDA reads.
    assert small["spec"]["triggers"][0]["metadata"]["valueLocation"] == (
        "pools.small\\.v2.desired_replicas"
    )
    (prom,) = find(rendered["autoscaling-prometheus"], "ScaledObject")
    (trigger,) = prom["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"] == {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
        "query": 'max(meshd_fleet_pool_desired_replicas{pool="default"})',
        "threshold": "1",
    }


def test_scaled_object_bounds_are_checked(chart: Any) -> None:
    engines = [{"pool": "p", "deployment": "d", "minReplicas": 5, "maxReplicas": 2}]
    with pytest.raises(Exception, match="minReplicas 5 over maxReplicas 2"):
        render(chart, {"autoscaling": {"enabled": True, "engines": engines}})


def test_sidecars_are_probed_on_their_probe_port_and_scraped_only_when_asked(
    rendered: dict[str, list[dict[str, Any]]], chart: Any, tmp_path: Path
) -> None:
    sidecar, injection = _sidecar_and_injection(rendered["defaults"], tmp_path)
    assert sidecar.listeners.admin.host == "127.0.0.1"  # /config never on the pod IP
    assert (injection.probe_port, injection.expose_metrics) == (15021, False)
    docs = render(chart, {"telemetry": {"serviceMonitor": {"enabled": True}}})
    _, injection = _sidecar_and_injection(docs, tmp_path)
    assert injection.expose_metrics  # the PodMonitor scrapes the probe port's /metrics
    (monitor,) = find(docs, "PodMonitor")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["meshd-probes"]
