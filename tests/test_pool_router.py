"""PoolRouter: the three policies behind one driver protocol."""

from __future__ import annotations

import aiohttp
import pytest
from harness import sidecar_config, url

from filters.blockhash import block_hashes
from filters.picker import PickRequest
from filters.pool_router import EndpointSpec, make_router

URLS = ["http://e0:1", "http://e1:1", "http://e2:1"]


def _req(prompt: str) -> PickRequest:
    return PickRequest(
        model="m",
        block_hashes=block_hashes(prompt, "m"),
        prompt_tokens=len(prompt) // 4,
        max_tokens=16,
    )


def test_meshd_policy_keeps_a_shared_prefix_on_one_endpoint():
    router = make_router("meshd", [EndpointSpec(u, gpu="H100") for u in URLS])
    system = "You are a careful assistant. " * 200  # ~6 KB shared prefix
    first = router.order(_req(system + "question 0"), 0.0)[0]
    router.started(first, 0, _req(system + "question 0"), 0.0)
    router.finished(first, 0, _req(system + "question 0"), 0.5, ok=True)
    for i in range(1, 6):
        r = router.order(_req(system + f"question {i}"), float(i))[0]
        assert r.url == first.url
        assert r.reason in ("prefix-affinity", "sticky")
        assert r.cached_tokens and r.cached_tokens > 1000
        router.started(r, i, _req(system + f"question {i}"), float(i))
        router.finished(r, i, _req(system + f"question {i}"), i + 0.5, ok=True)


def test_meshd_policy_routes_around_an_endpoint_that_refuses_connections():
    router = make_router("meshd", [EndpointSpec(u, gpu="H100") for u in URLS])
    dead = URLS[0]
    for rid in range(3):
        route = next(r for r in router.order(_req("x" * 200), 0.0) if r.url == dead)
        router.started(route, rid, _req("x" * 200), 0.0)
        router.connect_failed(route, rid, 0.0, "refused")
    orders = [router.order(_req(f"prompt {i} " * 50), 1.0) for i in range(20)]
    assert all(dead not in [r.url for r in o] for o in orders)
    snap = {e["url"]: e for e in router.snapshot(1.0)}
    assert snap[dead]["healthy"] is False and snap[dead]["last_error"] == "refused"


def test_all_ejected_still_yields_every_endpoint_to_try():
    router = make_router("meshd", [EndpointSpec(u) for u in URLS[:2]])
    for rid, u in enumerate(URLS[:2] * 3):
        route = next(r for r in router.order(_req("y" * 100), 0.0) if r.url == u)
        router.started(route, rid, _req("y" * 100), 0.0)
        router.connect_failed(route, rid, 0.0, "refused")
    routes = router.order(_req("y" * 100), 0.1)
    assert sorted(r.url for r in routes) == URLS[:2]
    assert {r.reason for r in routes} == {"no-eligible-endpoint"}


@pytest.mark.parametrize("policy", ["round-robin", "least-request"])
def test_balancer_policies_spread_and_account(policy):
    router = make_router(policy, [EndpointSpec(u) for u in URLS])
    seen = []
    for rid in range(6):
        r = router.order(_req("z"), 0.0)[0]
        router.started(r, rid, _req("z"), 0.0)
        router.finished(r, rid, _req("z"), 0.0, ok=True)
        seen.append(r.url)
    assert sorted(set(seen)) == URLS
    assert all(e["outstanding"] == 0 for e in router.snapshot(0.0))


async def test_sidecar_meshd_policy_gives_prefix_affinity_at_the_backend(backends, sidecar):
    bs = [await backends(f"b{i}") for i in range(3)]
    s = await sidecar(sidecar_config([b.url for b in bs], routing={"policy": "meshd"}))
    system = "Answer in the style of a patient teacher. " * 150
    async with aiohttp.ClientSession() as http:
        for group in range(3):
            for q in range(4):
                body = {"model": "tiny", "prompt": f"{group} " + system + f"q{q}", "max_tokens": 2}
                resp = await http.post(url(s, "/v1/completions"), json=body)
                assert resp.status == 200
    by_group: dict[str, set[str]] = {}
    for b in bs:
        for seen in b.requests:
            by_group.setdefault(seen.body["prompt"][0], set()).add(b.name)
    # Every request of a prefix group went to one backend.
    assert all(len(names) == 1 for names in by_group.values()), by_group
    async with aiohttp.ClientSession() as http, http.get(url(s, "/endpoints", "admin")) as r:
        pool = (await r.json())["pools"]["default"]
    assert sum(e["cached_blocks"] for e in pool) > 0


# -- reports and digests from the control plane -----------------------------------------

from dataclasses import dataclass  # noqa: E402

from filters.endpoint_state import ReportedBlocks, ReportedState  # noqa: E402


