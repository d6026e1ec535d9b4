# ruff: noqa: F811  (the `rig` fixture, imported from test_extproc, is each test's parameter)
"""Ordered fallbacks through a real Envoy (envoy/extproc-fallback.yaml): the picker answers
`primary,fallback,...`, Envoy's override_host policy walks the list on retries, and the picker
learns from `x-gateway-destination-endpoint-served` which endpoint served, charging the ones
Envoy passed with a connect failure."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from backends import sse_events
from test_extproc import (
    RigFactory,
    _until,
    addr,
    envoy_only,
    rig,  # noqa: F401  (the fixture; tests take it as a parameter)
)

from filters.pool_router import make_router
from loadtest.envoy_bin import validate_config
from loadtest.extproc_bench import FALLBACK_CONFIG, render_extproc_config
from meshd.extproc import endpoint_spec
from meshd.extproc_messages import DESTINATION_HEADER, METADATA_NAMESPACE, SERVED_KEY
from meshd.extproc_picker import EndpointPicker, PickerSettings, _Stream


def retry_stat(r: object, name: str) -> int:
    text = r.envoy.admin_get(f"/stats?filter=^cluster\\.pool\\.{name}$")  # type: ignore[attr-defined]
    return int(text.split(":")[1]) if text.strip() else 0


@envoy_only
def test_the_fallback_config_is_valid_and_walks_the_metadata_list(tmp_path: Path) -> None:
    result = validate_config(FALLBACK_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    config = render_extproc_config(
        ("127.0.0.1", 19002), [("127.0.0.1", 18001)], template=FALLBACK_CONFIG
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    assert validate_config(path).returncode == 0
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    (policy,) = clusters["pool"]["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    # The metadata alone (a client cannot set it); the header too would list each address twice.
    assert override["override_host_sources"] == [
        {"metadata": {"key": METADATA_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}
    ]
    assert override["selected_host_key"]["path"] == [{"key": SERVED_KEY}]
    (locality,) = clusters["pool"]["load_assignment"]["endpoints"]
    assert [
        e["endpoint"]["address"]["socket_address"]["port_value"] for e in locality["lb_endpoints"]
    ] == [18001]
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (route,) = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    retry = route["route"]["retry_policy"]
    assert "connect-failure" in retry["retry_on"] and retry["num_retries"] == 2
    (ext_proc,) = [
        f for f in hcm["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    ]
    # The served endpoint comes back to the picker in the forwarded envoy.lb metadata.
    assert (
        METADATA_NAMESPACE
        in ext_proc["typed_config"]["metadata_options"]["forwarding_namespaces"]["untyped"]
    )


@envoy_only
@pytest.mark.parametrize("stream", [False, True])
async def test_a_dead_primary_is_served_by_the_first_fallback(
    rig: RigFactory, stream: bool
) -> None:
    r = await rig(template=FALLBACK_CONFIG, fallbacks=2, n_backends=3)
    status, _, _ = await r.complete("warm up")
    assert status == 200
    primary, fallback, _ = r.decisions[-1].routes
    (dead,) = [b for b in r.backends if b.url == primary.url]
    await dead.stop()  # refuses connections from now on; the picker still lists it
    await asyncio.wait_for(_until(lambda: r.picker.picker.in_flight == 0), 10)
    r.router.calls.clear()
    status, body, _ = await r.complete("warm up", stream=stream)  # same prefix: same primary
    assert status == 200, body
    if stream:
        assert sse_events(body)[-1] == "[DONE]"
    else:
        assert json.loads(body)["choices"][0]["text"] == "w0 w1 w2 w3"
    d = r.decisions[-1]
    assert d.destination.split(",")[0] == addr(primary.url)
    assert d.destination.count(",") == 2
    # Served by the next address of the list, through an Envoy retry.
    (served,) = [b for b in r.backends if b.url == fallback.url]
    assert served.requests[-1].body is not None
    assert served.requests[-1].body["prompt"] == "warm up"
    assert retry_stat(r, "upstream_rq_retry_success") >= 1
    await asyncio.wait_for(_until(lambda: r.picker.picker.in_flight == 0), 10)
    assert r.router.calls == [
        ("started", primary.url),
        ("connect_failed", primary.url),
        ("started", fallback.url),
        ("finished", fallback.url),
    ]


@envoy_only
async def test_the_list_is_walked_in_order_and_then_envoys_own_policy_takes_over(
    rig: RigFactory, tmp_path: Path
) -> None:
    # Past the list, Envoy's least-request policy draws among all three (two dead) and
    # previous_hosts rejects a dead draw: 50 redraws make a flake (2/3)^50 unlikely.
    config = yaml.safe_load(FALLBACK_CONFIG.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (route,) = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    route["route"]["retry_policy"]["host_selection_retry_max_attempts"] = 50
    template = tmp_path / "fallback.yaml"
    template.write_text(yaml.safe_dump(config))
    r = await rig(template=template, fallbacks=1, n_backends=3)
    status, _, _ = await r.complete("order")
    assert status == 200
    first, second = r.decisions[-1].routes
    for b in r.backends:
        if b.url in (first.url, second.url):
            await b.stop()
    (alive,) = [b for b in r.backends if b.url not in (first.url, second.url)]
    await asyncio.wait_for(_until(lambda: r.picker.picker.in_flight == 0), 10)
    r.router.calls.clear()
    status, _, _ = await r.complete("order")
    assert status == 200
    assert alive.requests and alive.requests[-1].body is not None
    await asyncio.wait_for(_until(lambda: r.picker.picker.in_flight == 0), 10)
    # Both listed endpoints charged, the rest of the request on the one Envoy's policy chose.
    assert r.router.calls == [
        ("started", first.url),
        ("connect_failed", first.url),
        ("started", second.url),
        ("connect_failed", second.url),
        ("started", alive.url),
        ("finished", alive.url),
    ]


@envoy_only
async def test_a_dead_primary_is_left_once_the_picker_ejects_it(rig: RigFactory) -> None:
    r = await rig(template=FALLBACK_CONFIG, fallbacks=2, n_backends=3)
    shared = "You are a careful assistant. " * 40
    status, _, _ = await r.complete(shared + "0")
    assert status == 200
    primary = r.decisions[-1].route
    (dead,) = [b for b in r.backends if b.url == primary.url]
    await dead.stop()
    primaries = []
    for i in range(1, 8):
        status, _, _ = await r.complete(shared + str(i))
        assert status == 200  # every one served, by a fallback while the primary is listed
        primaries.append(r.decisions[-1].route.url)
        await asyncio.wait_for(_until(lambda: r.picker.picker.in_flight == 0), 10)
    # The connect failures Envoy reported ejected it: the picker stops naming it first.
    assert primaries[0] == primary.url and primaries[-1] != primary.url


@envoy_only
async def test_with_the_picker_down_envoy_balances_on_its_own(rig: RigFactory) -> None:
    r = await rig(template=FALLBACK_CONFIG, fallbacks=2, n_backends=2)
    await r.picker.kill()
    results = [await r.complete(f"after {i}") for i in range(4)]
    assert [s for s, _, _ in results] == [200] * 4
    assert sum(r.served().values()) == 4


# -- the accounting, without Envoy --------------------------------------------------------------


def _picker(n: int) -> EndpointPicker:
    specs = tuple(endpoint_spec(f"10.0.0.{i}:8000") for i in range(1, n + 1))
    router = make_router("least-request", specs)
    return EndpointPicker(PickerSettings(endpoints=specs, fallbacks=n - 1), router=router)


def _decided(p: EndpointPicker) -> _Stream:
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    s = _Stream(rid=1)
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models")])
    p._handle(
        s, pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=True))
    )
    assert s.decision is not None
    return s


def test_an_unknown_served_endpoint_stops_the_accounting() -> None:
    p = _picker(2)
    s = _decided(p)
    p._charge_served(s, "192.0.2.9:8000")  # not an endpoint of ours
    assert s.route is None and p.in_flight == 0
    p._close(s)
    assert p.in_flight == 0


def test_the_served_primary_changes_nothing() -> None:
    p = _picker(3)
    s = _decided(p)
    before = s.route
    assert before is not None
    p._charge_served(s, before.url.split("://")[1])
    assert s.route is before and p.in_flight == 1
    p._close(s)
    assert p.in_flight == 0


def test_a_served_fallback_moves_the_request() -> None:
    p = _picker(3)
    s = _decided(p)
    d = s.decision
    assert d is not None
    p._charge_served(s, d.routes[2].url.split("://")[1])
    assert s.route == d.routes[2]
    snap = {e["url"]: e for e in p.router.snapshot(0.0)}
    assert snap[d.routes[2].url]["outstanding"] == 1
    assert snap[d.routes[0].url]["outstanding"] == 0
    p._close(s)
    assert p.in_flight == 0 and all(e["outstanding"] == 0 for e in p.router.snapshot(0.0))
