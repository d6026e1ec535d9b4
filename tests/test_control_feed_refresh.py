"""The control feed's refresh (meshd/control_feed.py) renews the reports the routers hold
without sending the picker's views of their endpoints to be rebuilt: a report renewed
unchanged while fresh moves only its freshness (filters/pool_router.py PickerRouter.report),
and the picker routes as if it had been told the report anew. No network: the feed's
subscriber applies serialized responses as gRPC hands them over."""

from __future__ import annotations

import dataclasses

import pytest
from envoy.service.discovery.v3 import discovery_pb2 as pb
from harness import sidecar_config

import xds  # noqa: F401  (xds-protos' own `xds` package importable: xds/__init__.py)
import xds.delta_response as delta_response
from filters.blockhash import block_hashes
from filters.picker import PickRequest
from filters.pool_router import PickerRouter, PoolRouter
from meshd.control_feed import ControlFeed
from meshd.metrics import DataPlaneMetrics
from meshd.pools import build_routers
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState

ADDRESSES = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
TTL_S = 4.0
CONFIG = sidecar_config(
    [],
    pools=[
        {
            "name": "p",
            "endpoints": [
                {"url": f"http://{a}", "engine": f"e{i}", "gpu": "H100"}
                for i, a in enumerate(ADDRESSES)
            ],
        }
    ],
    control_plane={"addresses": ["127.0.0.1:1"], "stale_after_s": TTL_S},
)
REQ = PickRequest(
    model="m", block_hashes=block_hashes("x" * 400, "m"), prompt_tokens=100, max_tokens=16
)


def response(nonce: int, running: dict[int, int]) -> bytes:
    """A response carrying engine i's state with `running[i]` requests running."""
    m = pb.DeltaDiscoveryResponse(type_url=ENDPOINT_STATE_TYPE, nonce=str(nonce))
    for i, n in running.items():
        r = m.resources.add(name=f"e{i}", version=f"{nonce}")
        r.resource.type_url = ENDPOINT_STATE_TYPE
        r.resource.value = EndpointState(
            address=ADDRESSES[i], pool="p", model="m", gpu="H100", requests_running=n
        ).encode()
    return m.SerializeToString()


def routed(router: PoolRouter, now: float) -> list[tuple[str, str, float | None]]:
    return [(r.url, r.reason, r.predicted_ttft_s) for r in router.order(REQ, now, record=False)]


def test_a_refresh_leaves_the_pickers_views_valid() -> None:
    clock = [0.0]
    feed = ControlFeed(CONFIG, build_routers(CONFIG), DataPlaneMetrics(), clock=lambda: clock[0])
    feed.subscriber._apply(response(1, {0: 3, 1: 0, 2: 7}))
    router = feed.routers["p"]
    assert isinstance(router, PickerRouter)
    routed(router, 0.5)
    views = [s._pick_view for s in router.states]
    versions = [(s.version, s.static_version) for s in router.states]
    kv_version = router.kv_version
    assert all(v is not None for v in views)

    feed.refresh(1.0, {0})
    assert all(s._pick_view is v for s, v in zip(router.states, views, strict=True))
    assert [(s.version, s.static_version) for s in router.states] == versions
    assert router.kv_version == kv_version
    # Renewed: fresh past the first report's staleness (4.0), until 1.0 + TTL_S.
    assert all(s.fresh_report(4.5) is not None for s in router.states)
    assert all(s.fresh_report(5.0) is None for s in router.states)

    # It routes as a router told the same reports anew (equal states, new objects) at 1.0,
    # before and after the old staleness passed (the kept views rebuilt then).
    anew = build_routers(CONFIG)["p"]
    for s in router.states:
        assert s.reported is not None
        anew.report(s.url, dataclasses.replace(s.reported), 0.0, ttl_s=TTL_S)
        anew.report(s.url, dataclasses.replace(s.reported), 1.0, ttl_s=TTL_S)
    for now in (1.5, 4.5):
        assert routed(router, now) == routed(anew, now)

    # A report that changed does send its endpoint's view to be rebuilt; the others stay.
    views = [s._pick_view for s in router.states]
    clock[0] = 4.6
    feed.subscriber._apply(response(2, {0: 5}))
    assert router.states[0]._pick_view is None
    assert all(s._pick_view is v for s, v in zip(router.states[1:], views[1:], strict=True))


def test_a_report_renewed_once_stale_or_with_another_ttl_is_stored_anew() -> None:
    router = build_routers(CONFIG)["p"]
    assert isinstance(router, PickerRouter)
    s = router.states[0]
    state = EndpointState(address=ADDRESSES[0], requests_running=2).to_reported()
    router.report(s.url, state, 0.0, ttl_s=TTL_S)
    routed(router, 0.1)
    assert s._pick_view is not None
    router.report(s.url, state, TTL_S + 0.5, ttl_s=TTL_S)  # stale by then: fresh again
    assert s._pick_view is None and s.reported_at == TTL_S + 0.5
    routed(router, TTL_S + 0.6)
    assert s._pick_view is not None
    router.report(s.url, state, TTL_S + 0.7, ttl_s=2 * TTL_S)  # another TTL
    assert s._pick_view is None and s.report_ttl_s == 2 * TTL_S


@pytest.mark.skipif(delta_response.IMPLEMENTATION != "cython", reason=delta_response.IMPLEMENTATION)
def test_an_engine_pushed_again_unchanged_leaves_its_view_valid() -> None:
    """The compiled reader gives an unchanged report as the one held (xds/engine_report.py):
    the router renews it as the refresh does, and the view stays."""
    feed = ControlFeed(CONFIG, build_routers(CONFIG), DataPlaneMetrics(), clock=lambda: 0.0)
    feed.subscriber._apply(response(1, {0: 3, 1: 0, 2: 7}))
    router = feed.routers["p"]
    assert isinstance(router, PickerRouter)
    routed(router, 0.5)
    views = [s._pick_view for s in router.states]
    feed.subscriber._apply(response(2, {0: 3, 1: 0, 2: 7}))  # new versions, same states
    assert all(s._pick_view is v for s, v in zip(router.states, views, strict=True))