@dataclass(frozen=True)
class Digest:
    epoch: str
    seq: int
    base_seq: int
    full: bool
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


@pytest.mark.parametrize("policy", ["meshd", "round-robin", "least-request"])
def test_reported_draining_or_unhealthy_is_kept_out_while_fresh(policy):
    router = make_router(policy, [EndpointSpec(u, gpu="H100") for u in URLS])
    assert router.report(URLS[0], ReportedState(draining=True), 0.0, ttl_s=5.0)
    assert router.report(URLS[1], ReportedState(healthy=False), 0.0, ttl_s=5.0)
    assert not router.report("http://nowhere:1", ReportedState(), 0.0, ttl_s=5.0)
    for i in range(6):
        assert router.order(_req(f"p{i} " * 30), 1.0)[0].url == URLS[2]
    snap = {e["url"]: e for e in router.snapshot(1.0)}
    assert snap[URLS[0]]["ineligible_reason"] == "draining"
    assert snap[URLS[1]]["ineligible_reason"] == "unhealthy"
    # Stale (ttl passed, not renewed): back to what the router observes itself.
    firsts = {router.order(_req(f"q{i} " * 30), 6.0)[0].url for i in range(30)}
    assert URLS[0] in firsts or URLS[1] in firsts
    # Renewed, then gone (resource removed): forgotten at once.
    router.report(URLS[0], ReportedState(draining=True), 6.0, ttl_s=5.0)
    assert all(r.url != URLS[0] for r in router.order(_req("r " * 30), 6.5)[:1])
    router.report(URLS[0], None, 6.6, ttl_s=5.0)
    assert {e["url"]: e for e in router.snapshot(6.7)}[URLS[0]]["reported"] is None


def test_digest_steers_and_its_removal_releases():
    router = make_router("meshd", [EndpointSpec(u, gpu="H100") for u in URLS])
    for u in URLS:
        router.report(u, ReportedState(epoch="x"), 0.0, ttl_s=10.0)
    system = "Shared instructions for the billing agent. " * 60
    req = _req(system + "tail")
    # Where it would go (unrecorded: a request routed there would be cached there too).
    default = router.order(req, 0.0, record=False)[0].url
    target = next(u for u in URLS if u != default)
    hashes = tuple(req.block_hashes[:-1])  # the system prompt's blocks
    assert router.apply_digest(target, Digest("x", 1, 1, True, hashes), 0.0)
    r = router.order(req, 1.0)[0]
    assert r.url == target and r.reason == "prefix-affinity"
    assert r.cached_tokens and r.cached_tokens > 500
    # A cumulative digest on a base this router never saw is ignored.
    assert not router.apply_digest(target, Digest("x", 5, 4, False, (), hashes), 1.0)
    assert router.order(req, 1.5)[0].url == target
    # Removal (cumulative on the right base): the blocks leave the index.
    assert router.apply_digest(target, Digest("x", 2, 1, False, (), hashes), 2.0)
    snap = {e["url"]: e for e in router.snapshot(2.0)}
    assert snap[target]["digest_blocks"] == 0 and snap[target]["cached_blocks"] == 0
    assert router.order(req, 2.5)[0].url == default


def test_digest_of_a_stale_report_leaves_the_index():
    router = make_router("meshd", [EndpointSpec(u, gpu="H100") for u in URLS])
    req = _req("Stale prefix system prompt. " * 60)
    default = router.order(req, 0.0, record=False)[0].url
    target = next(u for u in URLS if u != default)
    router.report(target, ReportedState(epoch="x"), 0.0, ttl_s=2.0)
    router.apply_digest(target, Digest("x", 1, 1, True, tuple(req.block_hashes)), 0.0)
    assert router.order(req, 1.0)[0].url == target
    # No renewal: the report goes stale at 2.0 and the digest stops counting.
    assert router.order(req, 3.0, record=False)[0].url == default
    assert {e["url"]: e for e in router.snapshot(3.0)}[target]["cached_blocks"] == 0
    # Renewed (the control plane is back): it counts again.
    router.report(target, ReportedState(epoch="x"), 4.0, ttl_s=2.0)
    assert router.order(req, 4.5)[0].url == target


def test_balancer_ignores_digests():
    router = make_router("round-robin", [EndpointSpec(u) for u in URLS])
    assert not router.apply_digest(URLS[0], Digest("x", 1, 1, True, (1, 2)), 0.0)


