# ruff: noqa: F811  (the `engines` fixture, imported from test_sidecar_disagg, is a parameter)
"""A streamed decode step that fails before its first token (issue #25): real vLLM answers a
decode step whose KV it cannot fetch with HTTP 200, then an error event and [DONE]. The
sidecar holds a split request's head until the decode step's stream has started
(filters/stream_start.py decides), so such a start is retried whole like the unstreamed
500: the client sees one good stream, the access log a failed attempt, and the retry is
counted in the budget. The simulator answers that way with kv_fetch_failure_style vllm."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from backends import sse_events
from hypothesis import given
from hypothesis import strategies as st
from test_sidecar_disagg import (
    LONG,
    PDEngine,
    count,
    engines,  # noqa: F401  (the fixture; tests take it as a parameter)
    pd_config,
)

from filters.stream_start import ANSWER, StartFailure, StreamStart, error_status
from loadtest.engine import EngineFleet, EngineSpec, mixed_fleet
from loadtest.engine.virtual import Refused, VirtualFleet
from meshd.access_log import read_access_log
from meshd.sidecar import Sidecar

VLLM_ERROR = {"message": "Internal server error", "type": "InternalServerError", "code": 500}


def event(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def chunk(text: str = "", finish: str | None = None, chat: bool = False) -> bytes:
    choice: dict[str, Any] = (
        {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        if chat
        else {"index": 0, "text": text, "finish_reason": finish}
    )
    return event({"id": "cmpl-1", "choices": [choice]})


ROLE_ONLY = event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
ERROR_THEN_DONE = event({"error": VLLM_ERROR}) + b"data: [DONE]\n\n"


# -- the verdict (filters/stream_start.py) ---------------------------------------------------


def verdict(*chunks: bytes, max_bytes: int = 65536) -> Any:
    start = StreamStart(max_bytes)
    for c in chunks:
        if (v := start.feed(c)) is not None:
            return v
    return None


def test_an_error_event_before_any_token_is_a_failure_standing_for_its_code() -> None:
    v = verdict(ERROR_THEN_DONE)
    assert isinstance(v, StartFailure)
    assert (v.status, v.outcome, v.error) == (500, "http_500", VLLM_ERROR)
    assert json.loads(v.body()) == {"error": VLLM_ERROR}
    assert "error event" in v.detail and "Internal server error" in v.detail
    # A chat's role-only first event is no token: the error after it still counts.
    v = verdict(ROLE_ONLY, event({"error": {**VLLM_ERROR, "code": 503}}))
    assert isinstance(v, StartFailure) and v.status == 503 and v.outcome == "http_503"
    assert error_status({"code": "rate_limit_exceeded"}) == 500
    assert error_status({"code": True}) == 500 and error_status({}) == 500
    assert error_status({"code": 399}) == 500 and error_status({"code": 504}) == 504


def test_a_token_a_finish_or_done_first_is_an_answer() -> None:
    assert verdict(chunk("hi")) is ANSWER
    assert verdict(ROLE_ONLY, chunk("hi", chat=True)) is ANSWER
    # An empty answer (EOS first) is an answer, not a failure.
    assert verdict(chunk("", "stop")) is ANSWER
    assert verdict(b"data: [DONE]\n\n") is ANSWER
    # A token before the error: the relay's business, as before.
    assert verdict(chunk("hi") + ERROR_THEN_DONE) is ANSWER


def test_no_verdict_yet_reads_more_up_to_a_bound() -> None:
    assert verdict(ROLE_ONLY) is None
    assert verdict(b": keep-alive\n\n", b'data: {"error"') is None  # half an event
    assert verdict(ROLE_ONLY, max_bytes=len(ROLE_ONLY)) is ANSWER
    # An event past the scanner's limit is the relay's to refuse.
    big = b"data: " + b"x" * (1 << 20) + b"\n\n"
    assert verdict(big, max_bytes=1 << 22) is ANSWER
    start = StreamStart()
    assert start.feed(ROLE_ONLY) is None and start.seen == len(ROLE_ONLY)
    ended = start.end()
    assert (ended.status, ended.outcome, ended.error) == (502, "stream_truncated", None)
    silent = start.end(silent_s=60)
    assert (silent.status, silent.outcome) == (504, "timeout") and "60 s" in silent.detail
    with pytest.raises(ValueError):
        StreamStart(0)


@given(st.lists(st.integers(0, 400), max_size=6))
def test_where_the_bytes_are_split_does_not_change_the_verdict(cuts: list[int]) -> None:
    for stream in (ROLE_ONLY + ERROR_THEN_DONE, ROLE_ONLY + chunk("a", chat=True), ROLE_ONLY):
        whole = verdict(stream)
        bounds = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
        pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
        assert verdict(*pieces) == whole


# -- the simulator answers as vLLM does (loadtest/engine, kv_fetch_failure_style vllm) ---------

MODEL = EngineSpec().model


def sim_fleet() -> EngineFleet:
    """A prefill and a decode engine; the prefill's KV is released at once (kv_hold_s 1 us),
    so every decode step's fetch fails, as vLLM answers it."""
    base = EngineSpec(time_scale=200.0, kv_hold_s=1e-6, kv_fetch_failure_style="vllm")
    return EngineFleet(mixed_fleet(2, ["H100"], base=base, roles=["prefill", "decode"]))


