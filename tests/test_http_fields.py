"""A head's fields (filters/http_fields.py): read within the count and byte limits, the
first limit passed named; split into forwarded and hop-by-hop; and the compiled twin
(filters/_http_fields_c.pyx) gives the reference's answer for arbitrary fields, names that
lower() strangely (KELVIN SIGN, dotted I) included."""

from __future__ import annotations

import importlib
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters import http_fields as pure

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._http_fields_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

NOT_BUILT = "compiled twin filters._http_fields_c not built (run make install)"
TWINS = [
    pytest.param(pure, id="pure"),
    pytest.param(
        compiled, id="cython", marks=pytest.mark.skipif(compiled is None, reason=NOT_BUILT)
    ),
]
needs_compiled = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)
DROP = frozenset({"connection", "keep-alive", "host", "content-length", "te"})


@pytest.mark.parametrize("twin", TWINS)
def test_a_request_head_is_read_and_its_framing_fields_noted(twin: Any) -> None:
    raw = [
        (b"Host", b"x"),
        (b"CONTENT-LENGTH", b"12"),
        (b"Expect", b"100-continue"),
        (b"X-Name", "caf\u00e9".encode()),
        (b"X-Raw", b"\xff"),
    ]
    headers, length, expect, error = twin.read_request_fields(raw, 10, 1000)
    assert headers == [
        ("Host", "x"),
        ("CONTENT-LENGTH", "12"),
        ("Expect", "100-continue"),
        ("X-Name", "caf\u00e9"),
        ("X-Raw", "\udcff"),
    ]
    assert (length, expect, error) == (12, "100-continue", None)


@pytest.mark.parametrize("twin", TWINS)
def test_the_first_limit_a_field_passes_is_named(twin: Any) -> None:
    raw = [(b"A", b"1"), (b"B", b"2"), (b"C", b"3")]
    assert twin.read_request_fields(raw, 2, 1000)[2:] == (None, "count")
    assert len(twin.read_request_fields(raw, 2, 1000)[0]) == 3
    assert twin.read_request_fields(raw, 2, 3)[2:] == (None, "size")
    assert len(twin.read_request_fields(raw, 2, 3)[0]) == 2


@pytest.mark.parametrize("twin", TWINS)
def test_a_message_is_split_into_forwarded_and_hop_fields(twin: Any) -> None:
    fields = [
        ("Host", "a"),
        ("Via", "1.0 p"),
        ("Connection", "close, X-Hop"),
        ("X-Request-Id", "one"),
        ("x-request-id", "two"),
        ("X-Hop", "h"),
        ("Keep-Alive", "5"),
    ]
    out, connection, via, rid = twin.split_fields(fields, DROP, True)
    assert out == [("X-Request-Id", "one"), ("x-request-id", "two"), ("X-Hop", "h")]
    assert (connection, via, rid) == (["close, X-Hop"], ["1.0 p"], "two")
    out, _, via, _ = twin.split_fields(fields, DROP, False)
    assert ("Via", "1.0 p") in out and via == []


_ODD = ["\u212a", "\u0130", "\u00e9", "K", "I", "-", "\x00"]
_names = st.one_of(
    st.sampled_from(
        ["Connection", "CONNECTION", "Via", "vIA", "X-Request-ID", "Host", "Keep-Alive", "TE"]
    ),
    st.text(alphabet=st.sampled_from(list("aceiknortvx-") + _ODD), max_size=12),
    st.text(max_size=6),
)
_fields = st.lists(st.tuples(_names, st.text(max_size=8)), max_size=8)


@needs_compiled
@settings(max_examples=1000, deadline=None)
@given(fields=_fields, via_apart=st.booleans())
def test_twins_split_alike(fields: list[tuple[str, str]], via_apart: bool) -> None:
    assert compiled is not None
    assert compiled.split_fields(fields, DROP, via_apart) == pure.split_fields(
        fields, DROP, via_apart
    )


_raw_names = st.one_of(
    st.sampled_from([b"Content-Length", b"content-length", b"EXPECT", b"expect", b"X"]),
    st.binary(max_size=16),
)
_raw_values = st.one_of(st.sampled_from([b"0", b"123", b"007"]), st.binary(max_size=12))


@needs_compiled
@settings(max_examples=1000, deadline=None)
@given(
    raw=st.lists(st.tuples(_raw_names, _raw_values), max_size=10),
    max_count=st.integers(0, 12),
    max_bytes=st.integers(0, 120),
)
def test_twins_read_alike(raw: list[tuple[bytes, bytes]], max_count: int, max_bytes: int) -> None:
    assert compiled is not None

    def outcome(twin: Any) -> Any:
        try:
            return twin.read_request_fields(raw, max_count, max_bytes)
        except ValueError as exc:  # int() of a Content-Length the parser would refuse
            return ("error", type(exc).__name__)

    assert outcome(compiled) == outcome(pure)
