"""The autoscaling signals through a real sidecar against stub engines: the admin /metrics
serves each pool's demand (prefill after the engine's cache, decode), what admission shed,
the predicted TTFT beside the SLO, and the desired-replicas figure (docs/autoscaling.md)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from harness import sidecar_config, url
from prometheus_client.parser import text_string_to_metric_families

from meshd.sidecar import Sidecar


async def scrape(s: Sidecar) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(url(s, "/metrics", "admin")) as r:
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("meshd_pool_"):
            for x in fam.samples:
                out[(x.name, tuple(sorted(x.labels.items())))] = x.value
    return out


def get(m: dict, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted({"pool": "default", **labels}.items())))]


async def complete(http: aiohttp.ClientSession, s: Sidecar, prompt: str, n: int) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n}
    async with http.post(
        url(s, "/v1/completions"),
        data=json.dumps(body),
        headers={"Content-Type": "application/json"},
    ) as r:
        await r.read()
        return r.status


async def test_demand_and_the_figure_on_the_admin_listener(backends, sidecar):
    b = await backends()
    b.chars_per_token = 1.0  # usage.prompt_tokens = the prompt's length
    cfg = sidecar_config(
        [b.url],
        pools=[
            {
                "name": "default",
                "endpoints": [{"url": b.url, "gpu": "H100"}],
                "autoscaling": {"slo_ttft_s": 0.5, "min_replicas": 1, "max_replicas": 10},
            }
        ],
    )
    s = await sidecar(cfg)
    async with aiohttp.ClientSession() as http:
        statuses = await asyncio.gather(*(complete(http, s, "x" * 400, 20) for _ in range(10)))
    assert statuses == [200] * 10
    s.accounting.flush()
    m = await scrape(s)
    prefill = get(m, "meshd_pool_demand_tokens_per_second", phase="prefill")
    decode = get(m, "meshd_pool_demand_tokens_per_second", phase="decode")
    assert prefill > 0 and decode > 0
    # 400 prompt tokens (none cached) for 20 completion tokens, request for request.
    assert prefill / decode == pytest.approx(400 / 20)
    assert get(m, "meshd_pool_slo_ttft_seconds") == 0.5
    assert get(m, "meshd_pool_replicas") == 1
    assert get(m, "meshd_pool_replica_capacity_tokens_per_second", phase="prefill") == (
        pytest.approx(27_712.0)
    )
    assert get(m, "meshd_pool_predicted_ttft_seconds") > 0  # the picker predicted each
    assert 0 < get(m, "meshd_pool_kv_headroom_ratio") <= 1
    assert get(m, "meshd_pool_queue_depth", where="admission") == 0
    assert get(m, "meshd_pool_shed_total") == 0
    assert get(m, "meshd_pool_fallbacks_total") == 0
    assert 1 <= get(m, "meshd_pool_desired_replicas") <= 10
    load = get(m, "meshd_pool_desired_replicas_term", term="load")
    # The load term is the formula's: (prefill / Cp + decode / Cd) / 0.7.
    cd = get(m, "meshd_pool_replica_capacity_tokens_per_second", phase="decode")
    assert load == pytest.approx((prefill / 27_712.0 + decode / cd) / 0.7, rel=1e-6)


async def test_shed_requests_are_counted_and_raise_unmet_demand(backends, sidecar):
    b = await backends()
    cfg = sidecar_config(
        [b.url],
        reliability={"admission": {"max_in_flight": 1, "max_queued": 0}},
    )
    s = await sidecar(cfg)
    async with aiohttp.ClientSession() as http:
        held = asyncio.create_task(complete(http, s, "slow-headers", 3))
        while not b.requests:
            await asyncio.sleep(0.01)
        refused = await asyncio.gather(*(complete(http, s, "y" * 800, 3) for _ in range(3)))
        b.release.set()
        assert await held == 200
    assert refused == [429] * 3
    s.accounting.flush()
    m = await scrape(s)
    assert get(m, "meshd_pool_shed_total") == 3
    assert get(m, "meshd_pool_refused_per_second", kind="shed") > 0
    assert get(m, "meshd_pool_unmet_demand_tokens_per_second", phase="prefill") > 0
    # The board's input the attempts layer calls when it sends a request to a fallback.
    s.observer.demand.fell_back("default", asyncio.get_running_loop().time(), prompt_tokens=100)
    s.autoscale.evaluate(asyncio.get_running_loop().time(), force=True)
    m = await scrape(s)
    assert get(m, "meshd_pool_fallbacks_total") == 1


async def test_a_balancer_pool_has_demand_and_a_figure_but_no_kv_headroom(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], routing={"policy": "round-robin"}))
    async with aiohttp.ClientSession() as http:
        assert await complete(http, s, "x" * 40, 5) == 200
    s.accounting.flush()
    m = await scrape(s)
    assert get(m, "meshd_pool_demand_tokens_per_second", phase="decode") > 0
    assert get(m, "meshd_pool_desired_replicas") >= 1
    assert not any(k[0] == "meshd_pool_kv_headroom_ratio" for k in m)  # unknown, not 100%
