# ruff: noqa: F811  (the `rig` fixture, imported from test_extproc, is each test's parameter)
"""envoy/recipes/: what can be checked without a cluster. The Envoy configuration each recipe
embeds (Istio EnvoyFilter patch values, Envoy Gateway's EnvoyPatchPolicy JSONPatch value) is
spliced into the bootstrap it corresponds to and loaded by the real Envoy (`--mode validate`),
and the Istio one also carries traffic: a dead primary is served by the fallback. Core
Kubernetes objects are checked by kubernetes-validate; the CRD kinds are not (their schemas are
not available offline), which envoy/README.md says."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_extproc import (
    RigFactory,
    _until,
    envoy_only,
    rig,  # noqa: F401  (the fixture; tests take it as a parameter)
)

from loadtest.envoy_bin import REPO_ROOT, validate_config
from loadtest.extproc_bench import FALLBACK_CONFIG, PICKER_CLUSTER
from meshd.extproc_messages import DESTINATION_HEADER, METADATA_NAMESPACE, SERVED_KEY

RECIPES = REPO_ROOT / "envoy" / "recipes"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((RECIPES / name).read_text()) if d]


def by_kind(name: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs(name)}


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][
        0
    ]["typed_config"]
    return hcm


def istio_bootstrap() -> dict[str, Any]:
    """extproc-fallback.yaml with the EnvoyFilter's ext_proc filter and cluster merge in place
    of its own, the way Istio applies them (the picker's Istio cluster renamed to the
    bootstrap's)."""
    config = yaml.safe_load(FALLBACK_CONFIG.read_text())
    spec = by_kind("istio-envoyfilter.yaml")["EnvoyFilter"]["spec"]
    patches = {p["applyTo"]: p for p in spec["configPatches"]}
    http = copy.deepcopy(patches["HTTP_FILTER"]["patch"]["value"])
    http["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = PICKER_CLUSTER
    filters = _hcm(config)["http_filters"]
    router = [f["name"] for f in filters].index("envoy.filters.http.router")
    filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
    filters.insert(router - 1, http)  # INSERT_BEFORE the router
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    clusters["pool"].update(copy.deepcopy(patches["CLUSTER"]["patch"]["value"]))  # MERGE
    return config


def test_every_recipe_parses_and_names_the_protocol() -> None:
    names = sorted(p.name for p in RECIPES.glob("*.yaml"))
    assert names == ["envoy-gateway.yaml", "inference-pool.yaml", "istio-envoyfilter.yaml"]
    for name in names:
        for d in docs(name):
            assert d["apiVersion"] and d["kind"] and d["metadata"]["name"]
    pool = by_kind("inference-pool.yaml")["InferencePool"]["spec"]
    assert pool["endpointPickerRef"]["port"]["number"] == 9002
    assert pool["endpointPickerRef"]["failureMode"] in ("FailOpen", "FailClose")
    # Only the picker steers: each recipe strips a client's header.
    vs = by_kind("istio-envoyfilter.yaml")["VirtualService"]["spec"]["http"][0]
    assert vs["headers"]["request"]["remove"] == [DESTINATION_HEADER]
    (rule,) = by_kind("envoy-gateway.yaml")["HTTPRoute"]["spec"]["rules"]
    assert rule["filters"][0]["requestHeaderModifier"]["remove"] == [DESTINATION_HEADER]


def test_the_recipes_override_host_is_the_one_in_extproc_fallback_yaml() -> None:
    config = yaml.safe_load(FALLBACK_CONFIG.read_text())
    ours = {c["name"]: c for c in config["static_resources"]["clusters"]}["pool"]
    spec = by_kind("istio-envoyfilter.yaml")["EnvoyFilter"]["spec"]
    (cluster,) = [p for p in spec["configPatches"] if p["applyTo"] == "CLUSTER"]
    assert cluster["patch"]["value"]["load_balancing_policy"] == ours["load_balancing_policy"]
    (patch,) = by_kind("envoy-gateway.yaml")["EnvoyPatchPolicy"]["spec"]["jsonPatches"]
    assert patch["operation"]["value"] == ours["load_balancing_policy"]
    override = ours["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    source = override["typed_config"]["override_host_sources"][0]["metadata"]
    assert source == {"key": METADATA_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}
    assert override["typed_config"]["selected_host_key"]["path"] == [{"key": SERVED_KEY}]


@envoy_only
def test_the_istio_patches_load_into_envoy(tmp_path: Path) -> None:
    path = tmp_path / "istio.yaml"
    path.write_text(yaml.safe_dump(istio_bootstrap()))
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr


@envoy_only
def test_the_envoy_gateway_json_patch_loads_into_envoy(tmp_path: Path) -> None:
    config = yaml.safe_load(FALLBACK_CONFIG.read_text())
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    del clusters["pool"]["load_balancing_policy"]
    (patch,) = by_kind("envoy-gateway.yaml")["EnvoyPatchPolicy"]["spec"]["jsonPatches"]
    assert patch["operation"]["op"] == "add"
    assert patch["operation"]["path"] == "/load_balancing_policy"
    clusters["pool"]["load_balancing_policy"] = patch["operation"]["value"]
    path = tmp_path / "eg.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr
    # ...and the check can fail: a policy Envoy does not know is refused.
    override = clusters["pool"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    override["typed_config"]["@type"] = "type.googleapis.com/envoy.no.such.Policy"
    path.write_text(yaml.safe_dump(config))
    assert validate_config(path).returncode != 0


@envoy_only
async def test_the_istio_patches_carry_a_request_past_a_dead_primary(
    rig: RigFactory, tmp_path: Path
) -> None:
    template = tmp_path / "istio-template.yaml"
    template.write_text(yaml.safe_dump(istio_bootstrap()))
    r = await rig(template=template, fallbacks=2, n_backends=3)
    status, _, _ = await r.complete("istio")
    assert status == 200
    primary = r.decisions[-1].route
    await asyncio.wait_for(_until(lambda: r.picker.picker.in_flight == 0), 10)
    for b in r.backends:
        if b.url == primary.url:
            await b.stop()
    status, _, _ = await r.complete("istio")
    assert status == 200
    served = r.decisions[-1].routes[1]
    assert any(b.url == served.url and b.requests for b in r.backends)


def test_the_core_kubernetes_objects_validate() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    checked = 0
    for name in ("inference-pool.yaml", "envoy-gateway.yaml", "istio-envoyfilter.yaml"):
        for d in docs(name):
            if d["apiVersion"] != "v1":
                continue  # CRD kinds: no schema offline
            kv.validate(d, kv.latest_version(), strict=True)
            checked += 1
    assert checked == 1  # the picker's Service
