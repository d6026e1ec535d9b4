"""Model fallback through a real sidecar (meshd/fallback.py): a pool that cannot serve a
request sends it down its chain with the model rewritten, says so in the response, the
access log and the metrics; a cost cap sends it to the cheaper pool before any attempt;
and fallbacks after failed attempts share the retry budget, so a dead pool's traffic can
never become a storm on the next one."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from backends import TestBackend as Backend
from backends import sse_events
from harness import sidecar_config, url

from meshd.access_log import read_access_log
from meshd.sidecar import Sidecar


def dead_url() -> str:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def chained(
    big_urls: list[str], small_urls: list[str], tmp_path: Path | None = None, **extra: Any
) -> Any:
    pools = [
        {
            "name": "big",
            "models": ["big-*"],
            "endpoints": big_urls,
            "fallbacks": [{"pool": "small", "model": "small-8b"}],
            **extra.pop("big_pool", {}),
        },
        {"name": "small", "models": ["small-*"], "endpoints": small_urls},
    ]
    sections: dict[str, Any] = {"pools": pools, **extra}
    if tmp_path is not None:
        sections["telemetry"] = {"access_log": {"path": str(tmp_path / "access.jsonl")}}
    return sidecar_config(big_urls, **sections)


def ask(model: str = "big-70b", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        **extra,
    }


def count(s: Sidecar, name: str, **labels: str) -> float:
    return s.metrics.registry.get_sample_value(name, labels) or 0.0


async def post(
    http: aiohttp.ClientSession, s: Sidecar, body: dict[str, Any], **headers: str
) -> tuple[int, bytes, Any]:
    async with http.post(url(s, "/v1/chat/completions"), json=body, headers=headers) as r:
        return r.status, await r.read(), r.headers


async def test_a_dead_pool_falls_back_with_the_model_rewritten(
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    small = await backends("small")
    s = await sidecar(chained([dead_url()], [small.url], tmp_path))
    async with aiohttp.ClientSession() as http:
        status, raw, headers = await post(http, s, ask())
        _, streamed, sh = await post(http, s, ask(stream=True))
    assert status == 200 and json.loads(raw)["model"] == "small-8b"
    assert headers["x-meshd-fallback"] == "small; from=big; reason=upstream_unavailable"
    assert sh["x-meshd-fallback"].startswith("small; from=big")
    assert sse_events(streamed)[-1] == "[DONE]"
    assert [r.body["model"] for r in small.requests if r.body] == ["small-8b", "small-8b"]
    why = {"pool": "big", "to": "small", "reason": "upstream_unavailable"}
    assert count(s, "meshd_fallbacks_total", **why) == 2
    s.accounting.flush()
    await s.observer.aclose()
    records = list(read_access_log(tmp_path / "access.jsonl"))
    assert {(r.pool, r.fallback_from, r.fallback_reason, r.outcome) for r in records} == {
        ("small", "big", "upstream_unavailable", "ok")
    }
    assert all(r.attempts[0].outcome == "connect_error" for r in records)


async def test_the_last_pool_of_the_chain_answers_as_a_pool_without_fallbacks(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    s = await sidecar(chained([dead_url()], [dead_url()]))
    async with aiohttp.ClientSession() as http:
        status, raw, _ = await post(http, s, ask())
    doc = json.loads(raw)
    assert status == 502 and doc["error"]["code"] == "upstream_unavailable"
    assert "pool 'small'" in doc["error"]["message"]
    s.accounting.flush()
    ended = {"kind": "chat", "pool": "small", "outcome": "upstream_unavailable"}
    assert count(s, "meshd_requests_total", **ended) == 1  # counted once, where it ended
    assert count(s, "meshd_rejected_requests_total", reason="upstream_unavailable") == 1


async def test_a_cost_cap_sends_the_request_to_the_cheaper_pool_before_any_attempt(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    big, small = await backends("big"), await backends("small")
    cfg = chained([big.url], [small.url], big_pool={"max_cost_usd": 1e-12})
    s = await sidecar(cfg)
    async with aiohttp.ClientSession() as http:
        capped = [await post(http, s, ask()) for _ in range(3)]
        # A trusted client's header wins over the pool's cap; a malformed one is a 400.
        roomy = await post(http, s, ask(), **{"x-meshd-max-cost-usd": "5"})
        bad = await post(http, s, ask(), **{"x-meshd-max-cost-usd": "cheap"})
    assert all(c[0] == 200 and "reason=over_cost_cap" in c[2]["x-meshd-fallback"] for c in capped)
    assert roomy[0] == 200 and "x-meshd-fallback" not in roomy[2]
    assert bad[0] == 400 and b"x-meshd-max-cost-usd" in bad[1]
    assert len(big.requests) == 1 and len(small.requests) == 3  # no attempt on big first
    assert count(s, "meshd_retry_budget_exhausted_total", pool="big") == 0


async def test_fallbacks_after_failed_attempts_share_the_retry_budget(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    big, small = await backends("big"), await backends("small")
    big.refuse_with = 503  # the pool's engine sheds everything
    budget = {"ratio": 0.0, "min_retries_per_s": 0.5, "window_s": 10}  # five tokens
    cfg = chained([big.url], [small.url], reliability={"retry": budget})
    s = await sidecar(cfg)
    n = 40
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(*(post(http, s, ask()) for _ in range(n)))
    moved = [h["x-meshd-fallback"] for st, _, h in answers if "x-meshd-fallback" in h]
    # All 40 reach the engine at once and are shed: five move on (the budget's tokens),
    # the rest are refused; none costs the fallback pool a request beyond the budget.
    assert sorted({st for st, _, _ in answers}) == [200, 502]
    assert len(moved) == 5 and all("reason=upstream_unavailable" in m for m in moved)
    assert len(small.requests) == 5 and len(big.requests) == n
    assert count(s, "meshd_retry_budget_exhausted_total", pool="big") == n - 5
    # Once the breaker opens on the 503s, the pool has no endpoint to try: a request then
    # moves without costing any engine a second request, so it takes no token.
    async with aiohttp.ClientSession() as http:
        later = [await post(http, s, ask()) for _ in range(10)]
    assert all(st == 200 for st, _, _ in later)
    assert len(big.requests) + len(small.requests) <= 2 * n  # one engine request each, at most


async def test_an_engine_that_timed_out_is_not_moved(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    big, small = await backends("big"), await backends("small")
    cfg = chained([big.url], [small.url], upstream={"first_byte_timeout_s": 0.2})
    s = await sidecar(cfg)
    body = {**ask(), "messages": [{"role": "user", "content": "slow-headers"}]}
    async with aiohttp.ClientSession() as http:
        status, raw, _ = await post(http, s, body)
    big.release.set()
    assert status == 504 and json.loads(raw)["error"]["code"] == "upstream_timeout"
    assert small.requests == []
