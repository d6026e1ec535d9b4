"""Chunked-body decoding (RFC 9112 7.1): valid bodies split anywhere decode to their payload,
malformed framing raises ChunkedError with a reason, limits hold at their edge, and the two
twins agree after every feed on arbitrary bytes."""

from __future__ import annotations

import importlib
import itertools
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters import chunked as pure
from filters.chunked import ChunkedError

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._chunked_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

NOT_BUILT = "compiled twin filters._chunked_c not built (run setup.py build_ext --inplace)"
CLASSES = [
    pytest.param(pure.ChunkedDecoder, id="pure"),
    pytest.param(
        compiled.ChunkedDecoder if compiled is not None else None,
        id="cython",
        marks=pytest.mark.skipif(compiled is None, reason=NOT_BUILT),
    ),
]
needs_compiled = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)


def encode(pieces: list[bytes], ext: bytes = b"", trailers: bytes = b"") -> bytes:
    out = [b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces if p]
    out.append(b"0%s\r\n%s\r\n" % (ext, trailers))
    return b"".join(out)


Outcome = tuple[list[bytes], bool, bytes, str | None]


def run(cls: Any, parts: list[bytes], **kw: Any) -> Outcome:
    """Feed `parts`; each feed's return, done, unused, and the error text if one raised."""
    d = cls(**kw)
    returns = []
    for part in parts:
        try:
            returns.append(d.feed(part))
        except ChunkedError as exc:
            return returns, d.done, d.unused, str(exc)
    return returns, d.done, d.unused, None


def decode_all(cls: Any, data: bytes, **kw: Any) -> bytes:
    d = cls(**kw)
    out = d.feed(data)
    assert d.done
    return bytes(out)


@pytest.mark.parametrize("cls", CLASSES)
class TestValid:
    def test_sse_stream(self, cls: Any) -> None:
        events = [b'data: {"i":%d}\n\n' % i for i in range(50)] + [b"data: [DONE]\n\n"]
        body = encode(events)
        assert decode_all(cls, body) == b"".join(events)

    def test_one_feed_holds_many_chunks(self, cls: Any) -> None:
        d = cls()
        assert d.feed(b"3\r\nabc\r\n2\r\nde\r\n1\r\nf\r\n") == b"abcdef"
        assert not d.done
        assert d.feed(b"0\r\n\r\n") == b""
        assert d.done and d.unused == b""

    def test_byte_by_byte(self, cls: Any) -> None:
        body = encode([b"hello", b" ", b"world" * 40], ext=b";a=1", trailers=b"X-T: 1\r\n")
        d = cls()
        out = b"".join(d.feed(bytes([c])) for c in body)
        assert out == b"hello world" + b"world" * 39 and d.done

    def test_extensions_ignored(self, cls: Any) -> None:
        body = b'5 ;name="quoted;value" ; x\r\nhello\r\n0;last\r\n\r\n'
        assert decode_all(cls, body) == b"hello"

    def test_upper_and_lower_hex_and_leading_zeros(self, cls: Any) -> None:
        body = b"000A\r\n" + b"x" * 10 + b"\r\n0b\r\n" + b"y" * 11 + b"\r\n000\r\n\r\n"
        assert decode_all(cls, body) == b"x" * 10 + b"y" * 11

    def test_trailers_discarded(self, cls: Any) -> None:
        body = encode([b"abc"], trailers=b"Digest: sha-256=xyz\r\nX-Other:\r\n")
        assert decode_all(cls, body) == b"abc"

    def test_unused_after_end(self, cls: Any) -> None:
        d = cls()
        assert d.feed(b"1\r\na\r\n0\r\n\r\nHTTP/1.1") == b"a"
        assert d.done and d.unused == b"HTTP/1.1"
        assert d.feed(b" 200") == b""
        assert d.unused == b"HTTP/1.1 200"

    def test_empty_feed(self, cls: Any) -> None:
        d = cls()
        assert d.feed(b"") == b""
        assert not d.done


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"zz\r\n", "invalid chunk size line b'zz'"),
        (b"\r\n", "invalid chunk size line b''"),
        (b" 5\r\nhello\r\n", "invalid chunk size line b' 5'"),
        (b"5 \r\nhello\r\n", "invalid chunk size line b'5 '"),
        (b"0x5\r\nhello\r\n", "invalid chunk size line b'0x5'"),
        (b"-5\r\n", "invalid chunk size line b'-5'"),
        (b"5\nhello\r\n", "chunk size line b'5' does not end with CRLF"),
        (b"5\r\nhelloX\r\n", "missing CRLF after chunk data"),
        (b"5\r\nhello\rX", "missing CRLF after chunk data"),
        (b"5\r\nhello\n", "missing CRLF after chunk data"),
        (b"0\r\nbad trailer\r\n", "malformed trailer field b'bad trailer'"),
        (b"0\r\nBad name: v\r\n", "malformed trailer field b'Bad name: v'"),
        (b"0\r\n: v\r\n", "malformed trailer field b': v'"),
        (b"0\r\nX: v\n", "trailer line b'X: v' does not end with CRLF"),
    ],
)
def test_malformed(cls: Any, body: bytes, message: str) -> None:
    for parts in ([body], [bytes([c]) for c in body]):
        _, done, _, error = run(cls, parts)
        assert error == message
        assert not done


