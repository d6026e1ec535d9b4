"""SSE scanning: vLLM-shaped streams, WHATWG framing cases, limits, and the property that
matters most: the same bytes split anywhere give the same state, in both twins."""

from __future__ import annotations

import importlib
import json
import random
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters import sse as pure
from filters.sse import SSEError

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._sse_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

NOT_BUILT = "compiled twin filters._sse_c not built (run setup.py build_ext --inplace)"
CLASSES = [
    pytest.param(pure.SSEScanner, id="pure"),
    pytest.param(
        compiled.SSEScanner if compiled is not None else None,
        id="cython",
        marks=pytest.mark.skipif(compiled is None, reason=NOT_BUILT),
    ),
]
needs_compiled = pytest.mark.skipif(compiled is None, reason=NOT_BUILT)

State = tuple[Any, ...]


def state(s: Any) -> State:
    return (
        s.events,
        s.tokens,
        s.done,
        s.usage,
        s.finish_reason,
        s.response_id,
        s.error,
        s.text,
    )


def run(cls: Any, chunks: list[bytes], **kw: Any) -> tuple[State, list[int], str | None]:
    """Feed chunks; the final state, each feed's return, and the SSEError text if raised."""
    s = cls(**kw)
    returns = []
    for c in chunks:
        try:
            returns.append(s.feed(c))
        except SSEError as e:
            return state(s), returns, str(e)
    return state(s), returns, None


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def vllm_completion_stream(pieces: list[str], usage: bool = True) -> bytes:
    """A /v1/completions stream as vLLM sends it (stream_options.include_usage)."""
    base = {"id": "cmpl-7f3a", "object": "text_completion", "created": 1718000000, "model": "m"}
    out = []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        choice = {
            "index": 0,
            "text": p,
            "logprobs": None,
            "finish_reason": "length" if last else None,
            "stop_reason": None,
        }
        out.append(event({**base, "choices": [choice], "usage": None}))
    if usage:
        u = {"prompt_tokens": 7, "total_tokens": 7 + len(pieces), "completion_tokens": len(pieces)}
        out.append(event({**base, "choices": [], "usage": u}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def vllm_chat_stream(pieces: list[str], usage: bool = True) -> bytes:
    """A /v1/chat/completions stream as vLLM sends it (stream_options.include_usage)."""
    base = {"id": "chatcmpl-9b1c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    out = [event({**base, "choices": [{**first, "finish_reason": None}]})]
    for p in pieces:
        choice = {"index": 0, "delta": {"content": p}, "logprobs": None, "finish_reason": None}
        out.append(event({**base, "choices": [choice]}))
    stop = {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "stop"}
    out.append(event({**base, "choices": [{**stop, "stop_reason": None}]}))
    if usage:
        u = {
            "prompt_tokens": 12,
            "total_tokens": 12 + len(pieces),
            "completion_tokens": len(pieces),
        }
        out.append(event({**base, "choices": [], "usage": u}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


PIECES = [
    "Hello",
    ",",
    " world",
    "\n",
    ' "quoted"',
    " caf\u00e9",
    " \u65e5\u672c",
    " \U0001f600",
    "!",
]


# --- realistic streams ------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
def test_vllm_completion_stream(cls: Any) -> None:
    s = cls(collect_text=True)
    assert s.feed(vllm_completion_stream(PIECES)) == len(PIECES)
    assert s.events == len(PIECES) + 1  # the usage chunk is an event without tokens
    assert s.tokens == len(PIECES)
    assert s.done
    assert s.usage == {"prompt_tokens": 7, "total_tokens": 16, "completion_tokens": 9}
    assert s.finish_reason == "length"
    assert s.response_id == "cmpl-7f3a"
    assert s.error is None
    assert s.text == "".join(PIECES)


@pytest.mark.parametrize("cls", CLASSES)
def test_vllm_chat_stream(cls: Any) -> None:
    s = cls(collect_text=True)
    body = vllm_chat_stream(PIECES)
    got = sum(s.feed(body[i : i + 7]) for i in range(0, len(body), 7))
    assert got == s.tokens == len(PIECES)  # role-only and empty-content chunks don't count
    assert s.events == len(PIECES) + 3
    assert s.done
    assert s.usage == {"prompt_tokens": 12, "total_tokens": 21, "completion_tokens": 9}
    assert s.finish_reason == "stop"
    assert s.response_id == "chatcmpl-9b1c"
    assert s.text == "".join(PIECES)


@pytest.mark.parametrize("cls", CLASSES)
def test_text_not_collected_by_default(cls: Any) -> None:
    s = cls()
    s.feed(vllm_chat_stream(PIECES))
    assert s.text == ""
    assert s.tokens == len(PIECES)


@pytest.mark.parametrize("cls", CLASSES)
def test_reasoning_and_tool_calls_are_tokens(cls: Any) -> None:
    s = cls(collect_text=True)
    s.feed(event({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}))
    s.feed(event({"choices": [{"index": 0, "delta": {"reasoning": "so"}}]}))
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
    s.feed(event({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}))
    s.feed(event({"choices": [{"index": 0, "delta": {"tool_calls": []}}]}))
    s.feed(event({"choices": [{"index": 0, "delta": {"content": None, "reasoning": ""}}]}))
    assert (s.events, s.tokens) == (5, 3)
    assert s.text == ""  # reasoning is not the answer's text


@pytest.mark.parametrize("cls", CLASSES)
def test_only_choice_zero_text_is_collected(cls: Any) -> None:
    s = cls(collect_text=True)
    s.feed(event({"choices": [{"index": 1, "text": "B"}, {"index": 0, "text": "A"}]}))
    s.feed(event({"choices": [{"index": 0.0, "text": "x"}, {"text": "C"}]}))
    s.feed(event({"choices": [{"index": True, "text": "y"}, {"index": -0, "text": "D"}]}))
    assert s.text == "ACD"
    assert s.tokens == 3


@pytest.mark.parametrize("cls", CLASSES)
def test_error_event(cls: Any) -> None:
    s = cls()
    err = {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    s.feed(event({"id": "x", "choices": [{"index": 0, "text": "a"}]}) + event({"error": err}))
    assert s.error == err
    assert (s.events, s.tokens, s.done) == (2, 1, False)
    s.feed(event({"error": "not an object"}))
    assert s.error == err


@pytest.mark.parametrize("cls", CLASSES)
def test_first_id_and_last_finish_reason_and_usage(cls: Any) -> None:
    s = cls()
    s.feed(event({"id": 5, "choices": []}))
    assert s.response_id is None
    s.feed(event({"id": "first", "choices": [{"finish_reason": "length"}], "usage": {"a": 1}}))
    s.feed(event({"id": "second", "choices": [{"finish_reason": None}], "usage": None}))
    assert (s.response_id, s.finish_reason, s.usage) == ("first", "length", {"a": 1})
    s.feed(event({"choices": [{"finish_reason": "stop"}, {"finish_reason": "abort"}]}))
    assert s.finish_reason == "abort"


# --- framing (WHATWG "Interpreting an event stream") ------------------------------------

CHUNK = b'{"choices":[{"index":0,"text":"hi"}]}'


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("eol", [b"\n", b"\r", b"\r\n"])
def test_line_endings(cls: Any, eol: bytes) -> None:
    body = (b"data: " + CHUNK + eol + eol) * 3 + b"data: [DONE]" + eol + eol
    for step in (len(body), 1, 2, 3):
        s = cls()
        for i in range(0, len(body), step):
            s.feed(body[i : i + step])
        assert (s.events, s.tokens, s.done) == (3, 3, True), step


@pytest.mark.parametrize("cls", CLASSES)
def test_mixed_line_endings_and_cr_lf_split(cls: Any) -> None:
    s = cls()
    # CR then LF in the next chunk is one line end, not a blank line in between.
    assert s.feed(b"data: " + CHUNK + b"\r") == 0
    assert s.feed(b"\n") == 0
    assert s.feed(b"\r") == 1
    assert s.feed(b"\n") == 0  # the LF of that CRLF, not another blank line
    assert s.feed(b"data: " + CHUNK + b"\n\r\n") == 1
    assert (s.events, s.tokens) == (2, 2)


@pytest.mark.parametrize("cls", CLASSES)
def test_multiline_data_joins_with_newline(cls: Any) -> None:
    s = cls(collect_text=True)
    s.feed(b'data: {"choices":\ndata:[{"text":\ndata:  "a b"}]}\n\n')
    assert (s.events, s.tokens, s.text) == (1, 1, "a b")
    s.feed(b"data:[DO\ndata:NE]\n\n")  # "[DO\nNE]" is not the end marker
    assert (s.events, s.done) == (2, False)


@pytest.mark.parametrize("cls", CLASSES)
def test_space_after_colon(cls: Any) -> None:
    s = cls()
    s.feed(b"data:[DONE]\n\n")
    assert s.done
    s = cls()
    s.feed(b"data:  [DONE]\n\n")  # only one space is removed
    assert not s.done and s.events == 1


@pytest.mark.parametrize("cls", CLASSES)
def test_comments_and_other_fields(cls: Any) -> None:
    s = cls()
    body = (
        b": keep-alive\n\n"
        b":\n"
        b"event: message\nid: 7\nretry: 100\nfoo: bar\n\n"
        b"event: completion\n: comment in an event\ndata: " + CHUNK + b"\nid: 8\n\n"
        b"Data: " + CHUNK + b"\n\n"  # field names are case-sensitive
        b"data\n\n"  # a field with no colon: data with an empty value
    )
    assert s.feed(body) == 1
    assert (s.events, s.tokens) == (2, 1)


@pytest.mark.parametrize("cls", CLASSES)
def test_done_marker(cls: Any) -> None:
    s = cls()
    assert s.feed(b"data: [DONE]\n\n") == 0
    assert s.done and s.events == 0
    s = cls()
    s.feed(b"data: [DONE] \n\n")
    assert not s.done and s.events == 1


@pytest.mark.parametrize("cls", CLASSES)
def test_non_json_counts_as_event_not_token(cls: Any) -> None:
    s = cls()
    s.feed(b"data: hello\n\ndata: {broken\n\ndata: [1,2]\n\ndata: null\n\ndata: \xff\xfe\n\n")
    assert (s.events, s.tokens) == (5, 0)


@pytest.mark.parametrize("cls", CLASSES)
def test_unterminated_event_is_discarded_at_close(cls: Any) -> None:
    s = cls()
    s.feed(b"data: " + CHUNK + b"\n")  # no blank line yet
    assert s.events == 0
    s.close()
    assert s.events == 0
    s.close()  # idempotent
    with pytest.raises(ValueError, match="after close"):
        s.feed(b"\n")


@pytest.mark.parametrize("cls", CLASSES)
def test_bom_is_ignored_once(cls: Any) -> None:
    bom = b"\xef\xbb\xbf"
    for chunks in ([bom + b"data: [DONE]\n\n"], [b"\xef", b"\xbb", b"\xbfdata: [DONE]\n\n"]):
        s = cls()
        for c in chunks:
            s.feed(c)
        assert s.done
    s = cls()
    s.feed(bom + bom + b"data: [DONE]\n\n")  # the second BOM is part of the field name
    assert not s.done
    s = cls()
    s.feed(b"\xef\xbb")
    s.feed(b"data: [DONE]\n\n")  # not a BOM after all: the line is garbage
    assert not s.done and s.events == 0


@pytest.mark.parametrize("cls", CLASSES)
def test_invalid_utf8_is_replaced(cls: Any) -> None:
    s = cls(collect_text=True)
    s.feed(b'data: {"choices":[{"text":"a\xffb\xe2\x82"}]}\n\n')
    assert s.text == "a\ufffdb\ufffd"


# --- limits -----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES)
def test_oversize_event_raises(cls: Any) -> None:
    s = cls(max_event_bytes=100)
    assert s.feed(b"data: " + b"x" * 94 + b"\n\n") == 0  # exactly 100 bytes: fine
    with pytest.raises(SSEError, match="max_event_bytes=100"):
        s.feed(b"data: " + b"x" * 95 + b"\n\n")
    with pytest.raises(SSEError):  # and it stays failed
        s.feed(b"data: [DONE]\n\n")
    assert s.events == 1 and not s.done


@pytest.mark.parametrize("cls", CLASSES)
def test_oversize_counts_every_line_of_the_event(cls: Any) -> None:
    s = cls(max_event_bytes=50)
    s.feed(b": " + b"c" * 40 + b"\n")
    with pytest.raises(SSEError):
        s.feed(b"data: 12345678\n")


@pytest.mark.parametrize("cls", CLASSES)
def test_oversize_partial_line_raises_without_waiting(cls: Any) -> None:
    s = cls(max_event_bytes=1000)
    s.feed(b"data: ")
    with pytest.raises(SSEError):
        for _ in range(100):
            s.feed(b"y" * 100)  # a line that never ends must not grow without bound


def test_sse_error_is_value_error() -> None:
    assert issubclass(SSEError, ValueError)


@pytest.mark.parametrize("cls", CLASSES)
def test_bad_arguments(cls: Any) -> None:
    with pytest.raises(ValueError):
        cls(max_event_bytes=0)
    with pytest.raises(TypeError):
        cls().feed("data: x\n\n")
    s = cls()
    assert s.feed(bytearray(b"data: [DONE]\n\n")) == 0 and s.done
    s = cls()
    s.feed(memoryview(b"data: [DONE]\n\n"))
    assert s.done


# --- split anywhere ---------------------------------------------------------------------


def split_property(cls: Any, body: bytes, **kw: Any) -> None:
    whole = run(cls, [body], **kw)
    assert run(cls, [body[i : i + 1] for i in range(len(body))], **kw)[::2] == whole[::2]
    for i in range(len(body) + 1):
        st_, rets, err = run(cls, [body[:i], body[i:]], **kw)
        assert (st_, err) == (whole[0], whole[2]), i
        if err is None:
            assert sum(rets) == sum(whole[1])


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "body",
    [
        vllm_chat_stream(PIECES[:4]),
        vllm_completion_stream(PIECES[:4]).replace(b"\n", b"\r\n"),
        vllm_completion_stream(PIECES[:3]).replace(b"\n", b"\r"),
        b"\xef\xbb\xbf: hi\r\ndata: " + CHUNK + b"\r\rdata:x\n\ndata\r\n\r\n",
    ],
    ids=["chat-lf", "completion-crlf", "completion-cr", "mixed"],
)
def test_split_anywhere(cls: Any, body: bytes) -> None:
    split_property(cls, body, collect_text=True)


@pytest.mark.parametrize("cls", CLASSES)
def test_split_anywhere_with_oversize(cls: Any) -> None:
    body = event({"choices": [{"text": "a"}]}) + b"data: " + b"z" * 60 + b"\n\n" + event({})
    split_property(cls, body, max_event_bytes=50)


# --- twins ------------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["", "stop", "length", "\n", '"', "\\", "\u00e9", "\ud800", "\U0001f600"]),
)
KEYS = [
    "id",
    "choices",
    "usage",
    "error",
    "index",
    "text",
    "delta",
    "content",
    "reasoning_content",
    "reasoning",
    "tool_calls",
    "finish_reason",
    "object",
    "x",
]
json_value = st.recursive(
    json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=4)), kids, max_size=5),
    ),
    max_leaves=20,
)
choice = st.fixed_dictionaries(
    {},
    optional={
        "index": st.one_of(st.sampled_from([0, 1, -0, 0.0, True, None, "0"]), json_leaf),
        "text": st.one_of(st.text(max_size=6), json_value),
        "delta": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": st.just("assistant"),
                    "content": st.one_of(st.text(max_size=6), json_leaf),
                    "reasoning_content": st.one_of(st.text(max_size=3), json_leaf),
                    "reasoning": st.one_of(st.text(max_size=3), json_leaf),
                    "tool_calls": st.one_of(st.lists(json_value, max_size=2), json_leaf),
                },
            ),
            json_value,
        ),
        "finish_reason": st.one_of(st.sampled_from([None, "stop", "length"]), json_leaf),
        "logprobs": json_value,
    },
)
chunk_obj = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.text(max_size=8), json_leaf),
        "object": st.sampled_from(["chat.completion.chunk", "text_completion", "error"]),
        "choices": st.one_of(st.lists(st.one_of(choice, json_value), max_size=3), json_value),
        "usage": st.one_of(st.none(), st.just({"prompt_tokens": 1}), json_value),
        "error": st.one_of(st.none(), st.just({"message": "m"}), json_value),
        "model": st.text(max_size=4),
    },
)


