"""SGLang's prefill/decode protocol through a real sidecar (meshd/disagg.py, protocol
`sglang`) against simulated SGLang engines (loadtest/engine, pd_protocol sglang): the body
rewrite (filters/disagg.py bootstrap_body, property-tested), both legs at once, streamed and
not, and each failure path: a prefill leg that fails (retried, both legs, on another prefill
engine; the decode engine not blamed), no prefill engine left, a decode leg refused before
its first byte (a new pair, a fresh room), a room whose KV never comes, a decode engine
that dies mid-stream (resumed as a pair); and the config's checks."""

from __future__ import annotations

import json
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import sidecar_config, url
from hypothesis import given
from hypothesis import strategies as st

from filters.disagg import (
    BOOTSTRAP_FIELDS,
    MAX_ROOM,
    aggregated_body,
    bootstrap_batch,
    bootstrap_body,
    decide_split,
    leg_answer,
)
from loadtest.engine import EngineSpec
from loadtest.engine.faults import FaultSpec
from loadtest.engine.server import SimEngine
from meshd.access_log import AccessRecord, read_access_log
from meshd.config import ConfigError, load_config
from meshd.disagg import bootstrap_host
from meshd.sidecar import Sidecar

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROMPT = " ".join(f"word{i}" for i in range(300))
FAST = 200.0

# ---- the body (filters/disagg.py) ---------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
bodies = st.dictionaries(st.text(max_size=12), json_values, max_size=8) | st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text() | st.lists(st.text(), max_size=3) | st.lists(st.integers(0, 9)),
        "messages": st.just([{"role": "user", "content": "hi"}]),
        "n": st.integers(-2, 4),
        "text": st.text() | st.lists(st.text(), max_size=3),
        "input_ids": st.lists(st.integers(0, 9), min_size=1)
        | st.lists(st.lists(st.integers(0, 9), min_size=1), min_size=1, max_size=3),
        "bootstrap_room": json_values,
        "stream": st.booleans(),
    },
)


@given(bodies, st.sampled_from(["127.0.0.1", "[::1]", "prefill-0.svc"]),
       st.none() | st.integers(1, 65535), st.integers(0, 2**32))  # fmt: skip
def test_the_body_is_the_request_plus_the_bootstrap_fields(
    doc: dict[str, Any], host: str, port: int | None, seed: int
) -> None:
    before = json.dumps(doc, sort_keys=True)
    body = bootstrap_body(doc, host, port, random.Random(seed))
    assert json.dumps(doc, sort_keys=True) == before  # the request is not touched
    assert {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS} == {
        k: v for k, v in doc.items() if k not in BOOTSTRAP_FIELDS
    }
    n = bootstrap_batch(doc)
    rooms = body["bootstrap_room"]
    if n is None:
        assert (body["bootstrap_host"], body["bootstrap_port"]) == (host, port)
        rooms = [rooms]
    else:
        assert body["bootstrap_host"] == [host] * n and body["bootstrap_port"] == [port] * n
        assert len(rooms) == n
    assert all(isinstance(r, int) and 0 <= r <= MAX_ROOM for r in rooms)
    assert json.loads(json.dumps(body)) == body  # still JSON
    assert aggregated_body(body) == aggregated_body(doc)
    # The same seed draws the same rooms; the rooms come from the source given, only.
    assert bootstrap_body(doc, host, port, random.Random(seed)) == body


