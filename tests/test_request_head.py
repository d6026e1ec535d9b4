"""The listener's fast path (filters/request_head.py): a read holding exactly one plain
request is read whole; anything else is declined (None) and goes to llhttp. The property
that makes it safe: whatever it reads, llhttp (httptools, as meshd/listener.py drives it)
reads the same (method, target, version, fields, keep-alive, body, one message ending where
the bytes do) within the same limits; and the compiled twin (filters/_request_head_c.pyx)
gives the reference's answer for any bytes."""

from __future__ import annotations

import importlib
import types
from typing import Any

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filters import request_head as pure
from filters.http_fields import read_request_fields

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._request_head_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

NOT_BUILT = "compiled twin filters._request_head_c not built (run make install)"
TWINS = [
    pytest.param(pure, id="pure"),
    pytest.param(
        compiled, id="cython", marks=pytest.mark.skipif(compiled is None, reason=NOT_BUILT)
    ),
]
needs_compiled = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)
LIMITS = (100, 16384, 1 << 20)
BODY = b'{"model":"m","prompt":"hi","stream":true}'
PLAIN = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:15001\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(BODY), BODY)
)


@pytest.mark.parametrize("twin", TWINS)
def test_a_plain_request_is_read_whole(twin: Any) -> None:
    assert twin.read_simple_request(PLAIN, *LIMITS) == (
        "POST",
        "/v1/completions",
        "1.1",
        [
            ("Host", "127.0.0.1:15001"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(BODY))),
        ],
        True,
        len(BODY),
        BODY,
    )
    get = twin.read_simple_request(
        b"GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", *LIMITS
    )
    assert get == ("GET", "/v1/models", "1.0", [("Connection", "keep-alive")], True, None, b"")


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize(
    "data",
    [
        PLAIN[:-1],  # the body not all here yet
        PLAIN + b"GET / HTTP/1.1\r\n\r\n",  # pipelined: another request follows
        PLAIN.replace(b"Content-Length", b"Transfer-Encoding: chunked\r\nX"),
        PLAIN.replace(b"Host", b"Expect: 100-continue\r\nHost"),
        PLAIN.replace(b"Host", b"Upgrade: h2c\r\nHost"),
        PLAIN.replace(b"Host", b"Connection: Upgrade, close\r\nHost"),
        PLAIN.replace(b"POST", b"CONNECT"),
        PLAIN.replace(b"/v1/completions", b"/a b"),
        PLAIN.replace(b"127.0.0.1", b"caf\xc3\xa9"),  # not ASCII
        PLAIN.replace(b"Host: ", b"Host:\t"),
        PLAIN.replace(b"\r\nContent-Type", b"\r\n Content-Type"),  # obs-fold
        PLAIN.replace(b"HTTP/1.1", b"HTTP/2.0"),
        b"GARBAGE\r\n\r\n",
    ],
)
def test_anything_else_is_left_to_llhttp(twin: Any, data: bytes) -> None:
    assert twin.read_simple_request(data, *LIMITS) is None


@pytest.mark.parametrize("twin", TWINS)
def test_over_a_limit_is_left_to_llhttp(twin: Any) -> None:
    """llhttp's path answers 431 and 413; the fast path only declines."""
    assert twin.read_simple_request(PLAIN, 2, 16384, 1 << 20) is None  # 3 fields
    assert twin.read_simple_request(PLAIN, 100, 30, 1 << 20) is None  # field bytes
    assert twin.read_simple_request(PLAIN, 100, 16384, len(BODY) - 1) is None  # body
    assert twin.read_simple_request(PLAIN, 3, 16384, len(BODY)) is not None


