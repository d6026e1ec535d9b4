"""The reliability filters steer the sidecar's picker (filters/guard.py flags through
PoolRouter.set_flags): an ejected endpoint is not chosen at all, not chosen and then
screened out, and an endpoint back from ejection ramps up (slow start)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from harness import sidecar_config, url

from filters.endpoint_state import ReportedState
from meshd.sidecar import Sidecar

POOL = "default"


def _prompt(i: int) -> str:
    return f"{i:04d} " + "x" * 80  # a first text block of its own


async def _complete(http: aiohttp.ClientSession, s: Sidecar, prompt: str) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": True}
    async with http.post(
        url(s, "/v1/completions"),
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    ) as resp:
        await resp.read()
        return resp.status


async def _endpoint(http: aiohttp.ClientSession, s: Sidecar, target: str) -> dict[str, Any]:
    async with http.get(url(s, "/endpoints", "admin")) as resp:
        doc = await resp.json()
    by_url: dict[str, dict[str, Any]] = {e["url"]: e for e in doc["pools"][POOL]}
    return by_url[target]


async def _until(
    http: aiohttp.ClientSession,
    s: Sidecar,
    target: str,
    ok: Callable[[dict[str, Any]], bool],
    timeout_s: float = 8.0,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        e = await _endpoint(http, s, target)
        if ok(e):
            return e
        assert loop.time() < deadline, f"endpoint view never matched: {e}"
        await asyncio.sleep(0.05)


def _screened_out(s: Sidecar, reason: str) -> float:
    value: float = s.metrics.breaker_rejections.labels(POOL, reason)._value.get()
    return value


async def test_an_ejected_endpoint_is_not_picked_and_ramps_when_it_recovers(backends, sidecar):
    bad, *good = [await backends(f"b{i}") for i in range(3)]
    bad.refuse_with = 500  # broken, not busy: the outlier detector's business
    s = await sidecar(
        sidecar_config(
            [bad.url, *(b.url for b in good)],
            routing={"policy": "meshd"},
            reliability={
                "outlier": {
                    "consecutive_5xx": 2,
                    "base_ejection_time_s": 1.0,
                    "max_ejection_percent": 50.0,
                },
                "breaker": {"consecutive_failures": 50},  # leave it to the ejection
            },
        )
    )
    router = s.routers[POOL]
    async with aiohttp.ClientSession() as http:
        # The control plane says the good ones drain for a moment, so the first requests
        # go to the bad one (the picker's choice is otherwise up to its hashing).
        for b in good:
            router.report(b.url, ReportedState(draining=True), time.monotonic(), ttl_s=60.0)
        assert [await _complete(http, s, _prompt(i)) for i in range(2)] == [500, 500]
        for b in good:
            router.report(b.url, None, time.monotonic(), ttl_s=60.0)
        assert len(bad.requests) == 2
        # Published to the router by the pump that followed the request: no tick needed.
        view = await _endpoint(http, s, bad.url)
        assert view["ineligible_reason"] == "ejected" and view["healthy"] is False

        before = len(bad.requests)
        skipped = _screened_out(s, "ejected")
        statuses = [await _complete(http, s, _prompt(100 + i)) for i in range(20)]
        assert statuses == [200] * 20
        assert len(bad.requests) == before
        # Not picked and then screened out: the picker never proposed it.
        assert _screened_out(s, "ejected") == skipped

        bad.refuse_with = None  # repaired; the ejection ends after base_ejection_time_s
        back = await _until(http, s, bad.url, lambda e: e["ineligible_reason"] is None)
        # Slow start: back at the ramp's floor (10% of its weight for the first 6 s of the
        # default 60 s window; the ramp's course is tests/test_guard.py's business).
        assert back["ramp"] == 0.1 and back["healthy"] is True
        # Eligible again: with the others draining it is the one that serves.
        for b in good:
            router.report(b.url, ReportedState(draining=True), time.monotonic(), ttl_s=60.0)
        assert await _complete(http, s, _prompt(200)) == 200
        assert len(bad.requests) == before + 1