def test_rooms_are_63_bit_and_batches_count_as_sglang_gateway_counts() -> None:
    rng = random.Random(1)
    rooms = {bootstrap_body({}, "h", 1, rng)["bootstrap_room"] for _ in range(2000)}
    assert len(rooms) == 2000 and max(rooms) > 1 << 62
    assert bootstrap_batch({"messages": [], "n": 3}) == 3
    assert bootstrap_batch({"messages": [], "n": 1}) is None
    assert bootstrap_batch({"prompt": "a", "n": 3}) is None  # completions: n is not a batch
    assert bootstrap_batch({"prompt": ["a", "b"]}) == 2
    assert bootstrap_batch({"prompt": [1, 2, 3]}) is None  # token ids: one prompt
    assert bootstrap_batch({"prompt": [[1, 2], [3]]}) == 2
    assert bootstrap_batch({"text": ["a", "b", "c"]}) == 3
    assert bootstrap_batch({"input_ids": [[1], [2]]}) == 2
    assert bootstrap_batch({"input_ids": [1, 2]}) is None
    assert bootstrap_host("http://[::1]:8000") == "[::1]"
    assert bootstrap_host("http://prefill-0.svc:8000") == "prefill-0.svc"
    # SGLang's decode engines serve nothing whole: every request that can split, splits.
    kw: dict[str, Any] = {"min_prefill_tokens": 256, "kv_bytes_per_token": 1, "kv_link_gb_per_s": 1}
    assert decide_split(10, None, **kw).reason == "short-prefill"
    assert decide_split(10, None, whole_allowed=False, **kw).split
    assert not decide_split(10, None, whole_allowed=False, prefill_available=False, **kw).split


@pytest.mark.parametrize(
    ("body", "sse", "error", "prompt_tokens"),
    [
        (b'{"choices":[],"usage":{"prompt_tokens":7}}', False, None, 7),
        (b'{"error":{"message":"transfer failed"}}', False, "transfer failed", None),
        (b'{"object":"error","message":"boom"}', False, "boom", None),
        (b"not json", False, "the answer is not JSON", None),
        (
            b'data: {"choices":[]}\n\ndata: {"usage":{"prompt_tokens":9}}\n\ndata: [DONE]\n\n',
            True,
            None,
            9,
        ),
        (b'data: {"choices":[]}\n\ndata: {"error":{"message":"gone"}}\n\n', True, "gone", None),
    ],
)
def test_a_prefill_legs_answer_says_whether_it_failed(
    body: bytes, sse: bool, error: str | None, prompt_tokens: int | None
) -> None:
    why, usage = leg_answer(body, sse=sse)
    assert why == error
    assert (usage or {}).get("prompt_tokens") == prompt_tokens


# ---- through a sidecar -------------------------------------------------------------------


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[SimEngine]]]:
    started: list[SimEngine] = []

    async def make(role: str, **kw: Any) -> SimEngine:
        spec = EngineSpec(time_scale=FAST, pd_protocol="sglang", role=role,
                          bootstrap_timeout_s=20.0, **kw)  # fmt: skip
        e = SimEngine(spec, index=len(started))
        await e.start()
        started.append(e)
        return e

    yield make
    for e in started:
        await e.stop()


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def endpoint(e: SimEngine | str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(e, dict):
        return e
    if isinstance(e, str):
        return {"url": e}
    return {"url": e.url, "bootstrap_port": e.bootstrap_port}


def pd_config(prefill: list[Any], decode: list[Any], tmp_path: Path, **sections: Any) -> Any:
    pools = [
        {"name": "prefill", "role": "prefill", "endpoints": [endpoint(e) for e in prefill]},
        {"name": "decode", "role": "decode", "endpoints": [endpoint(e)["url"] for e in decode],
         "disaggregation": {"prefill_pool": "prefill", "protocol": "sglang"}},
    ]  # fmt: skip
    access = {"access_log": {"path": str(tmp_path / "access.jsonl")}}
    return sidecar_config(["http://unused:1"], pools=pools, telemetry=access, **sections)


def ask(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, **extra}


async def post(s: Sidecar, body: dict[str, Any]) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url(s, "/v1/completions"), json=body) as r,
    ):
        return r.status, await r.text()


async def records(s: Sidecar, tmp_path: Path) -> list[AccessRecord]:
    s.accounting.flush()
    await s.observer.aclose()
    return list(read_access_log(tmp_path / "access.jsonl"))


def legs(record: AccessRecord) -> list[tuple[str, str, str]]:
    return [(a.endpoint, a.reason, a.outcome) for a in record.attempts]


def count(s: Sidecar, name: str, **labels: str) -> float:
    return s.metrics.registry.get_sample_value(name, labels) or 0.0


def sse_text(raw: str) -> str:
    out = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return "".join(out)