@pytest.mark.parametrize("cls", CLASSES)
class TestLimits:
    def test_size_line_at_limit(self, cls: Any) -> None:
        # The line's bytes before its LF (CR included) may be max_line_bytes long.
        line = b"5;" + b"e" * 7 + b"\r"
        assert len(line) == 10
        assert decode_all(cls, line + b"\nhello\r\n0\r\n\r\n", max_line_bytes=10) == b"hello"
        _, _, _, error = run(cls, [b"5;" + b"e" * 8 + b"\r\n"], max_line_bytes=10)
        assert error == "chunk size line longer than max_line_bytes (10)"

    def test_size_line_too_long_without_lf(self, cls: Any) -> None:
        d = cls(max_line_bytes=10)
        assert d.feed(b"5;eeeeeeee") == b""  # 10 bytes: still within the limit
        with pytest.raises(ChunkedError, match=r"longer than max_line_bytes \(10\)"):
            d.feed(b"e")

    def test_chunk_size_at_limit(self, cls: Any) -> None:
        assert decode_all(cls, b"10\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n", max_chunk_size=16)
        _, _, _, error = run(cls, [b"11\r\n"], max_chunk_size=16)
        assert error == "chunk size b'11' exceeds max_chunk_size (16)"

    def test_huge_chunk_size(self, cls: Any) -> None:
        _, _, _, error = run(cls, [b"f" * 100 + b"\r\n"])
        assert error is not None and error.startswith("chunk size b'ffff")
        assert error.endswith(f"exceeds max_chunk_size ({pure.DEFAULT_MAX_CHUNK_SIZE})")

    def test_trailer_section_limit(self, cls: Any) -> None:
        trailer = b"X-A: 123456\r\n"  # 13 bytes with its CRLF
        ok = b"0\r\n" + trailer * 2 + b"\r\n"
        assert decode_all(cls, ok, max_trailer_bytes=26) == b""
        _, _, _, error = run(cls, [b"0\r\n" + trailer * 3 + b"\r\n"], max_trailer_bytes=26)
        assert error == "trailer section exceeds max_trailer_bytes (26)"

    def test_error_is_sticky(self, cls: Any) -> None:
        d = cls()
        with pytest.raises(ChunkedError, match="invalid chunk size"):
            d.feed(b"q\r\n")
        with pytest.raises(ChunkedError, match="invalid chunk size"):
            d.feed(b"5\r\nhello\r\n")

    def test_bad_limits_refused(self, cls: Any) -> None:
        with pytest.raises(ValueError):
            cls(max_line_bytes=0)
        with pytest.raises(ValueError):
            cls(max_chunk_size=1 << 61)


def test_chunked_error_is_value_error() -> None:
    assert issubclass(ChunkedError, ValueError)


