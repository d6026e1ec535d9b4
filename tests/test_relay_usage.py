"""The relay's usage decode of a whole response (meshd/relay.py `_usage_of`): msgspec
builds only `usage`; the result must be what json.loads would find, for any body."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.relay import _usage_of


def _reference(body: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
_usage = st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**6)},
    optional={"prompt_tokens_details": st.fixed_dictionaries({"cached_tokens": st.integers()})},
)


@settings(max_examples=400)
@given(
    doc=st.one_of(
        _json,
        st.builds(
            lambda d, u: {**d, "usage": u},
            st.dictionaries(st.text(max_size=8), _json, max_size=4),
            _usage | _json,
        ),
    ),
    extra=st.sampled_from([b"", b" ", b"\n", b"x", b'{"usage":{}}']),
)
def test_usage_is_what_json_loads_finds(doc, extra):
    body = json.dumps(doc).encode() + extra
    assert _usage_of(body) == _reference(body)


def test_duplicate_keys_nan_and_non_objects_agree_with_json_loads():
    for body in (
        b'{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}',
        b'{"usage":{"prompt_tokens":NaN}}',
        b'[{"usage":{}}]',
        b'{"usage":[1]}',
        b"\xef\xbb\xbf{}",
        b"",
    ):
        assert _usage_of(body) == _reference(body), body
