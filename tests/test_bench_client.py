"""The bench load client against a fake streaming backend: what it measures, how it
classifies failures, and that dependency chains wait for their previous step."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from loadtest.bench.client import ClientSettings, run_load
from loadtest.workloads import PlannedRequest, extend

Behaviour = Callable[[web.Request, dict[str, Any], "Fake"], Awaitable[web.StreamResponse]]

ANSWER = (" alpha", " beta", " gamma")


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _token(text: str) -> bytes:
    return _event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


@dataclass
class Seen:
    body: dict[str, Any]
    headers: dict[str, str]
    received_at: float
    finished_at: float = 0.0


@dataclass
class Fake:
    """A streaming backend whose behaviour is picked by the prompt's first word."""

    seen: list[Seen] = field(default_factory=list)
    hang: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen = Seen(body, dict(request.headers), asyncio.get_running_loop().time())
        self.seen.append(seen)
        word = str(body.get("prompt", "")).split(" ", 1)[0]
        resp = await BEHAVIOURS.get(word, _normal)(request, body, self)
        seen.finished_at = asyncio.get_running_loop().time()
        return resp


async def _stream(
    request: web.Request, parts: list[bytes], gap_s: float = 0.0
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, part in enumerate(parts):
        if gap_s and i:
            await asyncio.sleep(gap_s)  # the latency being measured, not a wait for an event
        await resp.write(part)
    await resp.write_eof()
    return resp


async def _normal(request: web.Request, body: dict[str, Any], fake: Fake) -> web.StreamResponse:
    usage = {"prompt_tokens": 3, "completion_tokens": len(ANSWER), "total_tokens": 6}
    parts = [_token(t) for t in ANSWER] + [_event({"choices": [], "usage": usage})]
    return await _stream(request, [*parts, b"data: [DONE]\n\n"])


async def _slow(request: web.Request, body: dict[str, Any], fake: Fake) -> web.StreamResponse:
    # 40 ms before the first token, 20 ms between tokens.
    parts = [b": opening\n\n"] + [_token(t) for t in ANSWER] + [b"data: [DONE]\n\n"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(parts[0])
    await asyncio.sleep(0.04)
    for part in parts[1:]:
        await resp.write(part)
        await asyncio.sleep(0.02)
    await resp.write_eof()
    return resp


async def _http503(request: web.Request, body: dict[str, Any], fake: Fake) -> web.StreamResponse:
    err = {"error": {"message": "no healthy endpoint", "type": "overloaded_error", "code": "x"}}
    return web.json_response(err, status=503)


async def _sse_error(request: web.Request, body: dict[str, Any], fake: Fake) -> web.StreamResponse:
    err = {"error": {"message": "upstream reset mid-stream", "type": "upstream_error"}}
    return await _stream(request, [_token(" a"), _event(err)])


async def _no_done(request: web.Request, body: dict[str, Any], fake: Fake) -> web.StreamResponse:
    return await _stream(request, [_token(" a"), _token(" b")])


async def _reset(request: web.Request, body: dict[str, Any], fake: Fake) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_token(" a"))
    assert request.transport is not None
    request.transport.abort()
    return resp


async def _empty(request: web.Request, body: dict[str, Any], fake: Fake) -> web.StreamResponse:
    return await _stream(request, [b"data: [DONE]\n\n"])


async def _hang(request: web.Request, body: dict[str, Any], fake: Fake) -> web.StreamResponse:
    await fake.hang.wait()
    return await _normal(request, body, fake)


BEHAVIOURS: dict[str, Behaviour] = {
    "slow": _slow,
    "http503": _http503,
    "sseerror": _sse_error,
    "nodone": _no_done,
    "reset": _reset,
    "empty": _empty,
    "hang": _hang,
}


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    f = Fake()
    app = web.Application()
    app.router.add_post("/v1/completions", f.handle)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    f.url = f"http://127.0.0.1:{port}"
    yield f
    f.hang.set()
    await runner.cleanup()


def req(rid: str, prompt: str, at_s: float = 0.0, **kw: Any) -> PlannedRequest:
    return PlannedRequest(
        request_id=rid,
        workload="test",
        at_s=at_s,
        kind="completion",
        prompt=prompt,
        messages=None,
        max_tokens=3,
        prompt_tokens=len(prompt.split()),
        **kw,
    )


async def test_measures_ttft_itl_e2e_and_usage(fake: Fake) -> None:
    run = await run_load(fake.url, [req("r1", "slow prompt")])
    (o,) = run.outcomes
    assert o.ok and o.error is None and o.status == 200
    assert o.ttft_s is not None and o.ttft_s >= 0.039
    assert len(o.itl_s) == len(ANSWER) - 1
    assert all(gap >= 0.019 for gap in o.itl_s)
    # E2E covers the first-token wait, every gap and the last sleep before the end.
    assert o.e2e_s >= o.ttft_s + sum(o.itl_s) + 0.019
    assert o.output_tokens == len(ANSWER)
    assert run.not_sent == ()


async def test_body_headers_and_usage(fake: Fake) -> None:
    r = req("r1", "hello there", tenant="gold", priority=9, deadline_ms=5000)
    run = await run_load(fake.url, [r], ClientSettings(model="tiny"))
    (o,) = run.outcomes
    assert o.ok and o.output_tokens == 3 and o.prompt_tokens == 3
    (seen,) = fake.seen
    assert seen.body == {
        "model": "tiny",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "prompt": "hello there",
    }
    h = seen.headers
    assert h["x-meshd-tenant"] == "gold"
    assert h["x-meshd-priority"] == "9"
    assert h["x-meshd-deadline-ms"] == "5000"
    assert "x-meshd-task-id" not in h


@pytest.mark.parametrize(
    ("word", "error", "detail"),
    [
        ("http503", "http_503", "no healthy endpoint"),
        ("sseerror", "sse_error", "upstream reset mid-stream"),
        ("nodone", "truncated", "without data: [DONE]"),
        ("reset", "truncated", ""),
        ("empty", "empty", "no token"),
    ],
)
async def test_failures_are_classified(fake: Fake, word: str, error: str, detail: str) -> None:
    run = await run_load(fake.url, [req("r1", f"{word} prompt")])
    (o,) = run.outcomes
    assert not o.ok
    assert o.error == error
    assert detail in o.detail


async def test_timeout_and_refused_connection(fake: Fake) -> None:
    run = await run_load(fake.url, [req("r1", "hang")], ClientSettings(timeout_s=0.2))
    (o,) = run.outcomes
    assert o.error == "timeout" and not o.ok

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on a port just released.
    run = await run_load(f"http://127.0.0.1:{port}", [req("r2", "hello")])
    assert run.outcomes[0].error == "connect"


async def test_chain_waits_for_previous_step_and_extends_its_answer(fake: Fake) -> None:
    chain: dict[str, Any] = dict(task_id="t1", steps_in_task=2, task_deadline_ms=60_000)
    step0 = req("t1-0", "slow first step", step=0, **chain)
    step1 = req(
        "t1-1", "then this", at_s=0.0, step=1, depends_on_previous=True, think_s=0.05, **chain
    )
    lone = req("lone", "hello")
    run = await run_load(fake.url, [step0, step1, lone])
    assert all(o.ok for o in run.outcomes), run.outcomes
    by_prompt = {s.body["prompt"]: s for s in fake.seen}
    first = by_prompt["slow first step"]
    second = by_prompt[extend("slow first step", "".join(ANSWER), "then this")]
    # Sent only after step 0 finished, plus the think time.
    assert second.received_at >= first.finished_at + 0.049
    assert second.headers["x-meshd-task-id"] == "t1"
    assert int(second.headers["x-meshd-deadline-ms"]) < int(first.headers["x-meshd-deadline-ms"])
    assert int(first.headers["x-meshd-deadline-ms"]) == 60_000
    assert {o.task_key for o in run.outcomes} == {"t1", "lone"}


async def test_failed_step_stops_its_chain(fake: Fake) -> None:
    chain: dict[str, Any] = dict(task_id="t1", steps_in_task=3)
    steps = [
        req("s0", "http503 first", step=0, **chain),
        req("s1", "next", step=1, depends_on_previous=True, **chain),
        req("s2", "last", step=2, depends_on_previous=True, **chain),
    ]
    run = await run_load(fake.url, steps)
    assert [o.request_id for o in run.outcomes] == ["s0"]
    assert run.not_sent == ("s1", "s2")
    assert len(fake.seen) == 1


async def test_duration_cap_and_orphan_steps_are_not_sent(fake: Fake) -> None:
    orphan = req("o1", "x", step=1, depends_on_previous=True, task_id="gone", steps_in_task=2)
    late = req("late", "hello", at_s=30.0)
    run = await run_load(fake.url, [req("r1", "hello"), late, orphan], ClientSettings(duration_s=5))
    assert [o.request_id for o in run.outcomes] == ["r1"]
    assert set(run.not_sent) == {"late", "o1"}
