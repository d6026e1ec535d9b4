"""The compiled SSE scanner's template path (filters/_sse_c.pyx, SSEScanner._from_template):
an event that repeats the last exactly-read event with another string in its one "text" or
"content" slot is read without the skim. Streams built that way, with any string (or any
bytes) in the slot and any change around it, must give the pure twin's state after every
feed(), however the reads are cut."""

from __future__ import annotations

import importlib
import json
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters import sse as pure
from tests.test_sse import json_leaf, json_value, lockstep, run, splits

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._sse_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

pytestmark = pytest.mark.skipif(compiled is None, reason="filters._sse_c not built")

MARK = "\x00slot\x00"  # json.dumps writes it as "\u0000slot\u0000": found once, then cut out
MARK_JSON = json.dumps(MARK).encode()


def data_event(payload: bytes, eol: bytes = b"\n") -> bytes:
    return b"".join(b"data: " + ln + eol for ln in payload.split(b"\n")) + eol


def template(obj: Any, style: int) -> tuple[bytes, bytes]:
    """The bytes before and after the slot of `obj` dumped in `style` (the marker's place)."""
    if style == 0:
        raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")
    elif style == 1:
        raw = json.dumps(obj).encode()
    else:
        raw = json.dumps(obj, indent=1).encode()  # several data lines, joined by LF
    before, _, after = raw.partition(MARK_JSON)
    return before, after


other_choice = st.fixed_dictionaries(
    {"index": st.sampled_from([1, 2])},
    optional={
        "delta": st.fixed_dictionaries(
            {},
            optional={
                "reasoning_content": st.one_of(st.text(max_size=2), json_leaf),
                "tool_calls": st.one_of(st.lists(json_value, max_size=1), json_leaf),
                "role": st.just("assistant"),
            },
        ),
        "finish_reason": st.one_of(st.none(), st.just("stop")),
    },
)


@st.composite
def slotted_event(draw: st.DrawFn) -> Any:
    """A vLLM/SGLang-like chunk with the marker as its one text or delta.content value."""
    in_delta = draw(st.booleans())
    choice: dict[str, Any] = {
        "index": draw(st.one_of(st.sampled_from([0, 1, -0, 0.0, None, "0"]), json_leaf)),
    }
    if in_delta:
        delta: dict[str, Any] = {"content": MARK}
        for key in draw(st.lists(st.sampled_from(["role", "reasoning_content", "tool_calls"]))):
            delta[key] = draw(
                st.one_of(st.none(), st.text(max_size=2), st.lists(json_value, max_size=1))
            )
        choice["delta"] = delta
    else:
        choice["text"] = MARK
    choice["logprobs"] = None
    choice["finish_reason"] = draw(st.one_of(st.none(), st.sampled_from(["stop", "length"])))
    if draw(st.booleans()):
        choice["stop_reason"] = None
    items = list(choice.items())
    choice = dict(draw(st.permutations(items)))
    choices = [choice, *draw(st.lists(other_choice, max_size=2))]
    top: dict[str, Any] = {
        "id": draw(st.one_of(st.just("chatcmpl-5d0e8a"), st.text(max_size=4), json_leaf)),
        "object": "chat.completion.chunk",
        "created": 1718000000,
        "model": draw(st.sampled_from(["m", "meta-llama/Llama-3.1-8B-Instruct"])),
        "choices": draw(st.permutations(choices)),
    }
    if draw(st.booleans()):
        top["usage"] = draw(st.one_of(st.none(), st.just({"prompt_tokens": 1})))
    return dict(draw(st.permutations(list(top.items()))))


slot_string = st.one_of(
    st.text(max_size=6).map(lambda s: json.dumps(s).encode()),
    st.text(max_size=6).map(lambda s: json.dumps(s, ensure_ascii=False).encode("utf-8", "replace")),
    st.binary(max_size=6).map(lambda b: b'"' + b + b'"'),
    st.sampled_from(
        [
            b'""',
            b'"\\"',
            b'"\\\\"',
            b'"\\u12"',
            b'"\\ud800"',
            b'"\\x"',
            b'"\t"',
            b'"a"b"',
            b'"a","text":"b"',
            b'"a","content":"b"',
            b'"a"}],"choices":[{"text":"b"',
            b"null",
            b"7",
            b'"',
            b"",
            b'"\n"',
            b'"\xff"',
        ]
    ),
    st.binary(max_size=6),
)