def dumps(obj: Any, style: int) -> bytes:
    if style == 0:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    if style == 1:
        return json.dumps(obj).encode()
    return json.dumps(obj, indent=1).encode()  # multi-line JSON: several data lines


@st.composite
def sse_event_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(min_value=0, max_value=9))
    if kind <= 5:
        payload = dumps(draw(chunk_obj), draw(st.integers(min_value=0, max_value=2)))
        if kind == 5:  # corrupt it somewhere
            pos = draw(st.integers(min_value=0, max_value=len(payload)))
            junk = draw(st.binary(max_size=3))
            payload = payload[:pos] + junk + payload[pos + draw(st.integers(0, 2)) :]
    elif kind == 6:
        payload = dumps(draw(json_value), 0)
    elif kind == 7:
        payload = b"[DONE]"
    else:
        payload = draw(st.binary(max_size=30))
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    lines = payload.split(b"\n")
    out = b"".join(b"data:" + draw(st.sampled_from([b" ", b""])) + ln + eol for ln in lines)
    extra = draw(st.sampled_from([b"", b": ping" + eol, b"event: x" + eol, b"id: 1" + eol]))
    return extra + out + eol


sse_stream = st.one_of(
    st.lists(sse_event_bytes(), max_size=6).map(b"".join),
    st.binary(max_size=200),
    st.lists(
        st.sampled_from(
            [
                b"data:",
                b"data: ",
                b"\n",
                b"\r",
                b"\r\n",
                b":",
                b"[DONE]",
                b"{}",
                b'{"choices":[{"text":"a"}]}',
                b"\xef\xbb\xbf",
                b"x",
                b" ",
            ]
        ),
        max_size=40,
    ).map(b"".join),
)