async def test_the_simulator_fails_a_lost_kv_as_vllm_does() -> None:
    async with sim_fleet() as fleet, aiohttp.ClientSession() as http:
        p, d = fleet
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 4}
        pre = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        async with http.post(f"{p.url}/v1/completions", json=pre) as r:
            params = (await r.json())["kv_transfer_params"]
        await asyncio.sleep(0.01)  # 2 s on the engines' clock: the hold is long gone
        step = {**body, "kv_transfer_params": params}
        async with http.post(f"{d.url}/v1/completions", json=step) as r:
            assert r.status == 500 and await r.json() == {"error": {**VLLM_ERROR, "param": None}}
        async with http.post(f"{d.url}/v1/completions", json={**step, "stream": True}) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            assert sse_events(await r.read()) == [
                {"error": {**VLLM_ERROR, "param": None}},
                "[DONE]",
            ]
        assert d.core.stats.kv_fetch_refused["expired"] == 2


def test_a_virtual_decode_engine_refuses_a_lost_kv_with_vllms_500() -> None:
    fleet = VirtualFleet(
        mixed_fleet(2, ["H100"], base=EngineSpec(kv_fetch_failure_style="vllm"),
                    roles=["prefill", "decode"])
    )  # fmt: skip
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_block_ids": [1]}
    body = {"prompt": LONG, "max_tokens": 4, "kv_transfer_params": params}
    got = fleet[1].submit("completion", body, "r", 0.0, None)  # type: ignore[arg-type]
    assert isinstance(got, Refused) and (got.status, got.message) == (500, "Internal server error")
    assert fleet[1].core.stats.kv_fetch_refused["unknown_engine"] == 1


# -- the sidecar retries it whole ---------------------------------------------------------------


async def _records(s: Sidecar, log: Path) -> list[Any]:
    s.accounting.flush()
    await s.observer.aclose()
    return list(read_access_log(log))


async def test_a_streamed_decode_step_that_lost_its_kv_is_retried_whole_on_the_simulator(
    sidecar: Callable[..., Awaitable[Sidecar]], tmp_path: Path
) -> None:
    async with sim_fleet() as fleet:
        p, d = fleet
        s = await sidecar(pd_config([p.url], [d.url], tmp_path))
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://{s.addresses['outbound']}/v1/completions", json=body) as r,
        ):
            raw = await r.read()
        assert r.status == 200 and r.headers["x-meshd-pd"] == "whole; reason=kv-fetch-failed"
        events = sse_events(raw)
        # One good stream: four tokens, [DONE], no error event.
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]).strip()
        assert d.core.stats.kv_fetch_refused["expired"] == 1
        assert count(s, "meshd_retries_total", pool="decode", reason="kv_fetch") == 1
        (record,) = await _records(s, tmp_path / "access.jsonl")
    # The access log's pd says what x-meshd-pd said (docs/access-log.md); the attempts say
    # the prefill step ran.
    assert record.outcome == "ok" and record.pd == "whole:kv-fetch-failed"
    assert record.completion_tokens == 4  # the whole retry's, not the prefill step's too
    assert [(a.endpoint, a.reason, a.outcome) for a in record.attempts] == [
        (p.url, "prefill", "ok"),
        (d.url, "", "http_500"),
        (d.url, "kv_fetch_failed", "ok"),
    ]


