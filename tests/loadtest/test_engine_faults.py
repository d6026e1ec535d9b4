"""Each injectable fault of the engine simulator, through its admin API and its config."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from loadtest.engine import EngineSpec, FaultError, FaultSpec, parse_fault


async def admin(url: str, fault: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/fault", json=fault) as r:
        assert r.status == 200, await r.text()
        doc: dict[str, Any] = await r.json()
        return doc


async def state(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/state") as r:
        doc: dict[str, Any] = await r.json()
        return doc


async def stream_lines(session: aiohttp.ClientSession, url: str, max_tokens: int) -> list[bytes]:
    """The SSE data lines of one streamed completion, until the stream ends or breaks."""
    lines: list[bytes] = []
    async with session.post(
        url + "/v1/completions",
        json={"prompt": "tell me", "max_tokens": max_tokens, "stream": True},
    ) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: "):
                lines.append(line)
    return lines


async def test_crash_after_tokens_resets_the_stream_mid_way(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    url = f.urls[0]
    await admin(url, {"kind": "crash_after_tokens", "tokens": 4, "count": 1})
    got: list[bytes] = []
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(
                url + "/v1/completions",
                json={"prompt": "tell me", "max_tokens": 20, "stream": True},
            ) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        got.append(line)
        assert len(got) == 4 and all(b'"finish_reason":null' in g for g in got)
        # count 1: the next stream is whole.
        lines = await stream_lines(s, url, 20)
        assert len(lines) == 21 and lines[-1] == b"data: [DONE]\n"
    assert (await state(url))["faults"] == []


async def test_crash_without_streaming_drops_the_connection(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    url = f.urls[0]
    await admin(url, {"kind": "crash_after_tokens", "tokens": 2, "count": -1})
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # count -1: every request
            with pytest.raises(aiohttp.ServerDisconnectedError):
                async with s.post(
                    url + "/v1/completions", json={"prompt": "x", "max_tokens": 10}
                ) as r:
                    await r.read()
    assert f[0].core.num_running == 0  # the crashed requests were aborted
    async with aiohttp.ClientSession() as s, s.delete(url + "/admin/fault") as r:
        assert r.status == 200
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 10}) as r,
    ):
        assert r.status == 200


@pytest.mark.parametrize(("status", "retry_after"), [(503, None), (429, 2)])
async def test_status_burst(fleet: Any, status: int, retry_after: int | None) -> None:
    f = await fleet(EngineSpec())
    url = f.urls[0]
    fault: dict[str, Any] = {"kind": "status_burst", "status": status, "count": 3}
    if retry_after is not None:
        fault["retry_after"] = retry_after
    await admin(url, fault)
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(
                url + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
            ) as r:
                statuses.append(r.status)
                if r.status != 200:
                    body = await r.json()
                    assert body["error"]["code"] == status
                    assert r.headers.get("Retry-After") == (
                        None if retry_after is None else str(retry_after)
                    )
        async with s.get(url + "/health") as r:  # only generation requests are rejected
            assert r.status == 200
    assert statuses == [status] * 3 + [200]


async def test_slowdown_stretches_simulated_latency(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    engine = f[0]
    body = {"prompt": "a b c d", "max_tokens": 16}
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/v1/completions", json=body) as r:
            assert r.status == 200
        normal = engine.core.stats.e2e.sum
        await admin(engine.url, {"kind": "slowdown", "factor": 5})
        assert (await state(engine.url))["slowdown"] == 5
        async with s.post(engine.url + "/v1/completions", json=body) as r:
            assert r.status == 200
        slow = engine.core.stats.e2e.sum - normal
    assert slow == pytest.approx(5 * normal, rel=0.05)


async def test_hang_freezes_streams_until_cleared(fleet: Any) -> None:
    # Slow enough (400 tokens = 0.3 s) that the hang lands mid-stream.
    f = await fleet(EngineSpec(), time_scale=10.0)
    engine = f[0]
    async with aiohttp.ClientSession() as s:
        async with s.post(
            engine.url + "/v1/completions", json={"prompt": "x", "max_tokens": 400, "stream": True}
        ) as r:
            first = await r.content.readline()
            assert first.startswith(b"data: ")
            engine.inject(parse_fault({"kind": "hang"}))
            st = await state(engine.url)
            assert st["paused"] and st["running"] == 1
            assert engine.core.next_event_time() is None  # nothing will ever happen
            frozen_at = engine.core.requests()[0].num_output_tokens
            assert frozen_at < 400
            async with s.delete(engine.url + "/admin/fault") as d:
                assert d.status == 200
            rest = [line async for line in r.content if line.startswith(b"data: ")]
        assert rest[-1] == b"data: [DONE]\n" and len(rest) == 400
        # A timed hang ends by itself and shows in the simulated latency. The request
        # arrives some (simulated) time after the hang began, more on a busy machine: it
        # cannot finish before the hang ends, and most of the hang is in its latency.
        before = engine.core.stats.e2e.sum
        hang_not_before = engine.sim_now()
        await admin(engine.url, {"kind": "hang", "seconds": 3})
        async with s.post(
            engine.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}
        ) as r:
            assert r.status == 200
        assert engine.sim_now() - hang_not_before >= 3.0
        assert engine.core.stats.e2e.sum - before >= 2.0


async def test_restart_resets_streams_and_clears_the_cache(fleet: Any) -> None:
    f = await fleet(EngineSpec(), time_scale=10.0)
    engine = f[0]
    prompt = " ".join(f"w{i}" for i in range(64))
    async with aiohttp.ClientSession() as s:
        async with s.post(
            engine.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}
        ) as r:
            assert r.status == 200
        assert (await state(engine.url))["cached_blocks"] > 0
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(
                engine.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 500, "stream": True},
            ) as r:
                await r.content.readline()
                engine.inject(parse_fault({"kind": "restart"}))
                async for _ in r.content:
                    pass
    st = await state(engine.url)
    assert st["cached_blocks"] == 0 and st["running"] == 0
    assert engine.core.stats.generation_tokens == 0
    async with (
        aiohttp.ClientSession() as s,
        s.post(engine.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as r,
    ):
        assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_cold_start_refuses_connections_until_loaded(fleet: Any) -> None:
    f = await fleet(EngineSpec(cold_start_s=100.0))  # 100 simulated s = 0.5 s at FAST
    engine = f[0]
    assert not engine.ready.is_set()
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectorError):
            async with s.get(engine.url + "/health"):
                pass
        await asyncio.wait_for(engine.wait_ready(), 10)
        async with s.get(engine.url + "/health") as r:
            assert r.status == 200
        # A restart with a loading delay refuses again, then comes back on the same port.
        port = engine.port
        await admin(engine.url, {"kind": "restart", "cold_start_seconds": 100})
        assert not engine.ready.is_set()
        await asyncio.wait_for(engine.wait_ready(), 10)
        assert engine.port == port
        async with s.get(engine.url + "/health") as r:
            assert r.status == 200


async def test_cold_start_unavailable_answers_503(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    engine = f[0]
    await admin(engine.url, {"kind": "cold_start", "seconds": 100, "mode": "unavailable"})
    async with aiohttp.ClientSession() as s:
        async with s.get(engine.url + "/health") as r:
            assert r.status == 503
        async with s.post(engine.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 503
            assert (await r.json())["error"]["type"] == "ServiceUnavailableError"
        await asyncio.wait_for(engine.wait_ready(), 10)
        async with s.get(engine.url + "/health") as r:
            assert r.status == 200


async def test_faults_from_config_apply_at_their_time(fleet: Any) -> None:
    f = await fleet(
        EngineSpec(
            faults=(
                FaultSpec("slowdown", factor=3.0),
                FaultSpec("status_burst", status=500, count=1, at=0.0),
            )
        )
    )
    engine = f[0]
    assert engine.core.slowdown == 3.0
    for _ in range(3):  # call_later(0) runs on a following loop iteration
        await asyncio.sleep(0)
    async with (
        aiohttp.ClientSession() as s,
        s.post(engine.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as r,
    ):
        assert r.status == 500


def test_fault_parsing_names_the_bad_field() -> None:
    assert parse_fault({"kind": "restart"}).seconds == 0.0
    assert parse_fault({"kind": "crash_after_tokens", "tokens": 5}).count == 1
    for bad, field in [
        ({"kind": "explode"}, "kind"),
        ({"kind": "crash_after_tokens"}, "tokens"),
        ({"kind": "status_burst", "status": 200}, "status"),
        ({"kind": "slowdown"}, "factor"),
        ({"kind": "slowdown", "factor": -1}, "factor"),
        ({"kind": "cold_start"}, "seconds"),
        ({"kind": "hang", "count": 0}, "count"),
        ({"kind": "restart", "mode": "sideways"}, "mode"),
        ([1], "object"),
    ]:
        with pytest.raises(FaultError, match=field):
            parse_fault(bad)


async def test_admin_rejects_a_bad_fault(fleet: Any) -> None:
    f = await fleet(EngineSpec())
    async with (
        aiohttp.ClientSession() as s,
        s.post(f.urls[0] + "/admin/fault", json={"kind": "nope"}) as r,
    ):
        assert r.status == 400
        assert "kind" in (await r.json())["error"]["message"]
