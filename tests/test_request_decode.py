"""parse_inference_request decodes with msgspec, and falls back to json.loads where msgspec
refuses: for every body the outcome is the one the stdlib path gives, error text included."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from filters.request import RequestError, _loads, _loads_stdlib, _parse, parse_inference_request

KINDS = ("completion", "chat", "embedding")


def outcome(fn: Any) -> tuple[Any, ...]:
    """What one parse gives, comparable across decoders: the descriptor's fields and its
    document (repr tells 1 from 1.0 and True, -0.0 from 0.0, and shows key order), or the
    error with its code, message and param."""
    try:
        r = fn()
    except RequestError as exc:
        return ("refused", exc.code, exc.message, exc.param)
    except (RecursionError, ValueError) as exc:  # the stdlib's own (deep nesting, huge ints)
        return ("raised", type(exc).__name__)
    fields = (r.kind, r.model, r.prompt_text, r.max_tokens, r.stream, r.include_usage, r.n)
    return ("parsed", fields, repr(r.doc))


def assert_same(body: bytes) -> None:
    for kind in KINDS:
        fast = outcome(lambda k=kind: parse_inference_request(k, body))
        ref = outcome(lambda k=kind: _parse(k, body, _loads_stdlib))
        assert fast == ref, (kind, body[:200])


# Text with lone surrogates too: json.dumps escapes them (\ud800), and encoded with
# surrogatepass they become bytes json.loads accepts and strict UTF-8 decoders refuse.
text = st.text(st.characters(exclude_categories=()) | st.characters(categories=["Cs"]), max_size=12)
numbers = (
    st.integers()
    | st.integers(min_value=2**62, max_value=2**200).flatmap(lambda n: st.sampled_from([n, -n]))
    | st.floats()  # NaN and +-Infinity included: json.dumps writes them, json.loads reads them
)
values = st.recursive(
    st.none() | st.booleans() | numbers | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=16,
)
# Mostly well-formed requests, so that most bodies parse (and NaN, surrogates or huge
# integers sit in bodies that would otherwise be accepted), and arbitrary ones for the errors.
count = st.integers(min_value=0, max_value=2**70)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"])},
    optional={
        "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text})),
        "tool_calls": values,
        "name": values,
    },
)
extras = st.dictionaries(st.sampled_from(["temperature", "top_p", "seed", "user", "x"]), values)
well_formed = st.tuples(
    st.fixed_dictionaries(
        {"model": text.filter(bool)},
        optional={
            "prompt": text | st.lists(count, min_size=1) | st.lists(text, min_size=1),
            "input": text | st.lists(text, min_size=1),
            "messages": st.lists(message, min_size=1, max_size=3),
            "max_tokens": count,
            "max_completion_tokens": count,
            "n": count.filter(bool),
            "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}),
        },
    ),
    extras,
).map(lambda t: {**t[0], **t[1]})
request_doc = st.fixed_dictionaries(
    {},
    optional={
        "model": values,
        "prompt": values,
        "input": values,
        "messages": st.lists(message, max_size=3) | values,
        "max_tokens": values,
        "max_completion_tokens": values,
        "n": values,
        "stream": values,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}) | values,
    },
)


def encodings(doc: Any) -> list[bytes]:
    """The same document as clients may send it."""
    escaped = json.dumps(doc).encode()
    raw = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    return [
        escaped,
        raw.encode("utf-8", "surrogatepass"),
        json.dumps(doc, indent=2, ensure_ascii=False).encode("utf-8", "surrogatepass"),
        b"\xef\xbb\xbf" + escaped,  # a UTF-8 BOM
        raw.encode("utf-16", "surrogatepass"),
        raw.encode("utf-32-le", "surrogatepass"),
    ]


@settings(max_examples=300)
@given(st.one_of(well_formed, well_formed, request_doc, values))
@example({"model": "m", "prompt": "x", "max_tokens": 2**64})
@example({"model": "m", "prompt": [2**64, 1]})
@example({"model": "m", "prompt": "x", "n": float("nan")})
@example({"model": "m", "prompt": "\ud800"})
def test_any_json_document_parses_as_the_stdlib_path_does(doc):
    for body in encodings(doc):
        assert_same(body)


fragments = st.sampled_from(
    [
        b"{",
        b"}",
        b"[",
        b"]",
        b",",
        b":",
        b" ",
        b'"model"',
        b'"m"',
        b'"prompt"',
        b'"messages"',
        b'"role"',
        b'"content"',
        b'"max_tokens"',
        b'"n"',
        b"1",
        b"-0",
        b"0.5e3",
        b"1e400",
        b"18446744073709551616",
        b"NaN",
        b"-Infinity",
        b"true",
        b"null",
        b'"\\ud800"',
        b'"\\ud83d\\ude00"',
        b'"\xed\xa0\x80"',
        b'"\xc3\xa9"',
        b"\xef\xbb\xbf",
        b"\x00",
        b"\\",
    ]
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A well-formed body as a client may encode it, with a few spans replaced."""
    body = bytearray(draw(st.sampled_from(encodings(draw(well_formed)))))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        i = draw(st.integers(min_value=0, max_value=len(body)))
        j = draw(st.integers(min_value=i, max_value=min(len(body), i + 4)))
        body[i:j] = draw(fragments | st.binary(max_size=2))
    return bytes(body)