class _Recorder:
    """httptools' callbacks, recorded as meshd/listener.py reads them."""

    def __init__(self) -> None:
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.heads = 0
        self.messages = 0
        self.parser = httptools.HttpRequestParser(self)
        self.head: tuple[str, str, bool] | None = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.heads += 1
        p = self.parser
        self.head = (p.get_method().decode("ascii"), p.get_http_version(), p.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.messages += 1


def llhttp_reads(data: bytes, max_count: int, max_bytes: int) -> Any:
    rec = _Recorder()
    try:
        rec.parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        return "upgrade"
    except httptools.HttpParserError:
        return "error"
    if rec.heads != 1 or rec.messages != 1 or rec.head is None:
        return "not one whole message"
    headers, length, _expect, error = read_request_fields(rec.fields, max_count, max_bytes)
    if error is not None:
        return error
    method, version, keep_alive = rec.head
    target = rec.url.decode("utf-8", "surrogateescape")
    return (method, target, version, headers, keep_alive, length, rec.body)


_methods = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH"])
_odd_methods = st.sampled_from([b"CONNECT", b"TRACE", b"get", b"PRI", b"POSTX", b""])
_target = st.text(
    alphabet=st.sampled_from(list("/abz09-._~!$&'()*+,;=:@?%#<>\"{}|\\^` \t\x7f\xe9")),
    max_size=12,
).map(lambda s: s.encode("utf-8"))
_names = st.one_of(
    st.sampled_from(
        [
            b"Host",
            b"Content-Length",
            b"content-length",
            b"Connection",
            b"Transfer-Encoding",
            b"Expect",
            b"Upgrade",
            b"Proxy-Connection",
            b"X-Meshd-Tenant",
            b"Keep-Alive",
        ]
    ),
    st.text(alphabet=st.sampled_from(list("aZ09-_!#.~ :\t\x00\xe9")), max_size=8).map(
        lambda s: s.encode("utf-8")
    ),
)
_values = st.one_of(
    st.sampled_from(
        [b"0", b"2", b"17", b"007", b"close", b"Keep-Alive", b"keep-alive, Upgrade", b"chunked"]
    ),
    st.text(alphabet=st.sampled_from(list('ab 09,;="\t\x00\x7f\xe9')), max_size=8).map(
        lambda s: s.encode("utf-8")
    ),
)
_field = st.tuples(_names, st.sampled_from([b": ", b":", b":  ", b" : "]), _values)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.one_of(_methods, _odd_methods) if draw(st.booleans()) else _methods)
    target = b"/" + draw(_target) if draw(st.integers(0, 9)) else draw(_target)
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"http/1.1"]))
    fields = draw(st.lists(_field, max_size=6))
    body = draw(st.binary(max_size=8))
    lines = [method + b" " + target + b" " + version]
    lines += [n + sep + v for n, sep, v in fields]
    if draw(st.booleans()):
        lines.append(b"Content-Length: %d" % (len(body) + draw(st.sampled_from([0, 0, 0, -1, 1]))))
    data = b"\r\n".join(lines) + b"\r\n\r\n" + body
    tail = draw(st.sampled_from([b"", b"", b"", b"GET / HTTP/1.1\r\n\r\n", b"x"]))
    return data + tail


_plain_value = st.text(
    alphabet=st.sampled_from(list('aZ09 -,;=:/"\\%*')), min_size=1, max_size=10
).map(lambda s: s.encode("ascii"))
_plain_field = st.tuples(
    st.sampled_from([b"Host", b"X-Meshd-Tenant", b"Accept", b"Connection", b"content-length"]),
    st.sampled_from([b": ", b":", b":   "]),
    st.one_of(_plain_value, st.sampled_from([b"close", b"keep-alive", b"KEEP-ALIVE", b"3"])),
)


@st.composite
def plain_requests(draw: st.DrawFn) -> bytes:
    """Mostly what the fast path reads, so the property above is tested where it answers."""
    method = draw(_methods)
    target = (
        b"/"
        + draw(
            st.text(alphabet=st.sampled_from(list("az09-._~!$&'()*+,;=:@/?%")), max_size=10)
        ).encode()
    )
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]))
    fields = draw(st.lists(_plain_field, max_size=5))
    body = draw(st.binary(max_size=8))
    lines = [method + b" " + target + b" " + version]
    lines += [n + sep + v for n, sep, v in fields]
    if body or draw(st.booleans()):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(requests(), plain_requests()),
    max_count=st.integers(0, 8),
    max_bytes=st.integers(0, 80),
)
def test_what_it_reads_llhttp_reads_the_same(data: bytes, max_count: int, max_bytes: int) -> None:
    got = pure.read_simple_request(data, max_count, max_bytes, 1 << 20)
    if got is not None:
        assert llhttp_reads(data, max_count, max_bytes) == got


@needs_compiled
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(requests(), plain_requests(), st.binary(max_size=64)),
    max_count=st.integers(0, 8),
    max_bytes=st.integers(0, 80),
    max_body=st.integers(0, 10),
)
def test_twins_read_alike(data: bytes, max_count: int, max_bytes: int, max_body: int) -> None:
    assert compiled is not None
    assert compiled.read_simple_request(data, max_count, max_bytes, max_body) == (
        pure.read_simple_request(data, max_count, max_bytes, max_body)
    )


def test_the_generator_reaches_both_answers() -> None:
    """The property above is not vacuous: plain requests are read, odd ones declined."""
    assert pure.read_simple_request(PLAIN, *LIMITS) is not None
    assert llhttp_reads(PLAIN, *LIMITS[:2]) == pure.read_simple_request(PLAIN, *LIMITS)