def test_reported_blocks_follow_full_and_cumulative_digests():
    b = ReportedBlocks()
    assert b.apply(Digest("e1", 3, 3, True, (1, 2, 3)), 0.0) == frozenset()
    assert b.prefix_blocks([1, 2, 9, 3]) == 2
    assert b.apply(Digest("e1", 4, 3, False, (4,), (2,)), 1.0) == {2}
    assert b.blocks == {1, 3, 4}
    # Cumulative: relative to the full digest, not to the last one.
    assert b.apply(Digest("e1", 5, 3, False, (5,), ()), 2.0) == {4}
    assert b.blocks == {1, 2, 3, 5}
    assert b.apply(Digest("e1", 2, 2, True, (9,)), 3.0) is None  # an older full digest
    assert b.apply(Digest("e2", 0, 0, False, (7,)), 3.0) is None  # new epoch: wait for full
    assert b.apply(Digest("e2", 0, 0, True, (7,)), 4.0) == {1, 2, 3, 5}
    assert b.blocks == {7} and b.ignored == 2


# -- flags from the reliability filters (filters/guard.py) --------------------------------


def test_meshd_policy_does_not_choose_an_open_or_ejected_endpoint():
    router = make_router("meshd", [EndpointSpec(u, gpu="H100") for u in URLS])
    assert router.set_flags(URLS[0], breaker_open=True, ejected_until=None, now=0.0)
    assert router.set_flags(URLS[1], breaker_open=False, ejected_until=30.0, now=0.0)
    orders = [router.order(_req(f"prompt {i} " * 40), 1.0) for i in range(20)]
    assert all([r.url for r in o] == [URLS[2]] for o in orders)
    snap = {e["url"]: e for e in router.snapshot(1.0)}
    assert snap[URLS[0]]["ineligible_reason"] == "breaker-open"
    assert snap[URLS[1]]["ineligible_reason"] == "ejected"
    # The ejection ends by itself at its time; the breaker when the guard says so.
    assert URLS[1] in [r.url for r in router.order(_req("later " * 40), 30.0)]
    router.set_flags(URLS[0], breaker_open=False, ejected_until=None, ramp=0.1, now=31.0)
    assert {r.url for r in router.order(_req("again " * 40), 31.0)} == set(URLS)
    assert {e["url"]: e["ramp"] for e in router.snapshot(31.0)}[URLS[0]] == 0.1
    assert not router.set_flags("http://unknown:1", breaker_open=True, ejected_until=None, now=0.0)
    with pytest.raises(ValueError):
        router.set_flags(URLS[0], breaker_open=False, ejected_until=None, ramp=0.0, now=0.0)


def test_an_outlier_ejection_ending_leaves_a_connect_failure_rest_in_force():
    router = make_router("meshd", [EndpointSpec(u, gpu="H100") for u in URLS[:2]])
    dead = URLS[0]
    for rid in range(3):  # the picker's own passive health: rests 10 s from t=0
        route = next(r for r in router.order(_req("x" * 200), 0.0) if r.url == dead)
        router.started(route, rid, _req("x" * 200), 0.0)
        router.connect_failed(route, rid, 0.0, "refused")
    router.set_flags(dead, breaker_open=False, ejected_until=5.0, now=0.0)
    router.set_flags(dead, breaker_open=False, ejected_until=None, now=5.0)  # unejected
    assert dead not in [r.url for r in router.order(_req("y" * 200), 6.0)]
    assert dead in [r.url for r in router.order(_req("y" * 200), 10.5)]


@pytest.mark.parametrize("policy", ["round-robin", "least-request"])
def test_balancer_policies_put_open_or_ejected_endpoints_last(policy):
    router = make_router(policy, [EndpointSpec(u) for u in URLS])
    router.set_flags(URLS[0], breaker_open=True, ejected_until=None, now=0.0)
    router.set_flags(URLS[1], breaker_open=False, ejected_until=10.0, now=0.0)
    for _ in range(6):
        routes = router.order(_req("z"), 1.0)
        assert routes[0].url == URLS[2]
        assert {r.url: r.reason for r in routes[1:]} == {
            URLS[0]: "breaker-open",
            URLS[1]: "ejected",
        }
    assert router.order(_req("z"), 10.0)[-1].url == URLS[0]  # the ejection has ended
    router.set_flags(URLS[0], breaker_open=False, ejected_until=None, now=11.0)
    firsts = {router.order(_req("z"), 11.0)[0].url for _ in range(6)}
    assert firsts == set(URLS)
    snap = {e["url"]: e for e in router.snapshot(11.0)}
    assert all(e["healthy"] for e in snap.values())


def test_least_request_gives_a_ramping_endpoint_less_weight():
    router = make_router("least-request", [EndpointSpec(u) for u in URLS[:2]])
    ramping, other = URLS[:2]
    router.set_flags(ramping, breaker_open=False, ejected_until=None, ramp=0.25, now=0.0)
    for rid in range(10):  # 10 requests in flight, none finishing
        r = router.order(_req("w"), 0.0)[0]
        router.started(r, rid, _req("w"), 0.0)
    loads = {e["url"]: e["outstanding"] for e in router.snapshot(0.0)}
    # outstanding / (weight x ramp) balanced: 2 on the ramping one, 8 on the other.
    assert loads == {ramping: 2, other: 8}
