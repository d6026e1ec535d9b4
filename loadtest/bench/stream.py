"""Sans-I/O measurement of one streamed OpenAI-style answer: feed it chunks and their times.

Lean on purpose (the load client shares two cores with the engines and the router): JSON is
parsed only until the first token, for the rare usage or error event, and for every event
when the answer text is wanted (a later step of the same chain needs it).
Event shapes follow vLLM's CompletionStreamResponse / ChatCompletionStreamResponse and its
ErrorResponse (vllm-project/vllm: vllm/entrypoints/openai/protocol.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_DONE = b"[DONE]"


@dataclass(frozen=True, slots=True)
class StreamSummary:
    """What one stream said, once it ended (cleanly or not).

    Times are in the clock of the `now` values fed; `first_token_at`/`last_token_at` are
    None when no token arrived. `token_events` counts SSE events that carried text;
    `usage_*` are the final usage event's numbers, None without one. `error` is the message
    of an SSE error event, None if there was none.
    """

    first_token_at: float | None
    last_token_at: float | None
    token_events: int
    gaps: tuple[float, ...]
    done: bool
    error: str | None
    usage_completion_tokens: int | None
    usage_prompt_tokens: int | None
    usage_cached_tokens: int | None
    text: str

    @property
    def output_tokens(self) -> int:
        """The usage figure when the stream sent one, else the events that carried text."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self.token_events


def _piece(obj: Any) -> str | None:
    """Text of the first choice of a chunk (completion `text` or chat `delta.content`)."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return None
    first = choices[0]
    text = first.get("text")
    if text is None:
        delta = first.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    return text if isinstance(text, str) else None


def _error_message(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err.get("code") or "error")
    if err is not None:
        return str(err)
    if obj.get("object") == "error":
        return str(obj.get("message") or "error")
    return None


class StreamMeter:
    """Accumulates one SSE stream: `feed(chunk, now)` per received chunk, then `summary()`.

    Events are split on blank lines (`\\n\\n`; `\\r\\n` is normalised). Every token event
    of one chunk is stamped with that chunk's `now`, so tokens that arrive together give
    zero gaps, as vLLM's own benchmark client measures them.
    """

    __slots__ = (
        "_buf",
        "_cached",
        "_completion",
        "_done",
        "_error",
        "_first",
        "_gaps",
        "_keep_text",
        "_last",
        "_pieces",
        "_prompt",
        "_tokens",
    )

    def __init__(self, keep_text: bool = False) -> None:
        self._keep_text = keep_text
        self._buf = b""
        self._first: float | None = None
        self._last: float | None = None
        self._tokens = 0
        self._gaps: list[float] = []
        self._done = False
        self._error: str | None = None
        self._completion: int | None = None
        self._prompt: int | None = None
        self._cached: int | None = None
        self._pieces: list[str] = []

    @property
    def first_token_at(self) -> float | None:
        return self._first

    def feed(self, chunk: bytes, now: float) -> None:
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n")
        data = self._buf + chunk if self._buf else chunk
        events = data.split(b"\n\n")
        self._buf = events.pop()
        for raw in events:
            self._event(raw, now)

    def _event(self, raw: bytes, now: float) -> None:
        if raw.startswith(b"data: ") and b"\n" not in raw:
            payload = raw[6:]
        else:
            lines = [ln[5:].lstrip(b" ") for ln in raw.split(b"\n") if ln.startswith(b"data:")]
            if not lines:
                return  # a comment or a field meshd does not use (event:, id:, retry:)
            payload = b"\n".join(lines)
        if payload == _DONE:
            self._done = True
            return
        if self._done:
            return
        if b'"error"' in payload or b'"object":"error"' in payload:
            obj = _loads(payload)
            message = _error_message(obj)
            if message is not None:
                self._error = message
                return
            self._note_usage(obj)
            self._note_piece(_piece(obj), now)
            return
        if self._first is None or self._keep_text:
            obj = _loads(payload)
            self._note_usage(obj)
            self._note_piece(_piece(obj), now)
            return
        if b'"usage"' in payload and b'"usage":null' not in payload:
            obj = _loads(payload)
            self._note_usage(obj)
            self._note_piece(_piece(obj), now)
            return
        self._token(now)

    def _note_piece(self, piece: str | None, now: float) -> None:
        if piece:
            if self._keep_text:
                self._pieces.append(piece)
            self._token(now)

    def _token(self, now: float) -> None:
        if self._first is None:
            self._first = now
        elif self._last is not None:
            self._gaps.append(now - self._last)
        self._last = now
        self._tokens += 1

    def _note_usage(self, obj: Any) -> None:
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if not isinstance(usage, dict):
            return
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            self._completion = completion
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            self._prompt = prompt
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self._cached = details["cached_tokens"]

    def summary(self) -> StreamSummary:
        if self._buf.strip():
            # The stream ended without the blank line after its last event: take it anyway.
            rest, self._buf = self._buf, b""
            self._event(rest.rstrip(b"\n"), self._last if self._last is not None else 0.0)
        return StreamSummary(
            first_token_at=self._first,
            last_token_at=self._last,
            token_events=self._tokens,
            gaps=tuple(self._gaps),
            done=self._done,
            error=self._error,
            usage_completion_tokens=self._completion,
            usage_prompt_tokens=self._prompt,
            usage_cached_tokens=self._cached,
            text="".join(self._pieces),
        )


def _loads(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None
