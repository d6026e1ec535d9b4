"""The sidecar's dispatch and the relay's chunk writes through the outbound listener
(meshd/listener.py), seen from raw sockets: what reaches the client is strict HTTP/1.1
framing (chunked coding on 1.1, an unframed body on 1.0)."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
from backends import sse_events
from harness import sidecar_config, url

from meshd.intake import request_id as _request_id
from meshd.sidecar import Sidecar

_STREAM = {"model": "tiny", "prompt": "hello", "max_tokens": 40, "stream": True}


async def _exchange(s: Sidecar, raw: bytes) -> bytes:
    """Send `raw` to the outbound listener and read until the sidecar closes."""
    host, port = s.addresses["outbound"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()


def _request(path: str, body: bytes, version: str = "1.1", extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return head.encode() + body


def _dechunk(body: bytes) -> tuple[bytes, int]:
    """A chunked body decoded strictly (RFC 9112 7.1), and its number of chunks."""
    out, chunks, i = b"", 0, 0
    while True:
        line_end = body.index(b"\r\n", i)
        size = int(body[i:line_end], 16)
        i = line_end + 2
        if size == 0:
            assert body[i:] == b"\r\n", "nothing may follow the last chunk"
            return out, chunks
        out += body[i : i + size]
        assert body[i + size : i + size + 2] == b"\r\n"
        i += size + 2
        chunks += 1


async def test_a_relayed_stream_is_framed_exactly_as_chunked_coding(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    raw = await _exchange(s, _request("/v1/completions", json.dumps(_STREAM).encode()))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in head.lower()
    decoded, chunks = _dechunk(body)
    events = sse_events(decoded)
    assert "".join(e["choices"][0]["text"] for e in events[:40]) == " ".join(
        f"w{i}" for i in range(40)
    )
    assert events[-1] == "[DONE]"
    assert chunks >= 1


async def test_an_http_1_0_client_gets_the_stream_unframed(backends, sidecar):
    # HTTP/1.0 has no chunked coding: the body goes as it comes and the connection closes.
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    raw = await _exchange(s, _request("/v1/completions", json.dumps(_STREAM).encode(), "1.0"))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    events = sse_events(body)
    assert len(events) == 42 and events[-1] == "[DONE]"


async def test_expect_100_continue_is_answered_before_the_body(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    host, port = s.addresses["outbound"].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(_STREAM).encode()
    head = _request("/v1/completions", b"", extra="Expect: 100-continue\r\n").replace(
        b"Content-Length: 0", f"Content-Length: {len(body)}".encode()
    )
    try:
        writer.write(head)
        await writer.drain()
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()
    assert rest.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" in rest


async def test_an_unknown_expectation_gets_417(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    raw = await _exchange(
        s, _request("/v1/completions", json.dumps(_STREAM).encode(), extra="Expect: magic\r\n")
    )
    assert raw.startswith(b"HTTP/1.1 417")
    assert b.requests == []


async def test_methods_and_paths_reach_the_handler_the_router_gave_them(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        # Not a POST: an inference path passes through to the pool unchanged.
        resp = await http.get(url(s, "/v1/completions"))
        assert await resp.json() == {"path": "/v1/completions", "backend": "b"}
        # GET and HEAD /v1/models are the merged list; another method passes through.
        doc = await (await http.get(url(s, "/v1/models"))).json()
        assert [m["id"] for m in doc["data"]] == ["tiny"]
        head = await http.head(url(s, "/v1/models"))
        assert head.status == 200 and head.content_type == "application/json"
        resp = await http.post(url(s, "/v1/models"), json={})
        assert await resp.json() == {"path": "/v1/models", "backend": "b"}
        # A POST to an inference path is parsed: a bad body is ours to refuse.
        resp = await http.post(url(s, "/v1/chat/completions"), data=b"{")
        assert resp.status == 400
        assert resp.headers["x-meshd-error"] == "invalid_request"


def test_request_ids_are_uuid4_hex():
    ids = {_request_id() for _ in range(2000)}
    assert len(ids) == 2000
    for rid in ids:
        u = uuid.UUID(hex=rid)
        assert u.hex == rid and u.version == 4 and u.variant == uuid.RFC_4122
