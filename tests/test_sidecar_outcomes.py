"""What a request's end is counted as, and bad input that used to crash the handler (issue
#21's list, found as a new user would): an engine's 4xx is not a success; a prompt with a
lone surrogate is the client's 400, not a 500; a bug in a handler is a counted 500 in the
OpenAI error shape, never a traceback."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from backends import TestBackend as Backend
from harness import sidecar_config, url

from meshd.sidecar import Sidecar


def count(s: Sidecar, name: str, **labels: str) -> float:
    value = s.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_an_engines_4xx_goes_through_and_is_not_a_success(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    b.refuse_with = 400
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url(s, "/v1/completions"), json={"model": "tiny", "prompt": "a"})
        assert resp.status == 400
    ok = {"kind": "completion", "pool": "default"}
    s.accounting.flush()  # finished off the request path: whatever is still pending
    assert count(s, "meshd_requests_total", **ok, outcome="http_400") == 1
    assert count(s, "meshd_requests_total", **ok, outcome="ok") == 0


async def test_a_lone_surrogate_in_the_prompt_is_a_400_that_says_so(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    body = b'{"model": "tiny", "prompt": "hi \\ud800 there"}'  # valid JSON, not valid text
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            url(s, "/v1/completions"), data=body, headers={"Content-Type": "application/json"}
        )
        doc = await resp.json()
        assert resp.status == 400 and doc["error"]["param"] == "prompt"
        assert "lone UTF-16 surrogate" in doc["error"]["message"]
        ok = await http.post(url(s, "/v1/completions"), json={"model": "tiny", "prompt": "a"})
        assert ok.status == 200
    assert len(b.requests) == 1


async def test_a_bug_in_a_handler_is_a_counted_500_in_the_error_shape(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))

    async def broken(req: Any) -> Any:
        raise KeyError("a bug")

    s.intake.inference = broken  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url(s, "/v1/completions"), json={"model": "tiny", "prompt": "a"})
        doc = await resp.json()
        assert resp.status == 500 and doc["error"]["code"] == "internal"
        assert resp.headers["x-meshd-error"] == "internal"
        models = await http.get(url(s, "/v1/models"))  # the sidecar serves on
        assert models.status == 200
    assert count(s, "meshd_rejected_requests_total", reason="internal") == 1


async def test_a_drain_that_runs_out_ends_the_stream_with_an_error_event_in_time(
    backends: Callable[..., Awaitable[Backend]], tmp_path: Any
) -> None:
    import asyncio
    import json
    import time

    from backends import sse_events

    b = await backends()
    log = tmp_path / "access.jsonl"
    cfg = sidecar_config(
        [b.url],
        drain={"grace_period_s": 0.5},
        telemetry={"access_log": {"path": str(log)}},
    )
    s = Sidecar(cfg)
    await s.start()
    host, port = s.addresses["outbound"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": "tiny", "prompt": "stall", "max_tokens": 3, "stream": True})
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    first = await asyncio.wait_for(reader.readuntil(b"\n\n"), 5)  # the stream has begun
    assert b"data: " in first
    began = time.monotonic()
    await s.drain_and_stop()  # the engine stalls: the grace period runs out
    took = time.monotonic() - began
    rest = await asyncio.wait_for(reader.read(-1), 5)
    writer.close()
    assert took < 0.5 + 1.0, "the drain kept to its grace period"
    assert rest.endswith(b"0\r\n\r\n"), "the chunked body was ended, not cut"
    events = sse_events(rest)
    assert events and isinstance(events[-1], dict) and events[-1]["error"]["code"] == "draining"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["outcome"] for r in records] == ["drain_timeout"]


async def test_an_engine_answering_503_to_everything_leaves_rotation(
    backends: Callable[..., Awaitable[Backend]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    # Issue #21: such an engine stayed the first pick for 87 of 87 requests, every request
    # paying a retry (amplification 2.0x). Now its streak of 503s counts as failures.
    a, b = await backends("a"), await backends("b")
    a.refuse_with = 503
    s = await sidecar(sidecar_config([a.url, b.url], routing={"policy": "round-robin"}))
    async with aiohttp.ClientSession() as http:
        for i in range(40):
            body = {"model": "tiny", "prompt": f"request {i}"}
            resp = await http.post(url(s, "/v1/completions"), json=body)
            assert resp.status == 200  # retried on b while a was still tried
    attempts = len(a.requests) + len(b.requests)
    assert len(b.requests) == 40
    assert attempts / 40 <= 1.2, (len(a.requests), len(b.requests))
