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
