"""StreamMeter: TTFT/ITL stamps, usage, errors and truncation on a fake clock, and the same
summary however the bytes are split into chunks."""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from loadtest.bench.stream import StreamMeter


def completion_event(text: str, finish: str | None = None) -> bytes:
    chunk = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def chat_event(delta: dict[str, str]) -> bytes:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def usage_event(prompt: int, completion: int, cached: int | None = None) -> bytes:
    usage: dict[str, object] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def test_times_tokens_and_usage_on_a_fake_clock() -> None:
    meter = StreamMeter()
    meter.feed(completion_event(" a"), 1.25)
    meter.feed(completion_event(" b"), 1.5)
    meter.feed(completion_event(" c") + completion_event(" d", "length"), 2.0)
    meter.feed(usage_event(10, 4, cached=8) + DONE, 2.1)
    s = meter.summary()
    assert s.first_token_at == 1.25
    assert s.last_token_at == 2.0
    assert s.token_events == 4
    # Tokens that arrive in one chunk share its time: a zero gap, as vLLM's bench has it.
    assert s.gaps == (0.25, 0.5, 0.0)
    assert s.done and s.error is None
    assert (s.usage_prompt_tokens, s.usage_completion_tokens, s.usage_cached_tokens) == (10, 4, 8)
    assert s.output_tokens == 4
    assert s.text == ""  # not kept unless asked


def test_chat_role_event_is_not_the_first_token_and_text_is_kept() -> None:
    meter = StreamMeter(keep_text=True)
    meter.feed(chat_event({"role": "assistant", "content": ""}), 0.1)
    meter.feed(chat_event({"content": "Hello"}), 0.3)
    meter.feed(chat_event({"content": " world"}) + DONE, 0.4)
    s = meter.summary()
    assert s.first_token_at == 0.3
    assert s.text == "Hello world"
    assert s.token_events == 2
    assert s.usage_completion_tokens is None
    assert s.output_tokens == 2  # counted events when the stream sends no usage


def test_error_event_and_missing_done() -> None:
    meter = StreamMeter()
    meter.feed(completion_event(" a"), 0.1)
    err = {"error": {"message": "engine crashed", "type": "upstream_error", "code": "x"}}
    meter.feed(b"data: " + json.dumps(err).encode() + b"\n\n", 0.2)
    s = meter.summary()
    assert s.error == "engine crashed"
    assert not s.done

    truncated = StreamMeter()
    truncated.feed(completion_event(" a"), 0.1)
    assert not truncated.summary().done


def test_a_token_that_reads_error_is_a_token() -> None:
    meter = StreamMeter()
    meter.feed(completion_event(" x"), 0.1)
    meter.feed(completion_event("error") + DONE, 0.2)
    s = meter.summary()
    assert s.error is None and s.token_events == 2


def test_crlf_comments_and_multiline_data() -> None:
    meter = StreamMeter(keep_text=True)
    meter.feed(b": keep-alive\r\n\r\n", 0.0)
    meter.feed(completion_event(" a").replace(b"\n", b"\r\n"), 0.5)
    payload = json.dumps({"choices": [{"text": " b"}]}, indent=1).encode()
    meter.feed(b"\n".join(b"data: " + line for line in payload.split(b"\n")) + b"\n\n", 0.6)
    meter.feed(b"data: [DONE]", 0.7)  # no trailing blank line: still the end
    s = meter.summary()
    assert s.first_token_at == 0.5
    assert s.text == " a b"
    assert s.done


STREAM = b"".join(
    [
        chat_event({"role": "assistant", "content": ""}),
        *(chat_event({"content": w}) for w in ("one", " two", " three", " error", " five")),
        usage_event(7, 5, cached=0),
        DONE,
    ]
)


@given(
    cuts=st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12),
    keep_text=st.booleans(),
)
def test_chunking_does_not_change_what_is_counted(cuts: list[int], keep_text: bool) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    meter = StreamMeter(keep_text=keep_text)
    for lo, hi in itertools.pairwise(bounds):
        meter.feed(STREAM[lo:hi], 1.0)
    s = meter.summary()
    assert s.done and s.error is None
    assert s.token_events == 5
    assert s.output_tokens == 5
    assert s.usage_cached_tokens == 0
    assert s.text == ("one two three error five" if keep_text else "")
    assert s.gaps == (0.0,) * 4
