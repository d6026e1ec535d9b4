"""Incremental scanner for OpenAI-style `text/event-stream` responses (vLLM's): counts
events and token-bearing events, and keeps usage, finish reason, response id and errors.

Pure-Python reference; `filters/_sse_c.pyx` is the compiled twin and must reach the same
state after every `feed()` on any input. Callers import `SSEScanner` from filters.hotpath.

Framing follows the WHATWG HTML spec, "Server-sent events", section "Interpreting an event
stream" (https://html.spec.whatwg.org/multipage/server-sent-events.html): UTF-8 with one
leading BOM ignored, invalid bytes replaced by U+FFFD; lines end with CRLF, LF or CR; a
line starting with ":" is a comment; "field:value" loses one space after the colon; a
line with no colon is a field with an empty value; `data` values join with "\\n"; a blank
line dispatches the event, and only an event with at least one `data` line counts. At end
of stream an unterminated event is discarded, as the spec says, so `close()` dispatches
nothing. Fields other than `data` (event, id, retry, unknown) are framed and ignored.

Payloads follow vLLM's OpenAI-compatible server (vllm-project/vllm:
vllm/entrypoints/openai/protocol.py, CompletionStreamResponse and
ChatCompletionStreamResponse; errors mid-stream as {"error": {...}} from
serving_engine.py create_streaming_error_response). `data: [DONE]` (exactly) sets `done`;
anything after it is still scanned. `usage` and `error` keep the last object seen,
`response_id` the first str id, `finish_reason` the last str one.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "Payload",
    "SSEError",
    "SSEScanner",
    "decode_payload",
    "interpret_payload",
]

# An event (all its lines, up to the blank line) larger than this is refused: a vLLM chunk
# is a few hundred bytes; a megabyte means a broken or hostile upstream.
DEFAULT_MAX_EVENT_BYTES = 1 << 20

_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
_DONE = b"[DONE]"


class SSEError(ValueError):
    """The event stream broke a limit (an event over max_event_bytes)."""


class Payload(NamedTuple):
    """What one JSON event contributes to a scanner's state.

    A NamedTuple rather than a frozen dataclass: one is built per streamed event, and a
    tuple is several times cheaper to build.
    """

    token: bool  # carries generated output (text, content, reasoning or tool calls)
    response_id: str | None  # top-level "id" when a str
    usage: dict[str, Any] | None  # top-level "usage" when an object
    error: dict[str, Any] | None  # top-level "error" when an object
    finish_reason: str | None  # last str choices[].finish_reason
    text: list[str]  # index-0 choices' text and delta.content, in order (when asked)


def _is_index0(choice: dict[str, Any]) -> bool:
    idx = choice.get("index", 0)
    return type(idx) is int and idx == 0


def interpret_payload(obj: object, collect_text: bool) -> Payload:
    """Read one decoded JSON event. Shared by both twins, so their slow paths agree.

    A choice is token-bearing when it has a non-empty str "text" (completions), or a
    "delta" object with non-empty str "content", "reasoning_content" or "reasoning"
    (vLLM's newer name), or a non-empty "tool_calls" list. Values of other types count
    as absent.
    """
    if not isinstance(obj, dict):
        return Payload(False, None, None, None, None, [])
    rid = obj.get("id")
    usage = obj.get("usage")
    error = obj.get("error")
    token = False
    finish: str | None = None
    texts: list[str] = []
    choices = obj.get("choices")
    if isinstance(choices, list):
        for ch in choices:
            if not isinstance(ch, dict):
                continue
            text = ch.get("text")
            if isinstance(text, str) and text:
                token = True
                if collect_text and _is_index0(ch):
                    texts.append(text)
            delta = ch.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")
                if isinstance(content, str) and content:
                    token = True
                    if collect_text and _is_index0(ch):
                        texts.append(content)
                for key in ("reasoning_content", "reasoning"):
                    r = delta.get(key)
                    if isinstance(r, str) and r:
                        token = True
                calls = delta.get("tool_calls")
                if isinstance(calls, list) and calls:
                    token = True
            fr = ch.get("finish_reason")
            if isinstance(fr, str):
                finish = fr
    return Payload(
        token,
        rid if isinstance(rid, str) else None,
        usage if isinstance(usage, dict) else None,
        error if isinstance(error, dict) else None,
        finish,
        texts,
    )


def decode_payload(data: bytes) -> object:
    """The JSON value of an event's data, or None when it is not JSON (still an event).

    Invalid UTF-8 is replaced, as the SSE spec decodes the stream. A JSON `null` also
    gives None, which is fine: it carries nothing either.
    """
    try:
        return json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None


class SSEScanner:
    """Feed raw response bytes split anywhere; read the counters and fields any time.

    State after each feed() is a function of the bytes fed so far (and where the chunks
    were split only through what feed() returns). Scanning is linear in the input: a
    partial line is kept in a growing buffer and only the new bytes are searched.
    """

    __slots__ = (
        "_closed",
        "_collect",
        "_data",
        "_event_bytes",
        "_failed",
        "_head",
        "_line",
        "_max",
        "_skip_lf",
        "_text",
        "_text_parts",
        "done",
        "error",
        "events",
        "finish_reason",
        "response_id",
        "tokens",
        "usage",
    )

    def __init__(
        self, collect_text: bool = False, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    ) -> None:
        if max_event_bytes < 1:
            raise ValueError(f"max_event_bytes must be >= 1, got {max_event_bytes}")
        self._collect = bool(collect_text)
        self._max = int(max_event_bytes)
        self._head: bytes | None = b""  # stream start until we know whether a BOM leads
        self._line = bytearray()  # the current partial line, without terminator
        self._skip_lf = False  # the last chunk ended in CR: a leading LF belongs to it
        self._data: list[bytes] = []  # data values of the current event
        self._event_bytes = 0  # bytes of the current event's completed lines
        self._failed: str | None = None
        self._closed = False
        self._text_parts: list[str] = []
        self._text: str | None = ""
        self.events = 0
        self.tokens = 0
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.response_id: str | None = None
        self.error: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """Concatenated output of choice 0 (text and delta.content) when collect_text."""
        if self._text is None:
            self._text = "".join(self._text_parts)
        return self._text

    def close(self) -> None:
        """End of stream. A pending unterminated event is discarded (WHATWG SSE)."""
        self._closed = True
        self._line = bytearray()
        self._data = []
        self._head = None

    def feed(self, chunk: bytes) -> int:
        """Scan the next bytes; return how many token-bearing events they completed.

        Raises SSEError when an event grows over max_event_bytes (then on every later
        call too), ValueError after close().
        """
        if not isinstance(chunk, bytes | bytearray | memoryview):
            raise TypeError(f"chunk must be bytes-like, not {type(chunk).__name__}")
        if self._failed is not None:
            raise SSEError(self._failed)
        if self._closed:
            raise ValueError("feed() after close()")
        buf = bytes(chunk)
        if self._head is not None:
            head = self._head + buf
            if len(head) < 3 and _BOM.startswith(head):
                self._head = head
                return 0
            self._head = None
            buf = head[3:] if head.startswith(_BOM) else head
        tokens_before = self.tokens
        pos = 0
        if self._skip_lf and buf:
            self._skip_lf = False
            if buf[0] == 0x0A:
                pos = 1
        end = -1
        for m in _EOL.finditer(buf, pos):
            end = m.end()
            self._line_done(buf, pos, m.start())
            pos = end
        if end == len(buf) and buf[-1] == 0x0D:
            self._skip_lf = True
        rest = len(buf) - pos
        if rest:
            if self._event_bytes + len(self._line) + rest > self._max:
                self._fail()
            self._line += buf[pos:]
        return self.tokens - tokens_before

    def _fail(self) -> None:
        self._failed = (
            f"SSE event larger than max_event_bytes={self._max} bytes "
            "(an event is every line up to the blank line that ends it)"
        )
        self._line = bytearray()
        self._data = []
        raise SSEError(self._failed)

    def _line_done(self, buf: bytes, start: int, stop: int) -> None:
        line: bytes | bytearray
        if self._line:
            if self._event_bytes + len(self._line) + stop - start > self._max:
                self._fail()
            self._line += buf[start:stop]
            line = self._line
            self._line = bytearray()
        elif start == stop:
            self._dispatch()
            return
        else:
            if self._event_bytes + stop - start > self._max:
                self._fail()
            line = buf[start:stop]
        self._event_bytes += len(line)
        # The field name is everything before the first colon; only "data" matters here.
        if line.startswith(b"data:"):
            value = bytes(line[6:] if line[5:6] == b" " else line[5:])
            self._data.append(value)
        elif line == b"data":
            self._data.append(b"")

    def _dispatch(self) -> None:
        self._event_bytes = 0
        if not self._data:
            return
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        self._data = []
        if data == _DONE:
            self.done = True
            return
        self.events += 1
        self._apply(interpret_payload(decode_payload(data), self._collect))

    def _apply(self, p: Payload) -> None:
        if p.token:
            self.tokens += 1
        if self.response_id is None and p.response_id is not None:
            self.response_id = p.response_id
        if p.usage is not None:
            self.usage = p.usage
        if p.error is not None:
            self.error = p.error
        if p.finish_reason is not None:
            self.finish_reason = p.finish_reason
        if p.text:
            self._text_parts.extend(p.text)
            self._text = None
