"""Mid-stream failover (filters/failover.py): continuation bodies, the recorder's framing,
the splicer's rewriting, and the end-to-end property that a stream killed at a random
point and continued elsewhere gives the client exactly the uninterrupted output."""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.failover import (
    FailoverUnsupported,
    StreamRecorder,
    StreamSplicer,
    continuation_body,
    failover_refusal,
    remaining_tokens,
)

# -- a tiny deterministic engine ---------------------------------------------------------
# The next token is a pure function of the whole text so far, so an engine resumed from
# prompt + partial output produces exactly the rest of the output. Tokens start with a
# space and hold none inside, so counting tokens with str.split() is additive at the seam.

VOCAB = (" alpha", " beta", " gamma", " delta", " eps", " zeta", " eta", " theta", " iota")


def _next_token(context: str) -> str | None:
    h = zlib.crc32(context.encode())
    if h % 17 == 0:
        return None  # end of sequence
    return VOCAB[(h >> 8) % len(VOCAB)]


def _count(text: str) -> int:
    return len(text.split())


def _render(messages: list[dict[str, Any]], add_generation_prompt: bool, cont: bool) -> str:
    """A chat template with vLLM/HF semantics: continue_final_message leaves the last
    message open (no end marker); add_generation_prompt opens an assistant turn."""
    assert not (add_generation_prompt and cont)
    parts = []
    for i, m in enumerate(messages):
        parts.append(f"<|{m['role']}|>{m['content']}")
        if not (cont and i == len(messages) - 1):
            parts.append("<|end|>")
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return "".join(parts)


def serve(kind: str, body: dict[str, Any], engine: int) -> bytes:
    """The SSE bytes a vLLM-like engine streams for `body` (stream: true)."""
    if kind == "completion":
        context = body["prompt"]
        limit = body.get("max_tokens")
    else:
        context = _render(
            body["messages"],
            body.get("add_generation_prompt", True),
            body.get("continue_final_message", False),
        )
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
    prompt_tokens = _count(context)
    tokens: list[str] = []
    finish = "stop"
    while True:
        if limit is not None and len(tokens) >= limit:
            finish = "length"
            break
        tok = _next_token(context + "".join(tokens))
        if tok is None:
            break
        tokens.append(tok)
    opts = body.get("stream_options") or {}
    continuous = bool(opts.get("continuous_usage_stats"))
    base = {"id": f"resp-{engine}", "created": 1000 + engine, "model": body["model"]}
    if kind == "chat":
        base["object"] = "chat.completion.chunk"
    else:
        base["object"] = "text_completion"
    events: list[dict[str, Any]] = []

    def usage(n: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
        }

    if kind == "chat":
        first = {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if continuous:
            first["usage"] = usage(0)
        events.append(first)
    if not tokens:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice["delta" if kind == "chat" else "text"] = {} if kind == "chat" else ""
        events.append({**base, "choices": [choice]})
    for i, tok in enumerate(tokens):
        last = i == len(tokens) - 1
        choice = {"index": 0, "logprobs": None, "finish_reason": finish if last else None}
        choice.update({"delta": {"content": tok}} if kind == "chat" else {"text": tok})
        ev: dict[str, Any] = {**base, "choices": [choice]}
        if continuous:
            ev["usage"] = usage(i + 1)
        events.append(ev)
    if opts.get("include_usage"):
        events.append({**base, "choices": [], "usage": usage(len(tokens))})
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + b"data: [DONE]\n\n"


def parse_client(kind: str, raw: bytes) -> dict[str, Any]:
    """What an OpenAI client makes of the stream."""
    ids, created, roles, text, finish, usage, done = set(), set(), 0, [], None, None, 0
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        assert block.startswith(b"data: "), block
        data = block[6:]
        if data == b"[DONE]":
            done += 1
            continue
        obj = json.loads(data)
        ids.add(obj["id"])
        created.add(obj["created"])
        if obj.get("usage") and not obj["choices"]:
            usage = obj["usage"]
        for ch in obj["choices"]:
            if kind == "chat":
                roles += "role" in ch["delta"]
                text.append(ch["delta"].get("content") or "")
            else:
                text.append(ch["text"])
            if ch["finish_reason"] is not None:
                finish = ch["finish_reason"]
    return {
        "ids": ids,
        "created": created,
        "roles": roles,
        "text": "".join(text),
        "finish": finish,
        "usage": usage,
        "done": done,
    }


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunks(data: bytes, sizes: list[int]) -> list[bytes]:
    out, pos, i = [], 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)] if sizes else len(data)
        out.append(data[pos : pos + n])
        pos += n
        i += 1
    return out


def _body(
    kind: str, prompt: str, max_tokens: int | None, usage: bool, continuous: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "stream": True}
    if usage or continuous:
        body["stream_options"] = {"include_usage": usage, "continuous_usage_stats": continuous}
    if kind == "completion":
        body["prompt"] = prompt
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
    else:
        body["messages"] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": prompt},
        ]
        if max_tokens is not None:
            body["max_completion_tokens"] = max_tokens
    return body


