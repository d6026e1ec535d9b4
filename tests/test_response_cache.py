"""The response cache's rules (filters/response_cache.py): which requests, the key, the
records and their replay in either form, and the memory store's bounds."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.response_cache import (
    CacheControl,
    CachedAnswer,
    MemoryStore,
    answer_from_stream,
    answer_from_whole,
    cache_key,
    decide,
    decode_answer,
    encode_answer,
    is_deterministic,
    parse_cache_control,
    render,
    sse_data,
)

# -- which requests ------------------------------------------------------------------------


def test_cache_control_directives_merge_and_ignore_what_they_do_not_know() -> None:
    cc = parse_cache_control(["No-Cache, max-age=60", 'max-age="30", x-thing=1, only-if-cached'])
    assert cc == CacheControl(no_store=False, no_cache=True, only_if_cached=True, max_age_s=30.0)
    assert parse_cache_control([]) == CacheControl()
    assert parse_cache_control(["max-age=-5, max-age=abc, max-age=٣"]).max_age_s is None
    assert parse_cache_control(["no-store"]).no_store


@given(st.lists(st.text(max_size=80), max_size=4))
def test_any_cache_control_value_parses_without_error(values: list[str]) -> None:
    cc = parse_cache_control(values)
    assert cc.max_age_s is None or cc.max_age_s >= 0


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0, "n": 1}, True),
        ({"seed": 7, "temperature": 0.9}, True),
        ({}, False),  # the default temperature samples
        ({"temperature": 0.7}, False),
        ({"temperature": 0, "n": 2}, False),
        ({"temperature": 0, "best_of": 3}, False),
        ({"temperature": 0, "use_beam_search": True}, False),
        ({"seed": True}, False),
        ({"temperature": False}, False),
    ],
)
def test_deterministic_means_greedy_or_seeded_with_one_choice(
    doc: dict[str, Any], expected: bool
) -> None:
    assert is_deterministic(doc) is expected


def test_the_pool_rule_and_the_clients_directives_decide() -> None:
    greedy, sampled = {"temperature": 0}, {"temperature": 1}
    none = CacheControl()
    assert decide(greedy, "deterministic", none).lookup
    assert not decide(sampled, "deterministic", none).cacheable
    assert not decide(greedy, "opt-in", none).cacheable
    assert not decide(greedy, "off", CacheControl(max_age_s=60)).cacheable
    opted = decide(sampled, "opt-in", CacheControl(max_age_s=60))
    assert opted.lookup and opted.store and opted.max_age_s == 60
    assert not decide(greedy, "deterministic", CacheControl(no_store=True)).cacheable
    refresh = decide(greedy, "deterministic", CacheControl(no_cache=True))
    assert refresh.store and not refresh.lookup
    assert decide(sampled, "deterministic", CacheControl(only_if_cached=True)).only_if_cached
    assert not decide({"temperature": 0, "n": 3}, "opt-in", CacheControl(max_age_s=9)).cacheable
    assert not decide(sampled, "opt-in", CacheControl(max_age_s=0)).cacheable


# -- the key -------------------------------------------------------------------------------

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def test_transport_only_fields_do_not_change_the_key() -> None:
    k = cache_key("chat", "t", [""], BASE)
    assert cache_key("chat", "t", [""], {**BASE, "stream": True}) == k
    assert cache_key("chat", "t", [""], {**BASE, "user": "u"}) == k
    assert cache_key("chat", "t", [""], {**BASE, "stream_options": {"include_usage": True}}) == k
    assert (
        cache_key("chat", "t", [""], {**BASE, "stream_options": {"continuous_usage_stats": True}})
        != k
    )


def test_what_changes_the_answer_or_the_caller_changes_the_key() -> None:
    k = cache_key("chat", "t", [""], BASE)
    assert cache_key("chat", "u", [""], BASE) != k  # another tenant
    assert cache_key("chat", "t", ["Bearer other"], BASE) != k  # another API key
    assert cache_key("completion", "t", [""], BASE) != k
    assert cache_key("chat", "t", [""], {**BASE, "model": "m:lora-a"}) != k
    assert cache_key("chat", "t", [""], {**BASE, "max_tokens": 5}) != k
    assert cache_key("chat", "t", [""], {**BASE, "seed": 1}) != k
    assert cache_key("chat", None, [""], BASE) == cache_key("chat", "", [""], BASE)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=6), st.randoms())
def test_the_key_ignores_the_order_of_keys(doc: dict[str, Any], rnd: random.Random) -> None:
    def shuffled(v: Any) -> Any:
        if isinstance(v, dict):
            items = list(v.items())
            rnd.shuffle(items)
            return {k: shuffled(x) for k, x in items}
        if isinstance(v, list):
            return [shuffled(x) for x in v]
        return v

    assert cache_key("chat", "t", [], doc) == cache_key("chat", "t", [], shuffled(doc))


# -- records and replay --------------------------------------------------------------------

USAGE = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def chat_stream(
    pieces: list[str], *, usage: bool = True, done: bool = True, logprobs: Any = None
) -> bytes:
    """A vLLM chat stream (compact JSON, as vLLM writes it)."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> Any:
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**head, "choices": [choice]}

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": p}, lp=logprobs) for p in pieces]
    out.append(chunk({"content": ""}, "stop"))
    if usage:
        out.append({**head, "choices": [], "usage": USAGE})
    raw = b"".join(b"data: " + compact(o) + b"\n\n" for o in out)
    return raw + (b"data: [DONE]\n\n" if done else b"")


def compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def chat_whole(text: str, **message: Any) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-2",
            "object": "chat.completion",
            "created": 6,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": [], **message},
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ],
            "usage": USAGE,
        }
    ).encode()


def events(raw: bytes) -> list[Any]:
    return [d.decode() if d == b"[DONE]" else json.loads(d) for d in sse_data(raw)]


def test_a_stream_replays_as_the_engine_sent_it_with_usage_only_when_asked() -> None:
    raw = chat_stream(["Hel", "lo", "!"])
    a = answer_from_stream("chat", raw, 100.0)
    assert a is not None and a.usage == USAGE
    assert render(a, stream=True, include_usage=True) == raw  # byte for byte
    without = render(a, stream=True, include_usage=False)
    assert without is not None
    assert [e for e in events(raw) if e == "[DONE]" or e["choices"]] == events(without)


def test_a_stream_record_answers_a_whole_request_and_the_reverse() -> None:
    a = answer_from_stream("chat", chat_stream(["Hel", "lo", "!"]), 0.0)
    assert a is not None
    whole = render(a, stream=False, include_usage=False)
    assert whole is not None
    doc = json.loads(whole)
    assert doc["object"] == "chat.completion" and doc["id"] == "chatcmpl-1"
    assert doc["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}
    assert doc["choices"][0]["finish_reason"] == "stop" and doc["usage"] == USAGE

    w = answer_from_whole("chat", chat_whole("Hello!"), 0.0)
    assert w is not None and render(w, stream=False, include_usage=False) == chat_whole("Hello!")
    streamed = render(w, stream=True, include_usage=True)
    assert streamed is not None
    evs = events(streamed)
    assert evs[-1] == "[DONE]" and evs[-2]["usage"] == USAGE and evs[-2]["choices"] == []
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in evs[:-2])
    assert text == "Hello!" and evs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in evs[:-1])
    assert evs[-3]["choices"][0]["finish_reason"] == "stop"


def test_answers_that_are_not_plain_text_replay_only_in_their_own_form() -> None:
    tools = chat_whole("", tool_calls=[{"id": "c", "type": "function", "function": {}}])
    w = answer_from_whole("chat", tools, 0.0)
    assert w is not None
    assert render(w, stream=False, include_usage=False) == tools
    assert render(w, stream=True, include_usage=False) is None
    logprobs = chat_stream(["a"], logprobs={"content": []})
    s = answer_from_stream("chat", logprobs, 0.0)
    assert s is not None and render(s, stream=False, include_usage=False) is None


def test_a_stream_without_usage_cannot_answer_who_asks_for_usage() -> None:
    a = answer_from_stream("chat", chat_stream(["x"], usage=False), 0.0)
    assert a is not None and a.usage is None
    assert render(a, stream=True, include_usage=True) is None
    assert render(a, stream=False, include_usage=False) is None
    assert render(a, stream=True, include_usage=False) is not None


