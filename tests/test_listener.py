"""The outbound listener (meshd/listener.py) on its own: HTTP/1.1 framing driven through a
fake transport (properties: any split of the bytes across reads gives the same responses;
malformed input gets 400/405/413/417/431 and never a crash or a hang), and through real
sockets with the sidecar behind it (keep-alive, pipelining, slow clients, Upgrade)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from backends import sse_events
from harness import sidecar_config, url
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.http_wire import FakeTransport, responses
from meshd.http_message import BodyError, HttpRequest, ListenerLimits, Reply
from meshd.listener import HttpServer

SMALL = ListenerLimits(
    max_header_count=12,
    max_header_bytes=1024,
    max_body_bytes=2048,
    client_header_timeout_s=5,
    client_body_timeout_s=5,
    keepalive_timeout_s=5,
)


async def echo(req: HttpRequest) -> Reply | None:
    """What the listener framed: method, target, headers and body, as JSON."""
    try:
        body = await req.read_body()
    except BodyError as exc:
        return exc.reply
    if req.path == "/stream":
        stream = req.stream(200, [("Content-Type", "text/plain")])
        for part in (body[: len(body) // 2], body[len(body) // 2 :]):
            stream.write(part)
        return None
    doc = {
        "method": req.method,
        "target": req.target,
        "headers": [[n.lower(), v] for n, v in req.headers if n.lower().startswith("x-")],
        "body": body.decode("latin-1"),
    }
    # ASCII escapes: a target or value that is not UTF-8 reaches us surrogate-escaped.
    return Reply(200, [("Content-Type", "application/json")], json.dumps(doc).encode())


async def drive(chunks: list[bytes], limits: ListenerLimits = SMALL) -> tuple[bytes, bool]:
    """Feed `chunks` as successive reads (waiting while reading is paused), then let every
    handler finish; the bytes written back and whether the listener closed."""
    server = HttpServer(echo, limits)
    conn = server()
    transport = FakeTransport(conn)
    conn.connection_made(transport)
    for chunk in chunks:
        for _ in range(200):
            if transport.reading or transport.closing:
                break
            await asyncio.sleep(0)
        if transport.closing:
            break
        assert transport.reading, "reading stayed paused with no request in progress"
        conn.data_received(chunk)
        await asyncio.sleep(0)
    for _ in range(200):
        await asyncio.sleep(0)
        # Idle: no request handled or queued (the connection's handler task waits on).
        if conn._current is None and not conn._queue:
            break
    closed = transport.closing
    if not transport.closing:
        transport.close()  # the client hangs up: nothing may be left running
    for _ in range(5):
        await asyncio.sleep(0)
    assert conn._task is None or conn._task.done(), "a handler outlived its connection"
    assert conn not in server.connections
    return bytes(transport.out), closed


def request_bytes(
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes,
    chunks: list[int] | None,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: x"]
    lines += [f"{n}: {v}" for n, v in headers]
    if chunks is None:
        if body or method == "POST":
            lines.append(f"Content-Length: {len(body)}")
        framed = body
    else:
        lines.append("Transfer-Encoding: chunked")
        framed, i = b"", 0
        for size in [*chunks, len(body)]:
            piece = body[i : i + size]
            i += len(piece)
            if piece:
                framed += b"%x\r\n%b\r\n" % (len(piece), piece)
        framed += b"0\r\n\r\n"
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + framed


_token = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
_value = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30)
_requests = st.lists(
    st.tuples(
        st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
        st.builds(lambda a, b: f"/{a}?q={b}", _token, _token),
        st.lists(st.tuples(_token.map(lambda t: "x-" + t), _value), max_size=5),
        st.binary(max_size=300),
        st.none() | st.lists(st.integers(1, 64), max_size=6),
    ),
    min_size=1,
    max_size=4,
)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        pieces.append(data[last:p])
        last = p
    pieces.append(data[last:])
    return [p for p in pieces if p]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=_requests, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_of_pipelined_requests_gives_the_same_answers(reqs, cuts):
    data = b"".join(request_bytes(*r) for r in reqs)
    whole, _ = asyncio.run(drive([data]))
    split, _ = asyncio.run(drive(_split(data, cuts)))
    got = responses(whole)
    assert got == responses(split)
    assert len(got) == len(reqs)
    for (method, target, headers, body, _), (status, _, answer) in zip(reqs, got, strict=True):
        assert status == 200
        doc = json.loads(answer)
        assert doc["method"] == method and doc["target"] == target
        assert doc["headers"] == [[n.lower(), v] for n, v in headers]
        assert doc["body"].encode("latin-1") == body


_ANSWERS = {200, 400, 405, 408, 413, 417, 431}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=400),
        st.builds(
            lambda r, pos, junk: r[:pos] + junk + r[pos:],
            st.builds(lambda rq: request_bytes(*rq), _requests.map(lambda rs: rs[0])),
            st.integers(0, 400),
            st.binary(min_size=1, max_size=8),
        ),
    ),
    cuts=st.lists(st.integers(0, 1000), max_size=6),
)
def test_malformed_input_gets_a_clear_status_never_a_crash_or_a_hang(data, cuts):
    raw, _ = asyncio.run(drive(_split(data, cuts)))
    for status, headers, body in responses(raw):
        assert status in _ANSWERS
        if status != 200:
            assert json.loads(body)["error"]["code"] == headers["x-meshd-error"]


@settings(max_examples=50, deadline=None)
@given(count=st.integers(13, 60), size=st.integers(1, 40))
def test_too_many_headers_are_431_and_the_connection_closes(count, size):
    extra = [(f"x-h{i}", "v" * size) for i in range(count)]
    raw, closed = asyncio.run(drive([request_bytes("GET", "/", extra, b"", None)]))
    [(status, headers, body)] = responses(raw)
    assert status == 431 and closed and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] in ("header_count_exceeded", "header_size_exceeded")


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 40), size=st.integers(1, 200))
def test_a_head_is_refused_by_the_first_limit_a_field_passes(count, size):
    extra = [(f"x-h{i:02d}", "v" * size) for i in range(count)]
    raw, closed = asyncio.run(drive([request_bytes("GET", "/", extra, b"", None)]))
    [(status, _, body)] = responses(raw)
    # Host: x first, then the extra fields, each name 5 bytes: where does each limit pass?
    sizes = [len("Host") + 1] + [5 + size] * count
    total, why = 0, None
    for n, field_size in enumerate(sizes, start=1):
        total += field_size
        if n > SMALL.max_header_count:
            why = "header_count_exceeded"
            break
        if total > SMALL.max_header_bytes:
            why = "header_size_exceeded"
            break
    if why is None:
        assert status == 200 and not closed
        return
    error = json.loads(body)["error"]
    assert status == 431 and closed and error["code"] == why
    if why == "header_count_exceeded":
        assert f"{SMALL.max_header_count + 1} > limits.max_header_count" in error["message"]


def test_one_endless_header_line_is_cut_off_before_it_is_buffered():
    head = b"GET / HTTP/1.1\r\nX-Big: "
    chunks = [head] + [b"v" * 1000] * 50
    raw, closed = asyncio.run(drive(chunks))
    [(status, _, body)] = responses(raw)
    assert status == 431 and closed
    assert json.loads(body)["error"]["code"] == "header_size_exceeded"


def test_a_body_over_the_limit_is_413_whether_declared_or_chunked():
    declared = request_bytes("POST", "/", [], b"x" * 3000, None)
    raw, closed = asyncio.run(drive([declared]))
    assert [r[0] for r in responses(raw)] == [413] and closed
    chunked = request_bytes("POST", "/", [], b"x" * 3000, [500] * 6)
    raw, closed = asyncio.run(drive([chunked[:1000], chunked[1000:]]))
    assert [r[0] for r in responses(raw)] == [413] and closed


def test_a_streamed_answer_is_chunked_and_the_next_request_follows_it():
    first = request_bytes("POST", "/stream", [], b"abcdef", None)
    second = request_bytes("GET", "/after", [], b"", None)
    raw, closed = asyncio.run(drive([first + second]))
    (s1, h1, b1), (s2, _, b2) = responses(raw)
    assert (s1, h1["transfer-encoding"], b1) == (200, "chunked", b"abcdef")
    assert s2 == 200 and json.loads(b2)["target"] == "/after" and not closed


def test_upgrade_is_ignored_and_the_body_still_read():
    req = request_bytes(
        "POST", "/up", [("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c")], b"{}", None
    )
    raw, _ = asyncio.run(drive([req + request_bytes("GET", "/next", [], b"", None)]))
    got = responses(raw)
    assert got[0][0] == 200 and json.loads(got[0][2])["body"] == "{}"
    assert len(got) == 1 or json.loads(got[1][2])["target"] == "/next"


def test_connect_is_refused_and_an_unknown_expectation_is_417():
    raw, closed = asyncio.run(drive([b"CONNECT example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n"]))
    assert [r[0] for r in responses(raw)] == [405] and closed
    req = request_bytes("POST", "/", [("Expect", "magic")], b"{}", None)
    raw, closed = asyncio.run(drive([req]))
    assert [r[0] for r in responses(raw)] == [417] and closed


def test_http_1_0_keep_alive_is_honoured_and_plain_1_0_closes():
    keep = b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    raw, closed = asyncio.run(drive([keep + b"GET /b HTTP/1.0\r\n\r\n"]))
    got = responses(raw)
    assert [json.loads(b)["target"] for _, _, b in got] == ["/a", "/b"]
    assert got[0][1]["connection"] == "keep-alive" and got[1][1]["connection"] == "close"
    assert closed


# -- real sockets, the sidecar behind the listener -------------------------------------


async def _open(s: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = s.addresses["outbound"].rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


def _completion(body: dict[str, Any], close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    conn = "Connection: close\r\n" if close else ""
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{conn}\r\n"
    ).encode() + data


async def test_pipelined_requests_on_one_connection_are_answered_in_order(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    reader, writer = await _open(s)
    try:
        writer.write(
            _completion({"model": "tiny", "prompt": "one", "max_tokens": 2})
            + _completion({"model": "tiny", "prompt": "two", "max_tokens": 2, "stream": True})
            + _completion({"model": "tiny", "prompt": "three", "max_tokens": 2}, close=True)
        )
        raw = await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()
    got = responses(raw)
    assert [status for status, _, _ in got] == [200, 200, 200]
    assert got[1][1]["transfer-encoding"] == "chunked"
    assert sse_events(got[1][2])[-1] == "[DONE]"
    assert [r.body["prompt"] for r in b.requests if r.body] == ["one", "two", "three"]


async def test_a_slow_head_gets_408_while_others_are_served(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], limits={"client_header_timeout_s": 0.5}))
    reader, writer = await _open(s)
    try:
        for byte in b"POST /v1/completions HTTP/1.1\r\nHo":  # 1 byte every 50 ms
            writer.write(bytes([byte]))
            await writer.drain()
            if reader.at_eof() or len(reader._buffer):  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as http:
            resp = await http.post(url(s, "/v1/completions"), json={"model": "tiny", "prompt": "a"})
            assert resp.status == 200
        raw = await asyncio.wait_for(reader.read(-1), 5)
    finally:
        writer.close()
    [(status, headers, body)] = responses(raw)
    assert status == 408 and headers["connection"] == "close"
    assert "client_header_timeout_s" in json.loads(body)["error"]["message"]


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url], limits={"keepalive_timeout_s": 0.3}))
    reader, writer = await _open(s)
    try:
        writer.write(_completion({"model": "tiny", "prompt": "a", "max_tokens": 1}))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"close" not in head.lower()
        rest = await asyncio.wait_for(reader.read(-1), 5)  # ends when the sidecar closes
    finally:
        writer.close()
    assert rest and reader.at_eof()


async def test_two_hundred_headers_get_431_and_the_sidecar_serves_on(backends, sidecar):
    b = await backends()
    s = await sidecar(sidecar_config([b.url]))
    async with aiohttp.ClientSession() as http:
        many = {f"x-extra-{i}": "v" for i in range(200)}
        resp = await http.post(
            url(s, "/v1/completions"), json={"model": "tiny", "prompt": "a"}, headers=many
        )
        assert resp.status == 431
        assert (await resp.json())["error"]["code"] == "header_count_exceeded"
        ok = await http.post(url(s, "/v1/completions"), json={"model": "tiny", "prompt": "a"})
        assert ok.status == 200
    assert len(b.requests) == 1


def test_a_body_that_came_with_its_head_is_ready_without_waiting():
    seen: list[bytes | None] = []

    async def handler(req: HttpRequest) -> Reply | None:
        seen.append(req.ready_body())
        body = await req.read_body()
        seen.append(req.ready_body())
        return Reply(200, [], body)

    async def run(chunks: list[bytes]) -> None:
        server = HttpServer(handler, SMALL)
        conn = server()
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        for chunk in chunks:
            conn.data_received(chunk)
            for _ in range(5):
                await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)
        transport.close()
        for _ in range(5):
            await asyncio.sleep(0)

    whole = request_bytes("POST", "/", [], b"abc", None)
    asyncio.run(run([whole]))
    assert seen == [b"abc", b"abc"]
    seen.clear()
    head, _, body = whole.partition(b"\r\n\r\n")
    asyncio.run(run([head + b"\r\n\r\n", body]))  # the body comes after the handler began
    assert seen == [None, b"abc"]


def test_a_connection_s_requests_run_one_after_another_on_one_handler_task():
    """Keep-alive and pipelined requests are handled on the connection's one task (woken
    for each, not made per request), in order, and that task ends with the connection,
    whether it was idle or in a handler when the client left."""
    seen: list[tuple[str, asyncio.Task[Any] | None, bool]] = []
    gate = asyncio.Event()

    async def handler(req: HttpRequest) -> Reply | None:
        seen.append((req.target, asyncio.current_task(), gate.is_set()))
        if req.target == "/hold":
            await gate.wait()
        return Reply(200, [], req.target.encode())

    async def run() -> tuple[bytes, list[bool]]:
        server = HttpServer(handler, SMALL)
        conn = server()
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        ended = []
        conn.data_received(request_bytes("GET", "/a", [], b"", None))
        for _ in range(5):
            await asyncio.sleep(0)
        task = conn._task
        ended.append(task is not None and task.done())  # idle between requests: waiting
        # Two pipelined, the first held: the second waits for it, on the same task.
        conn.data_received(
            request_bytes("GET", "/hold", [], b"", None) + request_bytes("GET", "/b", [], b"", None)
        )
        for _ in range(5):
            await asyncio.sleep(0)
        gate.set()
        for _ in range(10):
            await asyncio.sleep(0)
        conn.data_received(request_bytes("GET", "/c", [], b"", None))
        for _ in range(5):
            await asyncio.sleep(0)
        transport.close()  # the client leaves while the task waits for a next request
        for _ in range(5):
            await asyncio.sleep(0)
        ended.append(task is not None and task.done())
        return bytes(transport.out), ended

    raw, ended = asyncio.run(run())
    assert [b for _, _, b in responses(raw)] == [b"/a", b"/hold", b"/b", b"/c"]
    assert [t for t, _, _ in seen] == ["/a", "/hold", "/b", "/c"]
    assert [held for _, _, held in seen] == [False, False, True, True]  # /b after /hold's end
    assert len({id(task) for _, task, _ in seen}) == 1 and seen[0][1] is not None
    assert ended == [False, True]

    async def leave_mid_handler() -> bool:
        cancelled = asyncio.Event()

        async def stuck(req: HttpRequest) -> Reply | None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return None

        server = HttpServer(stuck, SMALL)
        conn = server()
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        conn.data_received(request_bytes("GET", "/x", [], b"", None))
        for _ in range(3):
            await asyncio.sleep(0)
        transport.close()
        for _ in range(5):
            await asyncio.sleep(0)
        assert conn._task is not None and conn._task.done()
        return cancelled.is_set()

    assert asyncio.run(leave_mid_handler())


def test_a_request_read_whole_while_the_task_waits_is_begun_at_once_as_that_task():
    """The fast path's request, arriving while the connection's task waits for one, runs
    within data_received (as that task: current_task, timeouts) up to its first wait; the
    task drives it on from there. An answer made at once leaves the connection serving; a
    handler that waits gets what it waits for, and a cancellation when the client leaves."""
    events: list[tuple[str, str, bool]] = []
    gate: asyncio.Future[str] | None = None
    in_callback = [False]
    conn: Any = None
    transport: Any = None

    async def handler(req: HttpRequest) -> Reply | None:
        nonlocal gate
        events.append(("begin", req.target, in_callback[0]))
        assert asyncio.current_task() is conn._task
        if req.target == "/wait":
            gate = asyncio.get_running_loop().create_future()
            async with asyncio.timeout(5):  # needs the task: as it would have in it
                try:
                    got = await gate
                except asyncio.CancelledError:
                    events.append(("cancelled", req.target, in_callback[0]))
                    raise
            events.append(("woke", got, in_callback[0]))
        if req.target == "/timeout":
            try:
                async with asyncio.timeout(0.01):
                    await asyncio.sleep(1)
            except TimeoutError:
                events.append(("timed out", req.target, in_callback[0]))
        return Reply(200, [], req.target.encode())

    def receive(data: bytes) -> None:  # as the loop calls a protocol: outside any task
        in_callback[0] = True
        try:
            conn.data_received(data)
        finally:
            in_callback[0] = False

    async def settle() -> None:
        for _ in range(10):
            await asyncio.sleep(0)

    async def run() -> bytes:
        nonlocal conn, transport
        conn = HttpServer(handler, SMALL)()
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        loop = asyncio.get_running_loop()
        loop.call_soon(receive, request_bytes("GET", "/first", [], b"", None))
        await settle()  # the first makes the task (it is not begun in data_received)
        for target in ("/now", "/wait", "/timeout"):
            loop.call_soon(receive, request_bytes("GET", target, [], b"", None))
            await settle()
            if target == "/wait":
                assert gate is not None
                gate.set_result("opened")
                await settle()
        await asyncio.sleep(0.05)  # /timeout's timer
        await settle()
        loop.call_soon(receive, request_bytes("GET", "/wait", [], b"", None))
        loop.call_soon(transport.close)  # the client leaves as it is begun
        await settle()
        assert conn._task is not None and conn._task.done()
        return bytes(transport.out)

    raw = asyncio.run(run())
    assert [b for _, _, b in responses(raw)] == [b"/first", b"/now", b"/wait", b"/timeout"]
    assert events == [
        ("begin", "/first", False),
        ("begin", "/now", True),
        ("begin", "/wait", True),
        ("woke", "opened", False),
        ("begin", "/timeout", True),
        ("timed out", "/timeout", False),
        ("begin", "/wait", True),
        ("cancelled", "/wait", False),
    ]