def splits(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(body)) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(body[prev:p])
        prev = p
    out.append(body[prev:])
    return out


def lockstep(chunks: list[bytes], **kw: Any) -> None:
    """Both twins, fed the same chunks, agree after every feed(), raise alike."""
    assert compiled is not None
    a, b = pure.SSEScanner(**kw), compiled.SSEScanner(**kw)
    for c in chunks:
        ra = rb = ea = eb = None
        try:
            ra = a.feed(c)
        except SSEError as e:
            ea = str(e)
        try:
            rb = b.feed(c)
        except SSEError as e:
            eb = str(e)
        assert (ra, ea) == (rb, eb)
        assert state(a) == state(b)
        if ea is not None:
            break


@needs_compiled
@settings(max_examples=500, deadline=None)
@given(
    body=sse_stream,
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
    collect=st.booleans(),
    limit=st.sampled_from([1 << 20, 64, 7, 1]),
)
def test_twins_equal(body: bytes, cuts: list[int], collect: bool, limit: int) -> None:
    lockstep(splits(body, cuts), collect_text=collect, max_event_bytes=limit)


@needs_compiled
@settings(max_examples=150, deadline=None)
@given(body=sse_stream, collect=st.booleans())
def test_twins_equal_split_every_way(body: bytes, collect: bool) -> None:
    assert compiled is not None
    whole = run(pure.SSEScanner, [body], collect_text=collect)
    lockstep([body], collect_text=collect)
    lockstep([body[i : i + 1] for i in range(len(body))], collect_text=collect)
    for cls in (pure.SSEScanner, compiled.SSEScanner):
        assert (
            run(cls, [body[i : i + 1] for i in range(len(body))], collect_text=collect)[0]
            == (whole[0])
        )
        for i in range(0, len(body) + 1, max(1, len(body) // 16)):
            assert run(cls, [body[:i], body[i:]], collect_text=collect)[0] == whole[0]


@needs_compiled
def test_twins_equal_on_long_random_streams() -> None:
    rnd = random.Random(7)
    words = ["a", " b", "\n", '"', "\\", "\u00e9", "\U0001f600", "", "\x00", "\u2028"]
    pieces = ["".join(rnd.choice(words) for _ in range(rnd.randint(0, 4))) for _ in range(300)]
    for body in (vllm_chat_stream(pieces), vllm_completion_stream(pieces)):
        cuts = sorted(rnd.sample(range(len(body)), 200))
        for collect in (False, True):
            lockstep(splits(body, cuts), collect_text=collect)


DEEP = "[" * 100 + "]" * 100
EDGE_PAYLOADS: list[tuple[str, int, str]] = [
    # (data, tokens json.loads semantics give, text of choice 0)
    ('{"choices":[{"text":"a\tb"}]}', 0, ""),  # raw control character: strict JSON refuses
    ('{"choices":[{"text":"a"}],"n":1' + "0" * 5000 + "}", 0, ""),  # int over max digits
    ('{"choices":[{"text":"a"}],"n":1' + "0" * 40 + "}", 1, "a"),
    ('{"choices":[{"text":"a"}],"x":NaN,"y":-Infinity}', 1, "a"),
    ('{"choices":[{"text":"a"}],"choices":null}', 0, ""),  # the last duplicate wins
    ('{"choices":[{"text":""}],"choices":[{"text":"b"}]}', 1, "b"),
    ('{"choices":[{"text":"a","text":""}]}', 0, ""),
    ('{"choices":[{"delta":{"content":"a","content":7}}]}', 0, ""),
    ('{"choic\\u0065s":[{"t\\u0065xt":"a"}]}', 1, "a"),  # escaped keys
    ('{"choices":[{"text":"a\\n\\"\\u00e9\\ud800\\/"}]}', 1, 'a\n"\u00e9\ud800/'),
    ('{"choices":[{"text":"a\\x"}]}', 0, ""),  # not a JSON escape
    ('{"choices":[{"text":"\\u12"}]}', 0, ""),
    ('{"choices":[{"text":"a"},]}', 0, ""),  # trailing comma
    ('{"x":01,"choices":[{"text":"a"}]}', 0, ""),  # leading zero
    ('{"x":1.,"choices":[{"text":"a"}]}', 0, ""),
    ('{"x":-,"choices":[{"text":"a"}]}', 0, ""),
    ('{"x":1e5,"y":-0.5E-3,"choices":[{"index":-0,"text":"a"}]}', 1, "a"),
    ('{"choices":[{"index":0.0,"text":"a"},{"index":1e0,"text":"b"}]}', 1, ""),
    ('{"choices":[{"index":00,"text":"a"}]}', 0, ""),
    (' \t{ "choices" :\t[ { "text" : "a" } ] } \t', 1, "a"),
    ('{"choices":[{"text":"a"}]} x', 0, ""),  # extra data
    ('{"choices":[{"text":"a"}]}{}', 0, ""),
    ('{"x":' + DEEP + ',"choices":[{"text":"a"}]}', 1, "a"),  # deep but fine for json
    ('{"x":' + "[" * 100_000 + "]" * 100_000 + ',"choices":[{"text":"a"}]}', 0, ""),
    ('\ufeff{"choices":[{"text":"a"}]}', 0, ""),  # json.loads refuses a BOM
    ('{"choices":[{"text":"\u2028\u00e9"}]}', 1, "\u2028\u00e9"),
    ('{"choices":[{"text":"a"}],"usage":{"prompt_tokens":1},"error":null}', 1, "a"),
    ('{"choices":[{"text":"a"}],"usage":7}', 1, "a"),
    ('{"choices":{"text":"a"}}', 0, ""),
    ('{"choices":["a",{"text":"b"},null]}', 1, "b"),
    ('{"choices":[{"delta":{"tool_calls":[ ]}}]}', 0, ""),
    ('{"choices":[{"delta":{"tool_calls":[null]}}]}', 1, ""),
    ('{"choices":[{"delta":{"tool_calls":{"a":1}}}]}', 0, ""),
    ('{"choices":[{"text":"a"}]' + ', "k":"x"' * 20 + "}", 1, "a"),
    ('{"choices":[' + ",".join(['{"text":"a"}'] * 40) + "]}", 1, "a" * 40),
    ("[]", 0, ""),
    ('"text"', 0, ""),
    ("", 0, ""),
]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("data", "tokens", "text"), EDGE_PAYLOADS)
def test_json_edge_cases(cls: Any, data: str, tokens: int, text: str) -> None:
    s = cls(collect_text=True)
    # each "\n" of the payload becomes a data line of its own, as a server would send it
    body = b"".join(
        b"data: " + ln + b"\n" for ln in data.encode("utf-8", "surrogatepass").split(b"\n")
    )
    assert s.feed(body + b"\n") == tokens
    assert (s.events, s.tokens, s.text) == (1, tokens, text)