def _finish_offset(stream: bytes) -> int:
    """Byte offset where the event carrying finish_reason ends."""
    pos = 0
    for block in stream.split(b"\n\n"):
        pos += len(block) + 2
        if b'"finish_reason": "' in block:
            return pos
    raise AssertionError("no finish event")


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["completion", "chat"]),
    prompt=st.text(alphabet="abc xyz", max_size=30),
    max_tokens=st.one_of(st.none(), st.integers(1, 40)),
    usage=st.booleans(),
    continuous=st.booleans(),
    cuts=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 97), min_size=1, max_size=4),
)
def test_killed_streams_splice_to_the_uninterrupted_output(
    kind: str,
    prompt: str,
    max_tokens: int | None,
    usage: bool,
    continuous: bool,
    cuts: list[float],
    sizes: list[int],
) -> None:
    body = _body(kind, prompt, max_tokens, usage, continuous)
    expected = parse_client(kind, serve(kind, body, engine=0))
    rec = StreamRecorder(kind)  # type: ignore[arg-type]
    client = bytearray()
    splicer: StreamSplicer | None = None
    engine = 1
    stream = serve(kind, body, engine)
    for cut_at in [*cuts, None]:
        # Deliver a prefix of this attempt's stream (cut strictly before its finish event,
        # anywhere, even mid-event), then the upstream dies; the last attempt completes.
        end = len(stream) if cut_at is None else int(cut_at * _finish_offset(stream))
        for chunk in _chunks(stream[:end], sizes):
            out = chunk if splicer is None else splicer.feed(chunk)
            client += rec.feed(out)
        if cut_at is None:
            if splicer is not None:
                client += rec.feed(splicer.close())
            client += rec.close()
            break
        assert not rec.finished
        rec.discard_partial()
        splicer = StreamSplicer.after(rec, include_usage=usage)
        try:
            cont = continuation_body(kind, body, rec.text, rec.tokens)  # type: ignore[arg-type]
        except FailoverUnsupported as exc:
            assert "max_tokens" in str(exc)
            client += rec.feed(splicer.synthesize_end("length"))
            break
        engine += 1
        stream = serve(kind, cont, engine)
    got = parse_client(kind, bytes(client))
    assert got["text"] == expected["text"]
    assert got["finish"] == expected["finish"]
    assert got["done"] == 1
    assert got["usage"] == (expected["usage"] if usage else None)
    if got["ids"]:
        # One stream identity: the first attempt's, unless it died before its first event.
        assert len(got["ids"]) == 1 and len(got["created"]) == 1
    if kind == "chat":
        assert got["roles"] == 1


def test_continuation_of_a_completion() -> None:
    body = {"model": "m", "prompt": "Once", "max_tokens": 10, "min_tokens": 4, "stream": True}
    out = continuation_body("completion", body, " upon a", 2)
    assert out["prompt"] == "Once upon a"
    assert out["max_tokens"] == 8 and out["min_tokens"] == 2
    assert out["stream_options"] == {"include_usage": True}
    assert body["prompt"] == "Once" and "stream_options" not in body  # not mutated
    assert (
        continuation_body("completion", {"model": "m", "prompt": ["P"]}, "x", 1)["prompt"] == "Px"
    )


def test_continuation_of_a_chat_appends_the_partial_assistant_message() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": msgs, "max_tokens": 50, "max_completion_tokens": 40}
    out = continuation_body("chat", body, "Hello the", 3)
    assert out["messages"] == [*msgs, {"role": "assistant", "content": "Hello the"}]
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    assert out["max_completion_tokens"] == 37 and out["max_tokens"] == 47
    assert len(msgs) == 1
    assert remaining_tokens("chat", body, 3) == 37


def test_a_client_prefill_is_extended_not_duplicated() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    out = continuation_body("chat", body, " one", 1)
    assert out["messages"][-1] == {"role": "assistant", "content": "Sure: one"}
    assert len(out["messages"]) == 2


@pytest.mark.parametrize(
    ("kind", "extra", "why"),
    [
        ("completion", {"prompt": "p", "n": 2}, "n > 1"),
        ("completion", {"prompt": "p", "echo": True}, "echo"),
        ("completion", {"prompt": [1, 2, 3]}, "single string"),
        ("completion", {"prompt": "p", "best_of": 3}, "best_of"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "guided_json": {}},
            "guided_json",
        ),
        (
            "chat",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
            "json_object",
        ),
        ("chat", {"messages": []}, "no messages"),
    ],
)
def test_requests_that_cannot_be_resumed_are_refused(
    kind: str, extra: dict[str, Any], why: str
) -> None:
    body = {"model": "m", **extra}
    refusal = failover_refusal(kind, body)  # type: ignore[arg-type]
    assert refusal is not None and why in refusal
    with pytest.raises(FailoverUnsupported, match=why.replace(">", ".")):
        continuation_body(kind, body, "t", 1)  # type: ignore[arg-type]


