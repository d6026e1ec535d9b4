"""SGLang's prefill/decode protocol in the engine simulator (loadtest/engine/kv_transfer.py):
the same request, with bootstrap_host/port/room, to a prefill and a decode engine at once;
the decode leg waits (bounded) for the room's KV, pays the transfer, and is refused when it
never comes; the prefill leg answers once its KV was fetched. Over HTTP, fast clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from loadtest.engine import EngineFleet, EngineSpec, mixed_fleet
from loadtest.engine.config import ConfigError, fleet_from_dict
from loadtest.engine.kv_transfer import FETCH_FAILED_STATUS, FETCH_FAILED_TYPE, room_key
from loadtest.engine.profiles import get_profile
from loadtest.engine.server import SimEngine

FAST = 200.0  # simulated seconds per wall second
PROMPT = " ".join(f"word{i}" for i in range(300))
KV_BYTES = get_profile("H100").kv_bytes_per_token


@pytest.fixture
async def pd() -> AsyncIterator[EngineFleet]:
    """SGLang engines: a prefill, a decode (waits 20 simulated s for a room's KV) and an
    aggregated one."""
    base = EngineSpec(time_scale=FAST, pd_protocol="sglang", bootstrap_timeout_s=20.0)
    fleet = EngineFleet(mixed_fleet(3, ["H100"], base=base, roles=["prefill", "decode", "both"]))
    await fleet.start()
    yield fleet
    await fleet.stop()


def request(room: int, p: SimEngine, **kw: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **kw}
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": room}  # fmt: skip


async def post(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int, str]:
    async with s.post(f"{url}{path}", json=body) as resp:
        return resp.status, await resp.text()


def sse_text(raw: str) -> str:
    out = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            doc = json.loads(line[6:])
            out.extend(c.get("text") or c.get("delta", {}).get("content") or ""
                       for c in doc["choices"])  # fmt: skip
    return "".join(out)


async def test_both_legs_at_once_give_the_aggregated_text(pd: EngineFleet) -> None:
    p, d, agg = pd
    body = request(1, p)
    async with aiohttp.ClientSession() as s:
        status, whole = await post(s, agg.url, body)  # role both: the fields are ignored
        assert status == 200
        (ps, pre), (ds, dec) = await asyncio.gather(post(s, p.url, body), post(s, d.url, body))
    assert ps == ds == 200
    prefill, decode, agg_doc = json.loads(pre), json.loads(dec), json.loads(whole)
    assert prefill["usage"]["completion_tokens"] == 1  # whatever max_tokens said
    assert decode["choices"][0]["text"] == agg_doc["choices"][0]["text"]
    prompt = agg_doc["usage"]["prompt_tokens"]
    # The prompt's KV came from the prefill engine: cached but its last token.
    assert decode["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert d.core.stats.kv_transfer_bytes == prompt * KV_BYTES
    assert p.core.num_held_requests == 0 and p.core.stats.kv_holds_fetched == 1


async def test_streamed_legs_and_a_decode_leg_that_comes_first(pd: EngineFleet) -> None:
    p, d, agg = pd
    body = request(2, p, stream=True, stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as s:
        _, whole = await post(s, agg.url, body)
        decode = asyncio.ensure_future(post(s, d.url, body))
        key = room_key(2)
        for _ in range(1000):  # until the decode leg waits for the room's KV
            if d.fabric.watched(p.replica.kv_engine_id, key):
                break
            await asyncio.sleep(0.001)
        assert not decode.done() and d.fabric.watched(p.replica.kv_engine_id, key)
        ps, pre = await post(s, p.url, body)
        ds, dec = await decode
    assert ps == ds == 200
    assert sse_text(dec) == sse_text(whole) != ""
    # The prefill leg's answer, streamed: its one token, its usage, then [DONE].
    assert pre.endswith("data: [DONE]\n\n") and '"completion_tokens":1' in pre


async def test_a_chat_prefill_leg_streams_one_sse_body(pd: EngineFleet) -> None:
    p, d, _ = pd
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "stream": True,
            "bootstrap_host": "localhost", "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": [77]}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        (ps, pre), (ds, dec) = await asyncio.gather(
            post(s, p.url, body, "/v1/chat/completions"),
            post(s, d.url, body, "/v1/chat/completions"),
        )
    assert ps == ds == 200
    assert pre.startswith("data: ") and '"role":"assistant"' in pre
    assert len(sse_text(dec).split()) == 5


async def test_a_room_whose_kv_never_comes_is_refused(pd: EngineFleet) -> None:
    p, d, _ = pd
    async with aiohttp.ClientSession() as s:
        status, raw = await post(s, d.url, request(3, p, stream=True))
        assert status == FETCH_FAILED_STATUS
        err = json.loads(raw)["error"]
        assert err["type"] == FETCH_FAILED_TYPE and err["param"] == "bootstrap_room"
        assert err["message"].startswith("KV transfer failed (timeout)")
        assert "bootstrap_room 3" in err["message"]
        # No prefill engine at the named address: refused at once.
        status, raw = await post(s, d.url, {**request(4, p), "bootstrap_port": 1})
        assert status == FETCH_FAILED_STATUS
        assert json.loads(raw)["error"]["message"].startswith("KV transfer failed (unknown_engine)")
    assert d.core.stats.kv_fetch_refused["timeout"] == 1
    assert d.core.stats.kv_fetch_refused["unknown_engine"] == 1


async def test_a_prefill_leg_nobody_fetches_fails_after_the_hold() -> None:
    spec = EngineSpec(time_scale=FAST, pd_protocol="sglang", role="prefill", kv_hold_s=10.0)
    async with EngineFleet([spec]) as fleet:
        (p,) = fleet
        async with aiohttp.ClientSession() as s:
            status, raw = await post(s, p.url, request(5, p))
    assert status == 500
    assert "Prefill transfer failed for bootstrap_room 5" in raw and "kv_hold_s" in raw
    assert p.core.num_held_requests == 0 and p.core.stats.kv_holds_expired == 1


async def test_sglang_legs_need_a_room_and_no_kv_transfer_params(pd: EngineFleet) -> None:
    p, d, agg = pd
    bare = {"prompt": PROMPT, "max_tokens": 3}
    async with aiohttp.ClientSession() as s:
        for e in (p, d):
            status, raw = await post(s, e.url, bare)
            assert status == 400
            assert "without bootstrap room id" in raw
        nixl = {**request(6, p), "kv_transfer_params": {"do_remote_decode": True}}
        status, raw = await post(s, p.url, nixl)
        assert status == 400 and "SGLang's protocol" in raw
        for room in (-1, 1 << 63, "7", True):
            status, raw = await post(s, d.url, {**request(8, p), "bootstrap_room": room})
            assert status == 400, room
        status, _ = await post(s, agg.url, bare)
        assert status == 200
        async with s.get(f"{p.url}/get_server_info") as resp:
            info = await resp.json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == p.port  # none set: the HTTP port


def test_fleet_files_take_the_protocol() -> None:
    cfg = fleet_from_dict(
        {
            "engines": [
                {
                    "role": "prefill",
                    "pd_protocol": "sglang",
                    "bootstrap_port": 9000,
                    "count": 2,
                    "bootstrap_timeout_s": 30,
                }
            ]
        }
    )
    assert [e.bootstrap_port for e in cfg.engines] == [9000, 9001]
    assert cfg.engines[0].bootstrap_timeout_s == 30
    for bad, key in [
        ({"pd_protocol": "mooncake"}, "pd_protocol"),
        ({"bootstrap_port": 70000}, "bootstrap_port"),
        ({"bootstrap_timeout_s": 0}, "bootstrap_timeout_s"),
    ]:
        with pytest.raises(ConfigError, match=rf"engines\[0\]\.{key}"):
            fleet_from_dict({"engines": [bad]})