@settings(max_examples=500)
@given(mutated() | st.lists(fragments | st.binary(max_size=3), max_size=24).map(b"".join))
def test_any_bytes_parse_or_refuse_as_the_stdlib_path_does(body):
    assert_same(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": "x", "max_tokens": 18446744073709551616}',
        b'{"model": "m", "prompt": [99999999999999999999999, 2]}',
        # 65-bit integers msgspec < 0.19 decoded wrong (msgspec/msgspec#701)
        b'{"model": "m", "prompt": [19933688932870350000, -19901289844059338772]}',
        b'{"model": "m", "prompt": "x", "temperature": NaN}',
        b'{"model": "m", "prompt": "\\ud800"}',
        b'{"model": "m", "prompt": "\xed\xa0\x80"}',
        b'\xef\xbb\xbf{"model": "m", "prompt": "x"}',
        '{"model": "m", "prompt": "é"}'.encode("utf-16"),
        b'{"model": "m", "prompt": "x", "top_p": 1e400}',
        b'{"model": "m", "model": "m2", "prompt": "x"}',
        b'{"model": "m", "prompt": "\xff"}',
        b'{"model": "m", "prompt": "x",}',
        b'{"model": "m", "prompt": "x"} {}',
        b" ",
        b"[" * 5000 + b"]" * 5000,
        b"-" + b"9" * 4400,
    ],
)
def test_where_msgspec_and_the_stdlib_differ(body):
    assert_same(body)


def test_big_integers_stay_integers():
    body = b'{"model": "m", "prompt": [18446744073709551616], "max_tokens": 99999999999999999999}'
    r = parse_inference_request("completion", body)
    assert (r.prompt_text, r.max_tokens) == ("18446744073709551616", 99999999999999999999)


def test_ordinary_bodies_never_reach_the_stdlib(monkeypatch):
    def refuse(body: bytes) -> Any:
        raise AssertionError("json.loads decoded an ordinary body")

    monkeypatch.setattr("filters.request._loads_stdlib", refuse)
    body = '{"model":"m","messages":[{"role":"user","content":"é 数据 🙂"}],"n":2}'.encode()
    assert parse_inference_request("chat", body).prompt_text == "<|user|>é 数据 🙂\n"


def test_the_stdlib_decides_where_msgspec_refuses():
    doc = _loads(b'{"t": NaN, "s": "\\ud800"}')
    assert math.isnan(doc["t"]) and doc["s"] == "\ud800"
    with pytest.raises(RequestError) as err:
        _loads(b'{"a":1 "b":2}')
    assert err.value.message == (
        "the request body is not valid JSON: Expecting ',' delimiter at line 1 column 8"
    )