async def test_both_legs_at_once_streamed_and_not(
    engines: Callable[..., Awaitable[SimEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    p, d, whole = await engines("prefill"), await engines("decode"), await engines("both")
    s = await sidecar(pd_config([p], [d], tmp_path))
    status, raw = await post(s, ask())
    assert status == 200, raw
    doc = json.loads(raw)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{whole.url}/v1/completions", json=ask()) as r,
    ):
        agg = await r.json()
    assert doc["choices"][0]["text"] == agg["choices"][0]["text"]
    prompt = agg["usage"]["prompt_tokens"]
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1  # transferred
    status, raw = await post(s, ask(stream=True, stream_options={"include_usage": True}))
    assert status == 200 and raw.endswith("data: [DONE]\n\n")
    assert sse_text(raw) == agg["choices"][0]["text"]
    assert p.core.stats.kv_holds_fetched == 2 and d.core.stats.kv_remote_decode_steps == 2
    assert count(s, "meshd_pd_requests_total", pool="decode", path="split", reason="split") == 2
    for r in await records(s, tmp_path):
        assert r.pd == "split" and r.outcome == "ok"
        assert legs(r) == [(p.url, "prefill", "ok"), (d.url, "", "ok")]
        assert r.attempts[0].completion_tokens == 1  # the prefill leg's usage, charged
        assert r.attempts[0].kv_transfer_s is None and (r.attempts[1].kv_transfer_s or 0) > 0


async def test_a_failed_prefill_leg_retries_both_legs_on_another_prefill_engine(
    engines: Callable[..., Awaitable[SimEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    bad, good, d = await engines("prefill"), await engines("prefill"), await engines("decode")
    bad.inject(FaultSpec("status_burst", status=500, count=-1))
    cfg = pd_config([bad, good], [d], tmp_path, routing={"policy": "round-robin"})
    s = await sidecar(cfg)
    for _ in range(2):
        status, raw = await post(s, ask())
        assert status == 200, raw
    rs = await records(s, tmp_path)
    failed = [r for r in rs if len(r.attempts) > 2]
    assert failed, [legs(r) for r in rs]  # round robin put the bad engine first once
    (r,) = failed
    assert legs(r) == [
        (bad.url, "prefill", "http_500"),
        (d.url, "", "prefill_failed"),  # dropped, not blamed
        (good.url, "prefill", "ok"),
        (d.url, "prefill_failed", "ok"),
    ]
    assert count(s, "meshd_retries_total", pool="decode", reason="prefill_failed") == 1
    assert d.core.stats.kv_fetch_refused["timeout"] == 0  # the dropped decode leg left


async def test_no_prefill_engine_left_is_a_502(
    engines: Callable[..., Awaitable[SimEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    d = await engines("decode")
    s = await sidecar(pd_config([dead_url()], [d], tmp_path))
    status, raw = await post(s, ask())
    assert status == 502
    assert "no engine of prefill pool 'prefill' is left" in raw
    (r,) = await records(s, tmp_path)
    assert [(reason, outcome) for _, reason, outcome in legs(r)] == [
        ("prefill", "connect_error"),
        ("", "prefill_failed"),
    ]


async def test_a_decode_leg_refused_before_its_first_byte_is_a_new_pair_in_a_new_room(
    engines: Callable[..., Awaitable[SimEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    p, d = await engines("prefill"), await engines("decode")
    d.inject(FaultSpec("status_burst", status=500, count=1))  # SGLang: a failed KV transfer
    s = await sidecar(pd_config([p], [d], tmp_path))
    status, raw = await post(s, ask(stream=True))
    assert status == 200 and raw.endswith("data: [DONE]\n\n"), raw
    (r,) = await records(s, tmp_path)
    assert legs(r) == [
        (p.url, "prefill", "cancelled"),  # dropped with its pair
        (d.url, "", "http_500"),
        (p.url, "prefill", "ok"),
        (d.url, "kv_fetch_failed", "ok"),
    ]
    assert count(s, "meshd_retries_total", pool="decode", reason="kv_fetch") == 1
    # Two prefill legs, two rooms; the dropped one let go of its KV.
    assert p.core.stats.kv_prefill_steps == 2 and p.core.num_held_requests == 0
    assert p.core.stats.kv_holds_fetched == 1


async def test_a_busy_decode_engine_is_passed_over_with_a_new_pair(
    engines: Callable[..., Awaitable[SimEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    p = await engines("prefill")
    busy, d1, d2 = [await engines("decode") for _ in range(3)]
    busy.inject(FaultSpec("status_burst", status=503, count=-1))
    cfg = pd_config([p], [busy, d1, d2], tmp_path, routing={"policy": "round-robin"})
    s = await sidecar(cfg)
    for _ in range(3):
        status, raw = await post(s, ask())
        assert status == 200, raw
    rs = await records(s, tmp_path)
    retried = [legs(r) for r in rs if len(r.attempts) > 2]
    assert retried, [legs(r) for r in rs]  # round robin put the busy engine first once
    for got in retried:
        assert got[:3] == [
            (p.url, "prefill", "cancelled"),  # dropped with its pair: a new room next
            (busy.url, "", "http_503"),
            (p.url, "prefill", "ok"),
        ]
        assert got[3][1:] == ("http_503", "ok") and got[3][0] in (d1.url, d2.url)
    assert p.core.num_held_requests == 0 and p.core.stats.kv_holds_fetched == 3


async def test_a_room_whose_kv_never_comes_fails_the_request(
    engines: Callable[..., Awaitable[SimEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    p, d = await engines("prefill"), await engines("decode")
    # The prefill engine's bootstrap port configured wrong: no decode leg finds its KV.
    wrong = {"url": p.url, "bootstrap_port": 1}
    s = await sidecar(pd_config([wrong], [d], tmp_path))
    status, raw = await post(s, ask())
    assert status == 502 and "KV not fetched" in raw, raw
    assert d.core.stats.kv_fetch_refused["unknown_engine"] >= 1
    assert p.core.num_held_requests == 0  # each dropped prefill leg let go of its KV


async def test_a_decode_engine_dying_mid_stream_resumes_as_a_pair(
    engines: Callable[..., Awaitable[SimEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    p, d0, d1 = await engines("prefill"), await engines("decode"), await engines("decode")
    for d in (d0, d1):  # whichever decodes first breaks after 5 tokens; the rest is 3
        d.inject(FaultSpec("crash_after_tokens", tokens=5, count=1))
    s = await sidecar(pd_config([p], [d0, d1], tmp_path))
    status, raw = await post(s, ask(stream=True))
    assert status == 200 and raw.endswith("data: [DONE]\n\n"), raw
    assert len(sse_text(raw).split()) == 8
    (r,) = await records(s, tmp_path)
    first, other = (d0, d1) if r.attempts[1].endpoint == d0.url else (d1, d0)
    assert legs(r) == [
        (p.url, "prefill", "ok"),
        (first.url, "", "stream_broken"),
        (p.url, "prefill", "ok"),
        (other.url, "resume", "ok"),
    ]
    assert p.core.stats.kv_holds_fetched == 2  # the continuation's KV came from a new leg
    assert other.core.stats.kv_remote_decode_steps == 1


async def test_the_bootstrap_port_is_learnt_from_the_engine(
    engines: Callable[..., Awaitable[SimEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    p, d = await engines("prefill"), await engines("decode")
    assert p.bootstrap_port != 8998
    # No port configured: the engine's /server_info says it (else every pair would go to
    # 8998, where no prefill engine is, and fail).
    s = await sidecar(pd_config([{"url": p.url}], [d], tmp_path))
    for _ in range(2):
        status, raw = await post(s, ask())
        assert status == 200, raw
    pd = s.relay.attempts.pd
    assert pd is not None and pd.learnt_ports.get(p.url, 0.0) == (p.bootstrap_port, False)
    assert p.core.stats.kv_holds_fetched == 2


async def test_a_bootstrap_port_is_asked_once_and_an_engine_that_cannot_say_falls_back(
    sidecar: Callable[..., Awaitable[Sidecar]], tmp_path: Path
) -> None:
    from aiohttp import web

    asked: list[str] = []

    async def old_info(request: web.Request) -> web.Response:  # an SGLang before /server_info
        asked.append(request.path)
        return web.json_response({"disaggregation_bootstrap_port": 4321, "version": "0.4"})

    async def not_found(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"detail": "Not Found"}, status=404)

    urls, runners = [], []
    for get_server_info in (old_info, not_found):
        app = web.Application()
        app.router.add_get("/server_info", not_found)
        app.router.add_get("/get_server_info", get_server_info)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        cfg = pd_config([{"url": u} for u in urls], [dead_url()], tmp_path)
        pools = [p.model_dump() for p in cfg.pools]
        pools[1]["disaggregation"]["bootstrap_port"] = 7000
        s = await sidecar(sidecar_config(["http://unused:1"], pools=pools))
        pd = s.relay.attempts.pd
        assert pd is not None
        assert [await pd.bootstrap_port("decode", urls[0]) for _ in range(3)] == [4321] * 3
        assert asked == ["/server_info", "/get_server_info"]  # asked once, kept
        asked.clear()
        assert [await pd.bootstrap_port("decode", urls[1]) for _ in range(3)] == [7000] * 3
        assert asked == ["/server_info", "/get_server_info"]  # not again for a while
    finally:
        for runner in runners:
            await runner.cleanup()


def test_the_protocol_is_checked_where_it_is_configured() -> None:
    def load(*pools: dict[str, Any]) -> Any:
        base = {"listeners": {"outbound": {"port": 0}, "admin": {"port": 0}}}
        return load_config(None, base={**base, "pools": list(pools)}, env={})

    def pools(prefill_ep: Any = "http://a:1", **dis: Any) -> list[dict[str, Any]]:
        return [
            {"name": "p", "role": "prefill", "endpoints": [prefill_ep]},
            {"name": "d", "role": "decode", "endpoints": ["http://b:1"],
             "disaggregation": {"prefill_pool": "p", **dis}},
        ]  # fmt: skip

    cfg = load(*pools({"url": "http://a:1", "bootstrap_port": 9000}, protocol="sglang"))
    assert cfg.pools[1].disaggregation.protocol == "sglang"
    assert load(*pools()).pools[1].disaggregation.protocol == "vllm-nixl"  # as before
    cases = [
        (pools(protocol="sglang-pd"), r"pools\[1\]\.disaggregation\.protocol"),
        (pools(protocol="sglang", min_prefill_tokens=64),
         r"pools\[1\]\.disaggregation: min_prefill_tokens: not with protocol sglang"),
        (pools(protocol="sglang", faster_whole_margin_s=None),
         r"pools\[1\]\.disaggregation: faster_whole_margin_s: not with protocol sglang"),
        (pools(protocol="sglang", faster_whole_stall_weight=1.0),
         r"pools\[1\]\.disaggregation: faster_whole_stall_weight: not with protocol sglang"),
        (pools(faster_whole_margin_s=-0.1),
         r"pools\[1\]\.disaggregation\.faster_whole_margin_s"),
        (pools(bootstrap_port=9000), r"pools\[1\]\.disaggregation: bootstrap_port: only"),
        (pools({"url": "http://a:1", "bootstrap_port": 9000}),
         r"pools\[0\]\.endpoints\[0\]\.bootstrap_port: pool 'p' is not the prefill_pool"),
        (pools({"url": "http://a:1", "bootstrap_port": 0}, protocol="sglang"),
         r"pools\[0\]\.endpoints\[0\]\.bootstrap_port"),
    ]  # fmt: skip
    for bad, where in cases:
        with pytest.raises(ConfigError, match=where):
            load(*bad)


async def test_the_pd_bench_runs_the_sglang_protocol(tmp_path: Path) -> None:
    from loadtest.pd_bench import PDBenchSettings, run_bench

    with pytest.raises(ValueError, match="min_prefill_tokens"):
        PDBenchSettings(protocol="sglang", min_prefill_tokens=64)
    s = PDBenchSettings(
        requests=4,
        rate=20.0,
        prompt_scale=0.05,
        min_input=8000,
        engines=3,
        splits=(1,),
        engine_time_scale=4.0,
        protocol="sglang",
        progress=False,
    )
    doc = await run_bench(s, tmp_path)
    for name, f in doc["runs"].items():
        assert f["ok"] == f["requests"] == 4, (name, f["client_errors"])
    for name in ("pd1-meshd", "pd1-rr"):
        f = doc["runs"][name]
        assert f["pd"] == {"split": 4} and f["attempts"] == {"main:ok": 4, "prefill:ok": 4}
        assert f["kv_transfer_s"] > 0 and not f["kv_fetch_refused"]
