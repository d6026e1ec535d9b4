"""Parsing OpenAI-compatible bodies into InferenceRequest."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filters.request import RequestError, parse_inference_request, render_messages


def test_completion_fields():
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = parse_inference_request("completion", json.dumps(body).encode())
    assert (r.model, r.prompt_text, r.max_tokens, r.stream, r.include_usage) == (
        "m",
        "hi",
        7,
        True,
        True,
    )


def test_chat_prefers_max_completion_tokens():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "q"}],
        "max_completion_tokens": 5,
        "max_tokens": 9,
    }
    assert parse_inference_request("chat", json.dumps(body).encode()).max_tokens == 5


def test_chat_rendering_of_history_is_a_prefix_of_the_next_turn():
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]
    nxt = [*history, {"role": "user", "content": "q2"}]
    assert render_messages(nxt).startswith(render_messages(history))
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert render_messages(parts) == "<|user|>ab\n"


@pytest.mark.parametrize(
    ("prompt", "text"),
    [("s", "s"), (["first", "second"], "first"), ([1, 2, 3], "1 2 3"), ([[4, 5], [6]], "4 5")],
)
def test_prompt_shapes(prompt, text):
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert parse_inference_request("completion", body).prompt_text == text


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completion", b"", None),
        ("completion", b"[1]", None),
        ("completion", b'{"prompt": "x"}', "model"),
        ("completion", b'{"model": "m"}', "prompt"),
        ("completion", b'{"model": "m", "prompt": "x", "max_tokens": -1}', "max_tokens"),
        ("completion", b'{"model": "m", "prompt": "x", "max_tokens": true}', "max_tokens"),
        ("completion", b'{"model": "m", "prompt": "x", "stream": "yes"}', "stream"),
        ("completion", b'{"model": "m", "prompt": [1, "a"]}', "prompt"),
        ("chat", b'{"model": "m", "messages": []}', "messages"),
        ("chat", b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role"),
        ("embedding", b'{"model": "m"}', "input"),
    ],
)
def test_errors_name_the_field(kind, body, param):
    with pytest.raises(RequestError) as err:
        parse_inference_request(kind, body)
    assert err.value.param == param


@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_request_error(data):
    for kind in ("completion", "chat", "embedding"):
        try:
            parse_inference_request(kind, data)
        except RequestError as exc:
            assert exc.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(
    st.dictionaries(
        st.sampled_from(
            [
                "model",
                "prompt",
                "messages",
                "max_tokens",
                "stream",
                "n",
                "input",
                "stream_options",
                "max_completion_tokens",
            ]
        ),
        json_values,
    )
)
def test_any_json_object_parses_or_raises_request_error(doc):
    body = json.dumps(doc).encode()
    for kind in ("completion", "chat", "embedding"):
        try:
            r = parse_inference_request(kind, body)
        except RequestError:
            continue
        assert isinstance(r.prompt_text, str) and r.model


def test_bodies_that_break_the_decoder_itself_are_a_400_not_a_crash():
    # Nesting past the recursion limit, and an integer past sys.get_int_max_str_digits():
    # both raised out of the parser (a 500) before; now a RequestError (400) says why.
    deep = b"[" * 5000 + b"]" * 5000
    huge = b'{"model":"m","prompt":"a","max_tokens":' + b"9" * 5000 + b"}"
    with pytest.raises(RequestError, match="nests too deeply"):
        parse_inference_request("completion", deep)
    with pytest.raises(RequestError, match="4300 digits"):
        parse_inference_request("completion", huge)
