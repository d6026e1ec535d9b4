"""The benchmark's own tools: the open-loop load generator (framing, timing, errors), the stub
backend it measures (OpenAI wire format, checked with the openai client) and /proc stats."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import openai
import pytest
from aiohttp import web

from loadtest import procstats
from loadtest.openloop import (
    Endpoint,
    LoadGenerator,
    RequestTemplate,
    Sample,
    completion_request,
    percentile,
    poisson_arrivals,
    summarize,
)
from loadtest.stub_backend import StubConfig, answer_text, make_app

# -- pure parts ----------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_bounded_and_at_the_rate() -> None:
    a = poisson_arrivals(1000.0, 10.0, seed=7)
    assert a == poisson_arrivals(1000.0, 10.0, seed=7)
    assert a != poisson_arrivals(1000.0, 10.0, seed=8)
    assert all(0 < x < 10.0 for x in a) and a == sorted(a)
    # 10,000 expected; a Poisson count's standard deviation is 100.
    assert 9_500 < len(a) < 10_500
    assert len(poisson_arrivals(1000.0, 10.0, max_requests=25)) == 25
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 1.0)


def test_percentile_interpolates_between_ranks() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert math.isnan(percentile([], 50))


def test_endpoint_parse() -> None:
    assert Endpoint.parse("http://127.0.0.1:8000/v1") == Endpoint("127.0.0.1", 8000)
    assert Endpoint.parse("localhost:9") == Endpoint("localhost", 9)
    with pytest.raises(ValueError):
        Endpoint.parse("https://127.0.0.1:8000")
    with pytest.raises(ValueError):
        Endpoint.parse("http://127.0.0.1")


def test_summary_counts_errors_by_kind_and_excludes_them_from_latency() -> None:
    samples = [
        Sample(0.0, 0.0, 0.001, 0.002, 200, 10),
        Sample(0.1, 0.0, 0.003, 0.004, 200, 10),
        Sample(0.2, 0.0, math.nan, 9.0, 503, 0, "http_503"),
    ]
    s = summarize(samples, "open", target_rate=10.0)
    assert (s.requests, s.ok, s.errors) == (3, 2, 1)
    assert s.error_kinds == {"http_503": 1}
    assert s.ttfb_ms.p50 == pytest.approx(2.0)
    assert s.ttlb_ms.max == pytest.approx(4.0)
    assert s.offered_rate == pytest.approx(10.0)


# -- the generator against real servers ----------------------------------------------


Serve = Callable[[web.Application], Awaitable[Endpoint]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> Endpoint:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return Endpoint("127.0.0.1", port)

    yield start
    for r in runners:
        await r.cleanup()


async def test_open_loop_measures_streams_from_the_stub(serve: Serve) -> None:
    ep = await serve(make_app())
    gen = LoadGenerator([ep], completion_request(50))
    await gen.prewarm(2)
    samples = await gen.open_loop(500.0, 1.0, max_requests=12, seed=3)
    await gen.close()
    assert len(samples) == 12
    for s in samples:
        assert s.ok, s
        assert s.status == 200
        assert 0 < s.ttfb <= s.ttlb
        # 50 events of ~200 bytes each, in chunked framing.
        assert s.nbytes > 50 * 150
    assert gen.connections_opened <= 12


async def test_closed_loop_keeps_connections_alive(serve: Serve) -> None:
    ep = await serve(make_app(StubConfig(default_tokens=5)))
    gen = LoadGenerator([ep], completion_request(5))
    samples = await gen.closed_loop(2, 0.2)
    await gen.close()
    assert len(samples) > 4
    assert all(s.ok for s in samples)
    assert gen.connections_opened == 2  # two clients, each on its own kept-alive connection


async def _raw_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, Endpoint]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, Endpoint("127.0.0.1", port)


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await reader.readexactly(length)


async def test_chunked_end_split_across_writes_and_content_length_bodies() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n")
        await writer.drain()
        writer.write(b"\r\n")  # the last CRLF of the body arrives on its own
        await writer.drain()
        await _read_request(reader)
        body = b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await reader.read()
        writer.close()

    server, ep = await _raw_server(handler)
    gen = LoadGenerator([ep], completion_request(1))
    first = await gen.one()
    second = await gen.one()
    await gen.close()
    server.close()
    assert first.ok and second.ok, (first, second)
    assert gen.connections_opened == 1


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", "http_503"),
        # A stream cut before its end.
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n", "closed"),
        # A complete body that never says [DONE].
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", "no_done"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "bad_head"),
    ],
)
async def test_failures_are_samples_with_a_reason(response: bytes, error: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(response)
        await writer.drain()
        writer.close()

    server, ep = await _raw_server(handler)
    gen = LoadGenerator([ep], completion_request(1))
    sample = await gen.one()
    await gen.close()
    server.close()
    assert sample.error == error


async def test_a_silent_server_times_out() -> None:
    done = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await done.wait()
        writer.close()

    server, ep = await _raw_server(handler)
    gen = LoadGenerator([ep], completion_request(1), timeout_s=0.1)
    sample = await gen.one()
    done.set()
    await gen.close()
    server.close()
    assert sample.error == "timeout"
    assert sample.ttlb >= 0.1


async def test_requests_alternate_between_endpoints(serve: Serve) -> None:
    seen: list[str] = []

    def counting(name: str) -> web.Application:
        @web.middleware
        async def count(
            request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            seen.append(name)
            return await handler(request)

        app = make_app(StubConfig(default_tokens=2))
        app.middlewares.append(count)
        return app

    eps = [await serve(counting("a")), await serve(counting("b"))]
    gen = LoadGenerator(eps, completion_request(2))
    for _ in range(4):
        assert (await gen.one()).ok
    await gen.close()
    assert seen == ["a", "b", "a", "b"]


# -- the stub backend speaks the OpenAI wire format ----------------------------------


async def test_stub_streams_what_the_openai_client_reads(serve: Serve) -> None:
    ep = await serve(make_app())
    client = openai.AsyncOpenAI(base_url=f"http://{ep}/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(
        model="m", prompt="hi", max_tokens=7, stream=True, stream_options={"include_usage": True}
    )
    texts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(texts) == answer_text(7)
    assert len(texts) == 7  # one event per token
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 7

    chat = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    deltas = [c.choices[0].delta async for c in chat]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == answer_text(4)

    whole = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert whole.choices[0].message.content == answer_text(3)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["stub-model"]
    await client.close()


async def test_stub_default_length_and_bad_body(serve: Serve) -> None:
    ep = await serve(make_app(StubConfig(default_tokens=3)))
    gen = LoadGenerator([ep], RequestTemplate("/v1/completions", b'{"prompt": "x"}', False))
    sample = await gen.one()
    bad = LoadGenerator([ep], RequestTemplate("/v1/completions", b"{not json", False))
    rejected = await bad.one()
    await gen.close()
    await bad.close()
    assert sample.ok
    assert rejected.error == "http_400"


def test_stub_cli_prints_a_ready_line_and_serves() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.stub_backend", "--port", "0", "--workers", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["workers"] == 2
        workers = procstats.descendants(proc.pid)
        assert len(workers) == 2  # the parent serves too, beside one forked worker

        async def one() -> Sample:
            gen = LoadGenerator([Endpoint("127.0.0.1", ready["port"])], completion_request(3))
            try:
                return await gen.one()
            finally:
                await gen.close()

        assert asyncio.run(one()).ok
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


# -- /proc readings --------------------------------------------------------------------


def test_procstats_reads_cpu_memory_and_children() -> None:
    before = procstats.sample(os.getpid())
    sum(i * i for i in range(300_000))  # some CPU, at least one clock tick
    after = procstats.sample(os.getpid())
    assert after.cpu_since(before) >= 0
    assert after.cpu_s > 0
    assert after.peak_rss >= after.rss > 1024 * 1024
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert child.pid in procstats.descendants(os.getpid())
        tree = procstats.sample(os.getpid(), tree=True)
        assert child.pid in tree.pids and tree.peak_rss > after.peak_rss
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    with pytest.raises(ProcessLookupError):
        procstats.sample(child.pid)
