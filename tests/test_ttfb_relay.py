"""Time to first byte through the sidecar: nothing on the relay path waits for upstream bytes
it does not have. The response head reaches the client while the engine is still silent
(prefill), and each event reaches the client before the engine sends the next one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from harness import sidecar_config, url

from meshd.sidecar import Sidecar

_DEADLINE_S = 5.0


def _event(i: int) -> bytes:
    doc = {
        "id": "cmpl-ttfb",
        "object": "text_completion",
        "choices": [{"index": 0, "text": f" t{i}"}],
    }
    return f"data: {json.dumps(doc)}\n\n".encode()


@dataclass
class GatedEngine:
    """An engine that sends its response head at once, then one event per opened gate."""

    gates: list[asyncio.Event] = field(default_factory=lambda: [asyncio.Event() for _ in range(2)])
    sent: list[int] = field(default_factory=list)  # events written so far
    url: str = ""
    runner: web.AppRunner | None = None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # the head leaves alone, as from an engine still prefilling
        for i, gate in enumerate(self.gates):
            await gate.wait()
            await resp.write(_event(i))
            self.sent.append(i)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"


@pytest.fixture
async def relay() -> AsyncIterator[tuple[GatedEngine, Sidecar]]:
    engine = GatedEngine()
    await engine.start()
    sidecar = Sidecar(sidecar_config([engine.url]))
    await sidecar.start()
    yield engine, sidecar
    for gate in engine.gates:
        gate.set()  # let a stuck handler finish before the runners close
    await sidecar.drain_and_stop()
    assert engine.runner is not None
    await engine.runner.cleanup()


async def _post(http: aiohttp.ClientSession, s: Sidecar) -> aiohttp.ClientResponse:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
    return await http.post(url(s, "/v1/completions"), json=body)


async def test_response_head_reaches_the_client_before_the_first_upstream_chunk(relay):
    engine, s = relay
    async with aiohttp.ClientSession() as http:
        # No gate is open: the engine has sent its head and nothing else.
        async with asyncio.timeout(_DEADLINE_S):
            resp = await _post(http, s)
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        assert engine.sent == []
        engine.gates[0].set()
        engine.gates[1].set()
        body = await resp.read()
    assert body.count(b"data: ") == 3 and body.endswith(b"data: [DONE]\n\n")


async def test_each_event_reaches_the_client_before_the_engine_sends_the_next(relay):
    engine, s = relay
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(_DEADLINE_S):
            resp = await _post(http, s)
            engine.gates[0].set()
            first = b""
            while not first.endswith(b"\n\n"):
                more = await resp.content.readany()
                assert more, "the stream ended before its first event"
                first += more
        # The engine has not been let past its first event: nothing was held back for it.
        assert first == _event(0)
        assert engine.sent == [0]
        engine.gates[1].set()
        rest = await resp.read()
    assert rest == _event(1) + b"data: [DONE]\n\n"


async def test_the_relay_gives_the_cpu_up_once_per_stream_right_after_its_first_bytes(relay):
    engine, s = relay
    calls: list[list[int]] = []  # what the engine had sent at each yield
    s._yield_cpu = lambda: calls.append(list(engine.sent))
    async with aiohttp.ClientSession() as http:
        for round_ in range(2):
            for gate in engine.gates:
                gate.clear()
            engine.sent.clear()
            async with asyncio.timeout(_DEADLINE_S):
                resp = await _post(http, s)
                engine.gates[0].set()
                first = await resp.content.readuntil(b"\n\n")
                assert first == _event(0)
                # The yield came with the first event, before the engine was let go on.
                assert calls[round_:] == [[0]]
                engine.gates[1].set()
                await resp.read()
            assert len(calls) == round_ + 1  # the later events and [DONE] did not yield again
    assert s.first_byte_yields == 2


async def test_yield_after_first_byte_off_never_yields():
    engine = GatedEngine()
    await engine.start()
    for gate in engine.gates:
        gate.set()
    s = Sidecar(sidecar_config([engine.url], listeners={"yield_after_first_byte": False}))
    await s.start()
    try:
        assert s._yield_cpu is None
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(_DEADLINE_S):
                body = await (await _post(http, s)).read()
        assert body.endswith(b"data: [DONE]\n\n")
        assert s.first_byte_yields == 0
    finally:
        await s.drain_and_stop()
        assert engine.runner is not None
        await engine.runner.cleanup()
