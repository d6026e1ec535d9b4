"""meshd/inject.py (+ inject_containers.py, inject_config.py): decisions, the injected
containers, and the JSON Patch, applied with the `jsonpatch` library and the result validated
against the Kubernetes schemas (kubernetes-validate, strict: unknown fields are errors)."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd import inject as inj
from meshd import iptables
from meshd.inject import inject
from meshd.inject_config import (
    InjectionConfig,
    InjectionError,
    config_from_mapping,
    config_to_mapping,
)

jsonpatch = pytest.importorskip("jsonpatch", reason="jsonpatch is not installed")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

K8S = Path(__file__).parent / "k8s"
CFG = InjectionConfig()


def k8s_versions() -> list[str]:
    """Oldest supported (1.29), a middle one and the newest the package ships."""
    from kubernetes_validate.utils import all_versions, major_minor

    ours = sorted(
        {major_minor(v) for v in all_versions() if int(major_minor(v).split(".")[1]) >= 29},
        key=lambda v: int(v.split(".")[1]),
    )
    return sorted({ours[0], ours[len(ours) // 2], ours[-1]}, key=lambda v: int(v.split(".")[1]))


def validate(obj: dict[str, Any]) -> None:
    for version in k8s_versions():
        kv.validate(obj, version, strict=True)


def review_pod() -> dict[str, Any]:
    review = json.loads((K8S / "admission_review_pod.json").read_text())
    pod: dict[str, Any] = review["request"]["object"]
    return pod


def pod(
    annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if annotations is not None:
        meta["annotations"] = annotations
    if labels is not None:
        meta["labels"] = labels
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "app", "image": "busybox"}], **spec},
    }


def apply(obj: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = jsonpatch.apply_patch(obj, patch)
    return result


def init_names(obj: dict[str, Any]) -> list[str]:
    return [c["name"] for c in obj["spec"].get("initContainers", [])]


# ---------------------------------------------------------------- decisions


def test_review_pod_is_injected_before_its_own_init_containers() -> None:
    original = review_pod()
    result = inject(original, CFG)
    assert result.injected, result.reason
    patched = apply(original, result.patch)
    assert patched == result.obj
    assert original == review_pod(), "inject() must not mutate its argument"
    assert init_names(patched) == ["meshd-init", "meshd-proxy", "migrate"]
    assert [c["name"] for c in patched["spec"]["containers"]] == ["agent"]
    validate(patched)


def test_patch_escapes_annotation_keys_and_appends_to_existing_lists() -> None:
    result = inject(review_pod(), CFG)
    paths = [op["path"] for op in result.patch]
    assert "/metadata/annotations/meshd.io~1status" in paths
    assert "/spec/initContainers/0" in paths and "/spec/initContainers/1" in paths
    assert all(op["op"] == "add" for op in result.patch)


def test_pod_without_labels_is_left_alone_unless_its_namespace_opts_in() -> None:
    bare = pod()
    skipped = inject(bare, CFG)
    assert not skipped.injected and skipped.patch == []
    assert "not opted in" in skipped.reason
    assert skipped.obj == bare

    result = inject(bare, CFG, namespace_opt_in=True)
    assert result.injected and result.reason == "opted in by namespace label"
    patched = apply(bare, result.patch)
    assert init_names(patched) == ["meshd-init", "meshd-proxy"]
    assert json.loads(patched["metadata"]["annotations"]["meshd.io/status"])["role"] == "client"
    validate(patched)


def test_pod_label_opts_in_too() -> None:
    assert inject(pod(labels={"meshd.io/inject": "true"}), CFG).injected


def test_opt_out_annotation_beats_the_namespace_label() -> None:
    result = inject(pod({"meshd.io/inject": "false"}), CFG, namespace_opt_in=True, force=True)
    assert not result.injected and "opted out" in result.reason


def test_unknown_inject_value_is_not_injected_and_says_why() -> None:
    result = inject(pod({"meshd.io/inject": "yes"}), CFG)
    assert not result.injected and "expected" in result.reason


def test_already_injected_pod_is_unchanged() -> None:
    once = inject(review_pod(), CFG)
    again = inject(once.obj, CFG)
    assert not again.injected and again.patch == [] and again.reason == "already injected"
    assert again.obj == once.obj


def test_container_name_alone_marks_a_pod_injected() -> None:
    manual = pod({"meshd.io/inject": "true"})
    manual["spec"]["containers"].append({"name": "meshd-proxy", "image": "x"})
    assert inject(manual, CFG).reason == "already injected"


def test_host_network_pod_is_skipped_with_a_reason() -> None:
    result = inject(pod({"meshd.io/inject": "true"}, hostNetwork=True), CFG)
    assert not result.injected and "hostNetwork" in result.reason


def test_engine_pod_gets_the_agent_and_no_iptables() -> None:
    engine = pod(labels={"meshd.io/role": "engine"}, annotations={"meshd.io/inject": "true"})
    result = inject(engine, CFG)
    patched = apply(engine, result.patch)
    assert init_names(patched) == ["meshd-agent"]
    agent = patched["spec"]["initContainers"][0]
    assert agent["args"][0] == "agent" and agent["restartPolicy"] == "Always"
    assert "NET_ADMIN" not in json.dumps(patched)
    validate(patched)


@pytest.mark.parametrize("role", ["engine", "client"])
def test_injected_meshd_commands_are_accepted_by_meshd_itself(role: str) -> None:
    from meshd.cli import build_parser

    labels = {"meshd.io/role": "engine"} if role == "engine" else {}
    p = pod(labels=labels, annotations={"meshd.io/inject": "true"})
    patched = apply(p, inject(p, CFG).patch)
    ours = [c for c in patched["spec"]["initContainers"] if c["name"].startswith("meshd-")]
    assert ours
    for c in ours:
        env = {e["name"] for e in c.get("env", [])}
        # Kubernetes expands $(VAR) from the container's env; every one used must be set.
        args = [
            a.replace("$(MESHD_POD_NAME)", "pod").replace("$(MESHD_POD_IP)", "10.1.2.3")
            for a in c["args"]
        ]
        assert all("$(" not in a for a in args), c["args"]
        assert {
            v for v in ("MESHD_POD_NAME", "MESHD_POD_IP") if any(v in a for a in c["args"])
        } <= env
        parsed = build_parser().parse_args(args)  # exits (fails the test) on an unknown flag
        assert callable(parsed.func)


# ---------------------------------------------------------------- the injected containers


def test_proxy_is_a_native_sidecar_with_its_own_uid_probes_and_config() -> None:
    result = inject(pod({"meshd.io/inject": "true"}), CFG)
    init, proxy = result.obj["spec"]["initContainers"]
    assert proxy["restartPolicy"] == "Always"
    sc = proxy["securityContext"]
    assert (sc["runAsUser"], sc["runAsNonRoot"], sc["capabilities"]) == (
        1337,
        True,
        {"drop": ["ALL"]},
    )
    assert proxy["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    for probe, path in (
        ("startupProbe", "/readyz"),
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
    ):
        assert proxy[probe]["httpGet"] == {"path": path, "port": 15021}
    # The kubelet probes the pod IP on the probe listener; the admin one stays on loopback.
    assert "127.0.0.1:15000" in proxy["args"] and "0.0.0.0:15000" not in proxy["args"]
    assert "listeners.probes.enabled=true" in proxy["args"]
    assert "listeners.probes.metrics=true" not in proxy["args"]
    assert proxy["ports"] == [{"name": "meshd-probes", "containerPort": 15021, "protocol": "TCP"}]
    assert proxy["volumeMounts"] == [
        {"name": "meshd-config", "mountPath": "/etc/meshd", "readOnly": True}
    ]
    assert result.obj["spec"]["volumes"] == [
        {
            "name": "meshd-config",
            "configMap": {
                "name": "meshd-sidecar",
                "items": [{"key": "config.yaml", "path": "config.yaml"}],
            },
        }
    ]
    caps = init["securityContext"]["capabilities"]["add"]
    assert set(caps) == {"NET_ADMIN", "NET_RAW"}
    assert init["securityContext"]["runAsNonRoot"] is False


def _iptables_plan(args: list[str]) -> iptables.IptablesPlan:
    parser = argparse.ArgumentParser()
    iptables.register(parser.add_subparsers())
    ns = parser.parse_args(args)
    return iptables.plan_from_args(ns)


def test_init_container_runs_meshd_iptables_with_flags_it_accepts() -> None:
    result = inject(review_pod(), CFG)
    init = result.obj["spec"]["initContainers"][0]
    assert init["command"] == ["meshd"] and init["args"][:2] == ["iptables", "--apply"]
    plan = _iptables_plan(init["args"])
    assert plan.proxy_port == 15006 and plan.proxy_uid == 1337 and plan.proxy_gid == 1337
    assert plan.include_ports == (8000, 30000)
    assert plan.exclude_ports == (5432,), "the meshd.io/exclude-ports annotation"
    assert plan.exclude_cidrs == ("169.254.169.254/32",)


def test_include_ports_annotation_and_wildcard() -> None:
    for value, expected in (("8000,9000", (8000, 9000)), ("*", "*")):
        result = inject(pod({"meshd.io/inject": "true", "meshd.io/include-ports": value}), CFG)
        plan = _iptables_plan(result.obj["spec"]["initContainers"][0]["args"])
        assert plan.include_ports == expected


@pytest.mark.parametrize(
    "annotations",
    [
        {"meshd.io/include-ports": "80,http"},
        {"meshd.io/include-ports": ""},
        {"meshd.io/exclude-ports": "70000"},
        {"meshd.io/exclude-ports": "*"},
        {"meshd.io/exclude-cidrs": "10.0.0.0/33"},
    ],
)
def test_bad_port_annotations_raise_a_named_error(annotations: dict[str, str]) -> None:
    with pytest.raises(InjectionError, match=r"meshd\.io/"):
        inject(pod({"meshd.io/inject": "true", **annotations}), CFG)


def test_inline_sidecar_config_uses_the_downward_api() -> None:
    cfg = InjectionConfig(sidecar_config="pools: []\n")
    result = inject(pod({"meshd.io/inject": "true"}), cfg)
    assert result.obj["metadata"]["annotations"]["meshd.io/config"] == "pools: []\n"
    (volume,) = result.obj["spec"]["volumes"]
    item = volume["downwardAPI"]["items"][0]
    assert item["fieldRef"]["fieldPath"] == "metadata.annotations['meshd.io/config']"
    validate(result.obj)


def test_existing_volume_named_like_ours_is_an_error() -> None:
    clash = pod({"meshd.io/inject": "true"}, volumes=[{"name": "meshd-config", "emptyDir": {}}])
    with pytest.raises(InjectionError, match="meshd-config"):
        inject(clash, CFG)


MTLS_CFG = InjectionConfig(mtls_secret="meshd-mesh-client")
MTLS_DIR = "/var/run/secrets/meshd.io/mtls"
TLS_FILES = [f"{MTLS_DIR}/ca.crt", f"{MTLS_DIR}/tls.crt", f"{MTLS_DIR}/tls.key"]


@pytest.mark.parametrize("existing", [0, 2])
def test_mtls_secret_is_mounted_in_the_proxy_and_the_agent(existing: int) -> None:
    from meshd.cli import build_parser
    from meshd.inject_containers import mtls_files

    volumes = [{"name": f"v{i}", "emptyDir": {}} for i in range(existing)]
    client = pod({"meshd.io/inject": "true"}, volumes=volumes or None)
    engine = pod({"meshd.io/inject": "true"}, {"meshd.io/role": "engine"})
    mount = {"name": "meshd-mtls", "mountPath": MTLS_DIR, "readOnly": True}
    for obj in (client, engine):
        if not obj["spec"].get("volumes"):
            obj["spec"].pop("volumes", None)
        result = inject(obj, MTLS_CFG)
        patched = apply(obj, result.patch)
        assert patched == result.obj
        validate(patched)
        spec = patched["spec"]
        assert spec["volumes"][-1] == {
            "name": "meshd-mtls",
            "secret": {"secretName": "meshd-mesh-client"},
        }
        assert len(spec["volumes"]) == (existing if obj is client else 0) + 2
        status = json.loads(patched["metadata"]["annotations"]["meshd.io/status"])
        assert status["volumes"] == ["meshd-config", "meshd-mtls"]
        assert inject(patched, MTLS_CFG).patch == []  # injected once
    proxy = inject(client, MTLS_CFG).obj["spec"]["initContainers"][1]
    assert mount in proxy["volumeMounts"]
    (agent,) = inject(engine, MTLS_CFG).obj["spec"]["initContainers"]
    assert agent["volumeMounts"] == [mount]
    args = build_parser().parse_args(agent["args"])
    assert [args.tls_ca, args.tls_cert, args.tls_key] == TLS_FILES
    assert sorted(mtls_files(MTLS_CFG).values()) == TLS_FILES
    # Without a Secret: no volume, no mount, no TLS flags.
    (agent,) = inject(engine, CFG).obj["spec"]["initContainers"]
    assert "volumeMounts" not in agent and "--tls-ca" not in agent["args"]
    assert [v["name"] for v in inject(engine, CFG).obj["spec"]["volumes"]] == ["meshd-config"]


def test_mtls_settings_are_checked() -> None:
    clash = pod({"meshd.io/inject": "true"}, volumes=[{"name": "meshd-mtls", "emptyDir": {}}])
    with pytest.raises(InjectionError, match="meshd-mtls"):
        inject(clash, MTLS_CFG)
    inject(clash, CFG)  # the name is ours only when we mount it
    with pytest.raises(InjectionError, match="mtls_secret"):
        InjectionConfig(mtls_secret="Not_A_Name")
    with pytest.raises(InjectionError, match="mtls_mount_path"):
        InjectionConfig(mtls_secret="s", mtls_mount_path="relative")
    for inside in ("/etc/meshd/", "/etc/meshd/mtls", "/etc"):
        with pytest.raises(InjectionError, match="must not contain one another"):
            InjectionConfig(mtls_secret="s", mtls_mount_path=inside)
    moved = InjectionConfig(mtls_secret="s", mtls_mount_path="/var/run/meshd-tls")
    assert config_from_mapping(config_to_mapping(moved)) == moved
    (agent,) = inject(pod({"meshd.io/role": "engine"}), moved, force=True).obj["spec"][
        "initContainers"
    ]
    assert agent["args"][agent["args"].index("--tls-ca") + 1] == "/var/run/meshd-tls/ca.crt"


def test_not_a_workload_is_an_error() -> None:
    with pytest.raises(InjectionError, match="cannot inject kind 'Service'"):
        inject({"kind": "Service", "metadata": {}}, CFG)


def test_config_mapping_round_trip_and_unknown_keys() -> None:
    cfg = InjectionConfig(
        image="meshd:dev", include_ports="*", exclude_ports=(22,), env=(("OTEL_SERVICE_NAME", "x"),)
    )
    assert config_from_mapping(config_to_mapping(cfg)) == cfg
    with pytest.raises(InjectionError, match="proxy_uidd"):
        config_from_mapping({"proxy_uidd": 1})
    with pytest.raises(InjectionError, match="proxy_uid"):
        InjectionConfig(proxy_uid=0)
    with pytest.raises(InjectionError, match="must differ"):
        InjectionConfig(admin_port=15001)


# ---------------------------------------------------------------- property


pods = st.builds(
    lambda annotations, labels, inits, volumes, engine, meta: _shape(
        annotations, labels, inits, volumes, engine, meta
    ),
    st.dictionaries(st.sampled_from(["a/b", "x~y", "note"]), st.text(max_size=5), max_size=2),
    st.dictionaries(st.sampled_from(["app", "tier"]), st.sampled_from(["a", "b"]), max_size=2),
    st.integers(0, 2),
    st.integers(0, 2),
    st.booleans(),
    st.booleans(),
)


def _shape(
    annotations: dict[str, str],
    labels: dict[str, str],
    inits: int,
    volumes: int,
    engine: bool,
    meta: bool,
) -> dict[str, Any]:
    obj = pod(annotations or None, labels or None)
    if engine:
        obj["metadata"].setdefault("labels", {})["meshd.io/role"] = "engine"
    if inits:
        obj["spec"]["initContainers"] = [{"name": f"i{i}", "image": "x"} for i in range(inits)]
    if volumes:
        obj["spec"]["volumes"] = [{"name": f"v{i}", "emptyDir": {}} for i in range(volumes)]
    if not meta:
        del obj["metadata"]
    return obj


@settings(max_examples=60, deadline=None)
@given(pods)
def test_patch_reproduces_the_result_and_reinjection_is_a_no_op(obj: dict[str, Any]) -> None:
    before = copy.deepcopy(obj)
    result = inject(obj, CFG, force=True)
    assert obj == before
    assert result.injected
    assert apply(obj, result.patch) == result.obj
    ours = init_names(result.obj)[: len(init_names(result.obj)) - len(init_names(obj))]
    engine = "meshd.io/role" in json.dumps(obj)
    assert ours == (["meshd-agent"] if engine else ["meshd-init", "meshd-proxy"])
    assert inject(result.obj, CFG, force=True).patch == []


# ---------------------------------------------------------------- meshd inject


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    inj.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_round_trips_workloads_and_is_idempotent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_cli(["inject", "-f", str(K8S / "workloads.yaml")], capsys)
    assert rc == 0, err
    docs = list(yaml.safe_load_all(out))
    originals = list(yaml.safe_load_all((K8S / "workloads.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Deployment", "StatefulSet", "CronJob", "Service"]
    deploy, sts, cron, svc = docs
    assert init_names(deploy["spec"]["template"]) == ["meshd-init", "meshd-proxy"]
    assert "8000,8001" in deploy["spec"]["template"]["spec"]["initContainers"][0]["args"]
    assert init_names(sts["spec"]["template"]) == ["meshd-agent"]
    assert init_names(cron["spec"]["jobTemplate"]["spec"]["template"]) == [
        "meshd-init",
        "meshd-proxy",
    ]
    assert svc == originals[3]
    # Everything but the pod template is exactly what went in.
    assert deploy["spec"]["replicas"] == 2 and deploy["metadata"] == originals[0]["metadata"]
    assert "Deployment/research-agent: injection requested" in err
    for doc in docs:
        validate(doc)

    once = tmp_path / "once.yaml"
    once.write_text(out)
    rc, twice, err = run_cli(["inject", "-f", str(once)], capsys)
    assert rc == 0 and twice == out
    assert "already injected" in err


def test_cli_image_flag_and_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "inject.yaml"
    conf.write_text("proxy_uid: 2000\nproxy_gid: 2000\ninclude_ports: '*'\n")
    rc, out, err = run_cli(
        [
            "inject",
            "-f",
            str(K8S / "workloads.yaml"),
            "--config",
            str(conf),
            "--image",
            "meshd:dev",
        ],
        capsys,
    )
    assert rc == 0, err
    init = next(yaml.safe_load_all(out))["spec"]["template"]["spec"]["initContainers"][0]
    assert init["image"] == "meshd:dev"
    assert _iptables_plan(init["args"]).proxy_uid == 2000


def test_cli_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(pod({"meshd.io/exclude-ports": "ssh"})))
    rc, out, err = run_cli(["inject", "-f", str(bad)], capsys)
    assert rc == 1 and out == ""
    assert "meshd.io/exclude-ports" in err


def test_metrics_on_the_pod_ip_are_opt_in() -> None:
    opted = inject(pod({"meshd.io/inject": "true", "meshd.io/expose-metrics": "true"}), CFG)
    proxy = opted.obj["spec"]["initContainers"][1]
    assert "listeners.probes.metrics=true" in proxy["args"]
    everywhere = InjectionConfig(expose_metrics=True)
    declined = inject(
        pod({"meshd.io/inject": "true", "meshd.io/expose-metrics": "false"}), everywhere
    )
    assert "listeners.probes.metrics=true" not in declined.obj["spec"]["initContainers"][1]["args"]
    with pytest.raises(InjectionError, match="expose-metrics"):
        inject(pod({"meshd.io/inject": "true", "meshd.io/expose-metrics": "yes"}), CFG)
    with pytest.raises(InjectionError, match="probe_port"):
        InjectionConfig(probe_port=15000)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"containers": [{"name": {}}]}, r"spec\.containers\[0\]\.name must be a string"),
        ({"initContainers": "x"}, r"spec\.initContainers must be a list"),
        ({"containers": ["app"]}, r"spec\.containers\[0\] must be a map"),
    ],
)
def test_a_container_list_of_the_wrong_shape_is_an_injection_error(spec, message) -> None:
    # Found by the webhook fuzz target (`python -m fuzz webhook --native`): a container
    # name that was a map raised TypeError (unhashable dict) out of is_injected.
    with pytest.raises(InjectionError, match=message):
        inj.is_injected({}, spec)