def test_broken_streams_and_errors_are_not_answers() -> None:
    assert answer_from_stream("chat", chat_stream(["x"], done=False), 0.0) is None
    err = b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    assert answer_from_stream("chat", chat_stream(["x"])[:-16] + err, 0.0) is None
    assert answer_from_stream("chat", b"data: [DONE]\n\n", 0.0) is None
    assert answer_from_stream("chat", chat_stream(["x"]) + b"data: {}\n\n", 0.0) is None
    assert answer_from_whole("chat", b'{"error": {"message": "no"}}', 0.0) is None
    assert answer_from_whole("chat", b"not json", 0.0) is None


def test_a_completion_stream_converts_too() -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    parts = [
        {**head, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": f}]}
        for t, f in (("a", None), ("b", "length"))
    ]
    parts.append({**head, "choices": [], "usage": USAGE})
    raw = b"".join(b"data: " + compact(p) + b"\r\n\r\n" for p in parts)
    raw += b"data: [DONE]\r\n\r\n"
    a = answer_from_stream("completion", raw, 0.0)
    assert a is not None
    doc = json.loads(render(a, stream=False, include_usage=False) or b"")
    assert doc["choices"][0]["text"] == "ab" and doc["choices"][0]["finish_reason"] == "length"


@given(st.binary(max_size=400), st.booleans(), st.booleans())
@settings(max_examples=300)
def test_any_bytes_are_a_record_or_none_and_replay_without_error(
    raw: bytes, stream: bool, include_usage: bool
) -> None:
    for make in (answer_from_stream, answer_from_whole):
        a = make("chat", raw, 0.0)
        if a is not None:
            render(a, stream=stream, include_usage=include_usage)


@given(
    st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=6),
    st.integers(min_value=1, max_value=40),
)
def test_a_stream_split_anywhere_replays_the_same_text(pieces: list[str], cut: int) -> None:
    raw = chat_stream(pieces)
    a = answer_from_stream("chat", raw[:cut] + raw[cut:], 0.0)
    assert a is not None
    doc = json.loads(render(a, stream=False, include_usage=False) or b"")
    assert doc["choices"][0]["message"]["content"] == "".join(pieces)


def test_records_survive_the_wire_and_garbage_does_not_decode() -> None:
    a = CachedAnswer("chat", True, b"data: x\n\n", USAGE, 12.5, 0.25, 0.001)
    assert decode_answer(encode_answer(a)) == a
    assert decode_answer(b"\x00garbage") is None


# -- the memory store ----------------------------------------------------------------------


def answer(size: int, at: float = 0.0) -> CachedAnswer:
    return CachedAnswer("chat", False, b"x" * size, None, at)


def test_the_store_keeps_the_recently_used_within_its_bytes() -> None:
    s = MemoryStore(max_bytes=3 * (1000 + 256 + 1), ttl_s=60)
    for k in "abc":
        assert s.put(k, answer(1000))
    assert s.get("a", 1.0) is not None  # a is now the most recent
    s.put("d", answer(1000))
    assert s.get("b", 1.0) is None and s.get("a", 1.0) is not None and s.evictions == 1
    assert s.bytes <= s.max_bytes and len(s) == 3
    assert not s.put("huge", answer(10_000))


def test_the_store_expires_by_ttl_and_serves_only_young_enough_answers() -> None:
    s = MemoryStore(max_bytes=1 << 20, ttl_s=10)
    s.put("k", answer(10, at=100.0))
    assert s.get("k", 105.0, max_age_s=3) is None  # too old for this client
    assert s.get("k", 105.0) is not None  # not for another
    assert s.get("k", 110.0) is None and s.expired == 1 and s.bytes == 0


@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.integers(0, 3000)), max_size=60))
def test_the_store_accounts_its_bytes_exactly(ops: list[tuple[str, int]]) -> None:
    s = MemoryStore(max_bytes=8000, ttl_s=60)
    for key, size in ops:
        s.put(key, answer(size))
        held = [(k, s._entries[k]) for k in s._entries]
        assert s.bytes == sum(a.size + len(k) for k, a in held) <= s.max_bytes
