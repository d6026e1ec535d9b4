"""The request body's parse has a compiled twin (filters/_request_c.pyx) beside the
reference (filters/request.py): for any body and kind, the same InferenceRequest (every
field, the parsed document too, the same frozen type) or the same RequestError (code,
message, param). The sidecar's request layer takes the compiled one when it is built."""

from __future__ import annotations

import dataclasses
import importlib
import json
import types
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from filters import hotpath
from filters import request as pure

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._request_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

needs_compiled = pytest.mark.skipif(
    compiled is None, reason="compiled twin filters._request_c not built (run make install)"
)
KINDS = ("completion", "chat", "embedding")


def outcome(parse: Any, kind: str, body: bytes) -> tuple[Any, ...]:
    """Comparable across the twins: the descriptor (its type, fields, and its document's
    repr, which tells 1 from 1.0 and True and shows key order) or the error."""
    try:
        r = parse(kind, body)
    except pure.RequestError as exc:
        return ("refused", type(exc), exc.code, exc.message, exc.param)
    except (RecursionError, ValueError) as exc:  # the stdlib's own (deep nesting, huge ints)
        return ("raised", type(exc).__name__)
    fields = tuple(
        (f.name, type(v := getattr(r, f.name)), v) for f in dataclasses.fields(r) if f.name != "doc"
    )
    return ("parsed", type(r), fields, repr(r.doc))


def assert_twins_agree(body: bytes) -> None:
    assert compiled is not None
    for kind in KINDS:
        ref = outcome(pure.parse_inference_request, kind, body)
        fast = outcome(compiled.parse_inference_request, kind, body)
        assert fast == ref, (kind, body[:300])


text = st.text(st.characters(exclude_categories=()) | st.characters(categories=["Cs"]), max_size=8)
count = st.integers(min_value=-3, max_value=2**70)
values = st.recursive(
    st.none() | st.booleans() | count | st.floats() | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=10,
)
# The compiled path's own shape (role and string or null content) most of the time, and
# every other shape the reference renders or refuses.
content = (
    text
    | st.none()
    | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text})
        | values,
        max_size=3,
    )
    | values
)
message = (
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", ""]) | values},
        optional={"content": content, "tool_calls": st.none() | values, "name": values},
    )
    | values
)
prompt = text | st.lists(count, min_size=0, max_size=3) | st.lists(text, max_size=3) | values
request = st.fixed_dictionaries(
    {},
    optional={
        "model": text | values,
        "prompt": prompt,
        "input": prompt,
        "messages": st.lists(message, max_size=3) | values,
        "max_tokens": st.none() | count | values,
        "max_completion_tokens": st.none() | count | values,
        "n": count | values,
        "stream": st.booleans() | values,
        "stream_options": st.none()
        | st.fixed_dictionaries({}, optional={"include_usage": values})
        | values,
        "temperature": values,
    },
)


def _encode(doc: Any) -> bytes:
    return json.dumps(doc).encode("utf-8", "surrogatepass")


@needs_compiled
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=request)
@example(doc={"model": "m", "prompt": "hi", "stream": True, "max_tokens": 5})
@example(doc={"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "x"}]})
@example(doc={"model": "m", "messages": [{"role": "user", "content": "a", "tool_calls": [1]}]})
@example(doc={"model": "m", "messages": [{"role": "user", "content": 5}, {"role": 3}]})
@example(doc={"model": "m", "prompt": "\ud800"})
@example(doc={"model": "m", "prompt": [1, 2], "n": True})
@example(doc={"model": "m", "input": "é", "stream_options": {"include_usage": [0]}})
def test_the_twins_agree_on_any_request_document(doc: dict[str, Any]) -> None:
    assert_twins_agree(_encode(doc))


@needs_compiled
@settings(max_examples=500, deadline=None)
@given(body=st.binary(max_size=64) | values.map(_encode))
@example(body=b"")
@example(body=b"[]")
@example(body=b'{"model": "m", "model": 1, "prompt": "x"}')
@example(body=b'{"model": "m", "prompt": "x", "max_tokens": NaN}')
@example(body=b'\xef\xbb\xbf{"model": "m", "prompt": "x"}')
def test_the_twins_agree_on_any_bytes(body: bytes) -> None:
    assert_twins_agree(body)


@needs_compiled
def test_the_compiled_parse_gives_the_frozen_descriptor() -> None:
    assert compiled is not None
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}'
    r = compiled.parse_inference_request("chat", body)
    assert isinstance(r, pure.InferenceRequest)
    assert (r.kind, r.model, r.prompt_text, r.max_tokens, r.stream, r.include_usage, r.n) == (
        "chat",
        "m",
        "<|user|>hi\n",
        3,
        False,
        False,
        1,
    )
    assert r.doc == json.loads(body)
    ref = pure.parse_inference_request("chat", body)
    assert r == ref and hash(r) == hash(ref)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.model = "other"  # type: ignore[misc]


def test_the_request_layer_takes_the_compiled_parse_when_built() -> None:
    if hotpath.IMPLEMENTATION == "cython":
        assert compiled is not None
        assert hotpath.parse_inference_request is compiled.parse_inference_request
    else:
        assert hotpath.parse_inference_request is pure.parse_inference_request