@needs_compiled
def test_twins_share_the_error_class() -> None:
    assert compiled is not None
    assert compiled.ChunkedError is ChunkedError


# -- properties ----------------------------------------------------------------------------

payloads = st.lists(st.binary(min_size=0, max_size=300), max_size=12)
extensions = st.sampled_from([b"", b";a", b" ;a=b", b';q="x;y"'])
trailer_sections = st.sampled_from([b"", b"X-T: 1\r\n", b"A:\r\nB: two words\r\n"])


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("cls", CLASSES)
@settings(max_examples=150, deadline=None)
@given(pieces=payloads, ext=extensions, trailers=trailer_sections, tail=st.binary(max_size=5))
def test_valid_encoding_split_everywhere(
    cls: Any, pieces: list[bytes], ext: bytes, trailers: bytes, tail: bytes
) -> None:
    body = encode(pieces, ext, trailers)
    expected = b"".join(pieces)
    assert decode_all(cls, body + tail) == expected
    # Every single split point, then byte by byte.
    for cut in range(len(body) + 1):
        returns, done, unused, error = run(cls, [body[:cut], body[cut:] + tail])
        assert error is None and done and unused == tail
        assert b"".join(returns) == expected
    returns, done, unused, error = run(cls, [bytes([c]) for c in body + tail])
    assert error is None and done and unused == tail and b"".join(returns) == expected


@pytest.mark.parametrize("cls", CLASSES)
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_split_invariance_on_arbitrary_bytes(cls: Any, data: bytes, cuts: list[int]) -> None:
    """Arbitrary input: the payload so far, done, unused and the error (if any) do not depend
    on how the bytes were split. A feed that raises drops that feed's payload, so compare the
    payload only when no error was raised."""
    whole = run(cls, [data], max_line_bytes=16, max_chunk_size=64, max_trailer_bytes=24)
    split = run(cls, splits(data, cuts), max_line_bytes=16, max_chunk_size=64, max_trailer_bytes=24)
    assert whole[1:] == split[1:]
    if whole[3] is None:
        assert b"".join(whole[0]) == b"".join(split[0])


def framing_bytes() -> st.SearchStrategy[bytes]:
    # Arbitrary bytes skewed towards the framing alphabet, so examples get past the size line.
    alphabet = st.sampled_from([b"0", b"1", b"a", b"F", b";", b" ", b"\t", b"\r", b"\n", b":"])
    token = st.one_of(alphabet, st.binary(min_size=1, max_size=3), st.just(b"\r\n"))
    return st.lists(token, max_size=60).map(b"".join)


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(
    data=st.one_of(st.binary(max_size=200), framing_bytes()),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    limits=st.fixed_dictionaries(
        {
            "max_line_bytes": st.integers(1, 20),
            "max_chunk_size": st.integers(0, 40),
            "max_trailer_bytes": st.integers(0, 30),
        }
    ),
)
def test_twins_agree_after_every_feed(data: bytes, cuts: list[int], limits: dict[str, int]) -> None:
    assert compiled is not None
    a = pure.ChunkedDecoder(**limits)
    b = compiled.ChunkedDecoder(**limits)
    for part in splits(data, cuts):
        ra: Any
        rb: Any
        try:
            ra = a.feed(part)
        except ChunkedError as exc:
            ra = (type(exc), str(exc))
        try:
            rb = b.feed(part)
        except ChunkedError as exc:
            rb = (type(exc), str(exc))
        assert ra == rb
        assert type(ra) is type(rb)
        assert (a.done, a.unused) == (b.done, b.unused)


@needs_compiled
@settings(max_examples=100, deadline=None)
@given(pieces=payloads, ext=extensions, trailers=trailer_sections, cuts=st.lists(st.integers()))
def test_twins_agree_on_valid_bodies(
    pieces: list[bytes], ext: bytes, trailers: bytes, cuts: list[int]
) -> None:
    assert compiled is not None
    body = encode(pieces, ext, trailers)
    parts = splits(body, cuts)
    assert run(pure.ChunkedDecoder, parts) == run(compiled.ChunkedDecoder, parts)