async def test_with_no_retry_left_the_client_gets_a_refusal_not_a_200_and_an_error(
    sidecar: Callable[..., Awaitable[Sidecar]], tmp_path: Path
) -> None:
    async with sim_fleet() as fleet:
        p, d = fleet
        cfg = pd_config([p.url], [d.url], tmp_path)
        s = await sidecar(cfg.model_copy(update={"upstream": cfg.upstream.model_copy(
            update={"max_attempts": 1})}))  # fmt: skip
        body = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://{s.addresses['outbound']}/v1/completions", json=body) as r,
        ):
            doc = await r.json()
        assert r.status == 502 and "KV not fetched" in doc["error"]["message"]
        assert "error event" in doc["error"]["message"]
        (record,) = await _records(s, tmp_path / "access.jsonl")
    assert record.outcome != "ok"
    assert [(a.reason, a.outcome) for a in record.attempts] == [
        ("prefill", "ok"),
        ("", "http_500"),
    ]


class StreamLossEngine(PDEngine):
    """PDEngine whose decode step, streamed, loses its KV after the head: a chat's role-only
    event, then vLLM's error event (`error`), or nothing more (`silent`)."""

    mode = "error"

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_prefill") and body.get("stream"):
            held = (params.get("remote_block_ids") or [""])[0]
            self.fabric.pop(held, None)
            from test_sidecar_disagg import _seen

            self.requests.append(_seen(request, body))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(ROLE_ONLY)
            if self.mode == "silent":
                await asyncio.Event().wait()
            await resp.write(ERROR_THEN_DONE)
            await resp.write_eof()
            return resp
        request._read_bytes = raw
        return await super()._generate(request)


@pytest.mark.parametrize("mode", ["error", "silent"])
async def test_a_chat_decode_step_failing_or_silent_before_its_first_token_is_retried_whole(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
    mode: str,
) -> None:
    p = await engines("p0")
    d = StreamLossEngine("d0")
    d.fabric, d.mode = p.fabric, mode
    await d.start()
    try:
        cfg = pd_config([p.url], [d.url], tmp_path)
        s = await sidecar(cfg.model_copy(update={"upstream": cfg.upstream.model_copy(
            update={"idle_timeout_s": 0.5})}))  # fmt: skip
        body = {"model": "tiny", "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 4, "stream": True}  # fmt: skip
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://{s.addresses['outbound']}/v1/chat/completions", json=body) as r,
        ):
            raw = await r.read()
        assert r.status == 200 and r.headers["x-meshd-pd"] == "whole; reason=kv-fetch-failed"
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        texts = [e["choices"][0]["delta"].get("content") for e in events[:-1] if e["choices"]]
        assert "".join(t for t in texts if t) == "w0 w1 w2 w3"
        assert [("kv_transfer_params" in (x.body or {})) for x in d.requests] == [True, False]
        (record,) = await _records(s, tmp_path / "access.jsonl")
        # The failed step's connection went back (or closed): the pool holds none busy.
        assert s.plane.upstream is not None and s.plane.upstream.stats()["in_use"] == 0
    finally:
        await d.stop()
    failed = "http_500" if mode == "error" else "timeout"
    assert [(a.reason, a.outcome) for a in record.attempts] == [
        ("prefill", "ok"),
        ("", failed),
        ("kv_fetch_failed", "ok"),
    ]


async def test_a_refused_decode_steps_connection_goes_back_to_the_pool(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> None:
    # Unstreamed, the KV-lost refusal (410) is read, then its connection released: before,
    # it was held busy for good (one of the endpoint's connection slots per lost KV).
    p, d = await engines("p0"), await engines("d0")
    s = await sidecar(pd_config([p.url], [d.url]))
    p.lose_kv = True
    body = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://{s.addresses['outbound']}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200 and r.headers["x-meshd-pd"] == "whole; reason=kv-fetch-failed"
    assert s.plane.upstream is not None and s.plane.upstream.stats()["in_use"] == 0