def test_exhausted_max_tokens_is_refused_and_the_stream_can_be_closed() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 3, "stream_options": {"include_usage": True}}
    with pytest.raises(FailoverUnsupported, match="max_tokens"):
        continuation_body("completion", body, " a b c", 3)
    sp = StreamSplicer(
        "completion",
        response_id="r",
        created=7,
        model="m",
        tokens_sent=3,
        prompt_tokens=5,
        include_usage=True,
    )
    got = parse_client("completion", sp.synthesize_end("length"))
    assert got["finish"] == "length" and got["done"] == 1
    assert got["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert got["ids"] == {"r"}


def test_recorder_forwards_only_complete_events() -> None:
    rec = StreamRecorder("completion")
    ev1 = b'data: {"id":"a","created":5,"model":"m","choices":[{"index":0,"text":"Hi"}]}\n\n'
    ev2 = b'data: {"id":"a","choices":[{"index":0,"text":" there"}]}\r\n\r\n'
    assert rec.feed(ev1[:10]) == b""
    assert rec.feed(ev1[10:] + ev2[:-1]) == ev1  # ev2 lacks its last LF: held back
    assert rec.text == "Hi" and rec.tokens == 1
    assert rec.feed(ev2[-1:]) == ev2
    assert (rec.response_id, rec.created, rec.model, rec.text, rec.tokens) == (
        "a",
        5,
        "m",
        "Hi there",
        2,
    )
    assert not rec.finished
    assert rec.feed(b": keep-alive\n\ndata: [DONE]\n\n") == b": keep-alive\n\ndata: [DONE]\n\n"
    assert rec.done and rec.finished


def test_recorder_handles_bom_cr_endings_and_oversized_events() -> None:
    rec = StreamRecorder("completion")
    data = b'\xef\xbb\xbfdata: {"choices":[{"text":"x"}]}\r\r'
    assert rec.feed(data[:2]) == b""
    assert rec.feed(data[2:]) == b""  # a final CR might still be the first half of CRLF
    assert rec.close() == data[3:]
    assert rec.text == "x"
    small = StreamRecorder("completion", max_event_bytes=16)
    with pytest.raises(FailoverUnsupported, match="exceeds"):
        small.feed(b"data: " + b"x" * 32)


def test_recorder_marks_streams_with_tool_calls_or_reasoning() -> None:
    rec = StreamRecorder("chat")
    rec.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n')
    assert rec.refusal == "tool calls were streamed"
    rec2 = StreamRecorder("chat")
    rec2.feed(b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"hmm"}}]}\n\n')
    assert rec2.refusal == "reasoning was streamed"


def test_splicer_rewrites_identity_drops_role_and_fixes_usage() -> None:
    sp = StreamSplicer(
        "chat",
        response_id="orig",
        created=1,
        model="alias",
        tokens_sent=4,
        prompt_tokens=None,
        include_usage=True,
    )
    head = {"id": "new", "created": 9, "model": "m"}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    usage = {"prompt_tokens": 14, "completion_tokens": 1, "total_tokens": 15}
    cont = (
        _sse({**head, "choices": [role]})
        + _sse(
            {**head, "choices": [{"index": 0, "delta": {"content": " x"}, "finish_reason": "stop"}]}
        )
        + _sse({**head, "choices": [], "usage": usage})
        + b": ping\n\ndata: [DONE]\n\n"
    )
    out = b"".join(sp.feed(cont[i : i + 7]) for i in range(0, len(cont), 7))
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-2:] == [b": ping", b"data: [DONE]"]
    first = json.loads(events[0][6:])
    assert (first["id"], first["created"], first["model"]) == ("orig", 1, "alias")
    assert first["choices"][0]["delta"] == {"content": " x"}
    assert json.loads(events[1][6:])["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
    }
    assert sp.done and sp.usage is not None and sp.usage["completion_tokens"] == 5


def test_splicer_drops_usage_the_client_did_not_ask_for() -> None:
    sp = StreamSplicer(
        "completion",
        response_id="o",
        created=1,
        model=None,
        tokens_sent=2,
        prompt_tokens=3,
        include_usage=False,
    )
    usage = {"prompt_tokens": 5, "completion_tokens": 1}
    out = sp.feed(
        _sse({"id": "n", "choices": [{"index": 0, "text": " a"}], "usage": usage})
        + _sse({"id": "n", "choices": [], "usage": usage})
    )
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert events == [{"id": "o", "choices": [{"index": 0, "text": " a"}], "created": 1}]
    assert sp.usage == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_splicer_keeps_the_role_when_the_client_never_got_one() -> None:
    rec = StreamRecorder("chat")  # the first attempt died before any event
    sp = StreamSplicer.after(rec, include_usage=False)
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
    out = sp.feed(_sse({"id": "n", "created": 2, "choices": [role]}))
    assert json.loads(out[6:])["choices"][0]["delta"]["role"] == "assistant"