@st.composite
def templated_stream(draw: st.DrawFn) -> bytes:
    """One slotted event, then events that are it with other slot strings, with now and
    then a changed event (another template, or the tail or head changed)."""
    style = draw(st.integers(min_value=0, max_value=2))
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    before, after = template(draw(slotted_event()), style)
    out = [data_event(before + draw(slot_string) + after, eol)]
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        kind = draw(st.integers(min_value=0, max_value=9))
        if kind == 0:
            before, after = template(draw(slotted_event()), style)
        elif kind == 1 and after:
            cut = draw(st.integers(min_value=0, max_value=len(after) - 1))
            after = after[:cut] + draw(st.binary(max_size=2)) + after[cut + 1 :]
        elif kind == 2 and before:
            cut = draw(st.integers(min_value=0, max_value=len(before) - 1))
            before = before[:cut] + draw(st.binary(max_size=2)) + before[cut + 1 :]
        elif kind == 3:
            out.append(data_event(b"[DONE]", eol))
        out.append(data_event(before + draw(slot_string) + after, eol))
    return b"".join(out)


@settings(max_examples=400, deadline=None)
@given(
    body=templated_stream(),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=8),
    collect=st.booleans(),
)
def test_twins_equal_on_templated_streams(body: bytes, cuts: list[int], collect: bool) -> None:
    lockstep(splits(body, cuts), collect_text=collect)
    lockstep([body], collect_text=collect)


@settings(max_examples=60, deadline=None)
@given(body=templated_stream(), collect=st.booleans())
def test_templated_streams_split_every_way(body: bytes, collect: bool) -> None:
    assert compiled is not None
    whole = run(pure.SSEScanner, [body], collect_text=collect)
    for cls in (pure.SSEScanner, compiled.SSEScanner):
        assert run(cls, [body], collect_text=collect)[::2] == whole[::2]
        for i in range(0, len(body) + 1, max(1, len(body) // 12)):
            assert run(cls, [body[:i], body[i:]], collect_text=collect)[0] == whole[0]


HEAD = b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
FINISH = b',"finish_reason":"stop"}]}'


@pytest.mark.parametrize(
    ("events", "tokens", "text", "finish"),
    [
        # the finish reason after the slot moves with the slot's length
        ([HEAD + b'"text":' + t + FINISH for t in (b'"a"', b'"bcd"', b'""')], 2, "abcd", "stop"),
        # a string that ends early and a second text: the last duplicate wins (json.loads)
        ([HEAD + b'"text":"a"}]}', HEAD + b'"text":"x","text":""}]}'], 1, "a", None),
        ([HEAD + b'"text":"a"}]}', HEAD + b'"text":"x\\u00e9\\n"}]}'], 2, "ax\u00e9\n", None),
        ([HEAD + b'"text":"a"}]}', HEAD + b'"text":"x\\q"}]}'], 1, "a", None),  # bad escape
        ([HEAD + b'"text":"a"}]}', HEAD + b'"text":"\x01"}]}'], 1, "a", None),  # control byte
        ([HEAD + b'"text":"a"}]}', HEAD + b'"text":"\xff"}]}'], 2, "a\ufffd", None),
        ([HEAD + b'"text":"a"}]}', HEAD + b'"text":7}]}'], 1, "a", None),
        # another choice's reasoning makes every event token-bearing, empty slot or not
        (
            [
                b'{"choices":[{"index":1,"delta":{"reasoning_content":"r"}},{"index":0,"delta":'
                b'{"content":' + t + b"}}]}"
                for t in (b'"a"', b'""', b'"b"')
            ],
            3,
            "ab",
            None,
        ),
        # a slot in choice 1 counts but is not collected
        ([b'{"choices":[{"index":1,"text":' + t + b"}]}" for t in (b'"a"', b'"b"')], 2, "", None),
    ],
)
def test_template_cases(events: list[bytes], tokens: int, text: str, finish: str | None) -> None:
    assert compiled is not None
    body = b"".join(data_event(e) for e in events)
    for cls in (pure.SSEScanner, compiled.SSEScanner):
        s = cls(collect_text=True)
        assert s.feed(body) == tokens
        assert (s.events, s.tokens, s.text, s.finish_reason) == (
            len(events),
            tokens,
            text,
            finish,
        )
    lockstep([body], collect_text=True)
