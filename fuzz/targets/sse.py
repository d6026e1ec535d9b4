"""SSE scanner: filters/_sse_c.pyx against filters/sse.py.

The input is a `text/event-stream` body (vLLM's OpenAI-compatible stream, or anything).
Both twins, collecting text, with the default and with a small max_event_bytes, get the
same reads and must return the same count (or raise the same SSEError) and reach the same
state (events, tokens, done, usage, finish reason, id, error, text: values and types) after
every feed() and after close(); the state after the last read must not depend on where the
reads were cut. Documented error: SSEError only.

The input is also read as EVENT (0xFF SLOT)*: a stream of EVENT, then EVENT with its last
"text"/"content" string replaced by each SLOT, checked the same way. That is the shape the
compiled twin's template path reads (a stream's chunks differ only in the token), with the
fuzzer choosing the strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fuzz.common import agree, outcome, splits, typed

INCLUDE = ["filters"]

_SLOT = re.compile(rb'"(?:text|content)"[ \t\r\n]*:[ \t\r\n]*("(?:[^"\\]|\\.)*")')


def templated(data: bytes) -> bytes | None:
    """The stream EVENT (0xFF SLOT)* stands for, or None when EVENT has no slot."""
    event, *slots = data.split(b"\xff")
    found = list(_SLOT.finditer(event))
    if not found or not slots:
        return None
    a, b = found[-1].span(1)
    events = [event] + [event[:a] + s + event[b:] for s in slots]
    return b"".join(b"data: " + e + b"\n\n" for e in events)


def setup() -> Callable[[bytes], None]:
    from filters import _sse_c as compiled  # type: ignore[attr-defined]
    from filters import sse as pure
    from filters.sse import SSEError

    documented = (SSEError,)

    def state(s: Any) -> Any:
        return typed(
            (s.events, s.tokens, s.done, s.usage, s.finish_reason, s.response_id, s.error, s.text)
        )

    def run(cls: Any, max_event_bytes: int, reads: list[bytes]) -> list[Any]:
        s = cls(collect_text=True, max_event_bytes=max_event_bytes)
        trace = []
        for r in reads:
            got = outcome(documented, s.feed, r)
            trace += [got, state(s)]
            if got[0] == "error":
                break
        s.close()
        trace.append(state(s))
        return trace

    def one_input(data: bytes) -> None:
        check(data)
        stream = templated(data)
        if stream is not None:
            check(stream)

    def check(data: bytes) -> None:
        reads = splits(data)
        for limit in (pure.DEFAULT_MAX_EVENT_BYTES, 96):
            p = run(pure.SSEScanner, limit, reads)
            agree(f"sse max_event_bytes={limit}", run(compiled.SSEScanner, limit, reads), p)
            whole = run(pure.SSEScanner, limit, [data])
            errors = [o for o in p[:-1:2] if o[0] == "error"]
            agree(
                f"sse whole/split error, max_event_bytes={limit}",
                whole[:1] if whole[0][0] == "error" else [],
                errors,
                ("whole", "split"),
            )
            if not errors:
                agree(
                    f"sse whole/split max_event_bytes={limit}", whole[-1], p[-1], ("whole", "split")
                )

    return one_input
