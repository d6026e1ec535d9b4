"""Response heads (RFC 9112 4, 5, 6.3): the usual heads parse to their status, fields and
framing; malformed ones raise ResponseHeadError with a reason; and the compiled twin
(filters/_response_head_c.pyx, a C fast path that hands any unusual head to the reference)
gives the reference's result or error for arbitrary and head-shaped bytes."""

from __future__ import annotations

import importlib
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters import response_head as pure
from filters.response_head import CHUNKED, LENGTH, NONE, UNTIL_CLOSE, ResponseHeadError

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._response_head_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

NOT_BUILT = "compiled twin filters._response_head_c not built (run make install)"
PARSERS = [
    pytest.param(pure.parse_response_head, id="pure"),
    pytest.param(
        compiled.parse_response_head if compiled is not None else None,
        id="cython",
        marks=pytest.mark.skipif(compiled is None, reason=NOT_BUILT),
    ),
]
needs_compiled = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)

STUB_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\nDate: Sun, 06 Dec 2026 21:39:11 GMT\r\n"
    b"Server: Python/3.11 aiohttp/3.14.5"
)


def outcome(parse: Any, head: bytes, max_headers: int = 100, is_head: bool = False) -> Any:
    try:
        return parse(head, max_headers, is_head)
    except ResponseHeadError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("parse", PARSERS)
def test_the_usual_heads(parse: Any) -> None:
    assert parse(STUB_HEAD, 100, False) == (
        200,
        "OK",
        [
            ("Content-Type", "text/event-stream"),
            ("Cache-Control", "no-cache"),
            ("Transfer-Encoding", "chunked"),
            ("Date", "Sun, 06 Dec 2026 21:39:11 GMT"),
            ("Server", "Python/3.11 aiohttp/3.14.5"),
        ],
        "text/event-stream",
        CHUNKED,
        0,
        True,
    )
    json_head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: Application/JSON; charset=utf-8\r\ncontent-length: 42"
    )
    assert parse(json_head, 100, False)[3:] == ("application/json", LENGTH, 42, True)
    assert parse(b"HTTP/1.0 503 \r\nContent-Length:0", 100, False) == (
        503,
        "",
        [("Content-Length", "0")],
        "application/octet-stream",
        NONE,
        0,
        False,
    )
    assert parse(b"HTTP/1.1 200", 100, False)[4:] == (UNTIL_CLOSE, 0, False)
    assert parse(b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close", 100, False)[6] is False
    assert parse(b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked", 100, False)[4] == NONE
    assert parse(STUB_HEAD, 100, True)[4:6] == (NONE, 0)  # the answer to a HEAD request
    assert parse(b"HTTP/1.1 100 Continue", 100, False) is None


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize(
    ("head", "error"),
    [
        (b"HTTP/2 200 OK", "malformed status line"),
        (b"HTTP/1.1 101 Switching Protocols", "unexpected 101"),
        (b"HTTP/1.1 200 OK\r\nbad header", "malformed response header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2", "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1", "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked", "unsupported Transfer-Encoding"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3",
            "both Transfer-Encoding and Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4", r"4 response header lines exceed"),
    ],
)
def test_malformed_heads(parse: Any, head: bytes, error: str) -> None:
    with pytest.raises(ResponseHeadError, match=error):
        parse(head, 3, False)


@pytest.mark.parametrize("parse", PARSERS)
def test_obs_fold_is_joined(parse: Any) -> None:
    head = b"HTTP/1.1 200 OK\r\nX-Long: one\r\n  two\r\nContent-Length: 0"
    assert parse(head, 100, False)[2] == [("X-Long", "one two"), ("Content-Length", "0")]


_NAMES = st.sampled_from(
    [
        "Content-Length",
        "content-length",
        "Transfer-Encoding",
        "TRANSFER-ENCODING",
        "Connection",
        "Content-Type",
        "content-type",
        "Date",
        "X-A",
        "x:y",
        "",
        " Lead",
        "é",
    ]
)
_VALUES = st.one_of(
    st.sampled_from(
        [
            "0",
            "12",
            "007",
            "1, 1",
            "1,2",
            "",
            " 5 ",
            "chunked",
            "Chunked",
            " chunked\t",
            "gzip",
            "chunked, chunked",
            "close",
            "keep-alive",
            "Upgrade, close",
            "text/event-stream",
            "application/json; charset=utf-8",
            " TEXT/Plain ;x=1",
            "99999999999999999999",
            "a\rb",
            "a\x00b",
            "é",
        ]
    ),
    st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=12),
)
_STATUS_LINES = st.one_of(
    st.sampled_from(
        [
            "HTTP/1.1 200 OK",
            "HTTP/1.0 200 OK",
            "HTTP/1.1 204 No Content",
            "HTTP/1.1 304 Not Modified",
            "HTTP/1.1 503 ",
            "HTTP/1.1 429",
            "HTTP/1.1 100 Continue",
            "HTTP/1.1 101 Switching",
            "HTTP/1.2 200 OK",
            "HTTP/1.1 20 OK",
            "HTTP/1.1 200OK",
            "HTTP/1.1 200 O\rK",
            "HTTP/1.1 200 Ünïcode",
        ]
    ),
    st.text(max_size=20),
)


@st.composite
def _heads(draw: Any) -> bytes:
    lines = [draw(_STATUS_LINES)]
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 9)) == 0:
            lines.append(draw(st.sampled_from([" folded", "\tfolded", "", "no colon"])))
        else:
            sep = draw(st.sampled_from([":", ": ", ":\t", " :"]))
            lines.append(f"{draw(_NAMES)}{sep}{draw(_VALUES)}")
    joiner = draw(st.sampled_from(["\r\n", "\r\n", "\r\n", "\n"]))
    return joiner.join(lines).encode("utf-8", "surrogateescape")


@needs_compiled
@settings(max_examples=1500, deadline=None)
@given(head=_heads(), max_headers=st.integers(0, 8), is_head=st.booleans())
def test_twins_agree_on_head_shaped_bytes(head: bytes, max_headers: int, is_head: bool) -> None:
    assert compiled is not None
    assert outcome(compiled.parse_response_head, head, max_headers, is_head) == outcome(
        pure.parse_response_head, head, max_headers, is_head
    )


@needs_compiled
@settings(max_examples=800, deadline=None)
@given(head=st.binary(max_size=80), is_head=st.booleans())
def test_twins_agree_on_any_bytes(head: bytes, is_head: bool) -> None:
    assert compiled is not None
    for data in (head, b"HTTP/1.1 200 OK\r\n" + head):
        assert outcome(compiled.parse_response_head, data, 100, is_head) == outcome(
            pure.parse_response_head, data, 100, is_head
        )
