"""Routing headers and W3C traceparent/tracestate: filters/_routing_headers_c.pyx against
filters/routing_headers.py.

The input is a header block, one `name: value` per line (LF or CRLF; a line without a
colon is a name with an empty value), decoded as the listener decodes it: names latin-1,
values UTF-8 with surrogateescape. Both twins parse it trusted and untrusted and must
return equal RoutingHeaders and forwarded lists. parse_routing_headers documents no error
for str input (TypeError is for non-str), so any exception is a finding.
"""

from __future__ import annotations

from collections.abc import Callable

from fuzz.common import agree, outcome

INCLUDE = ["filters"]


def headers_of(data: bytes) -> list[tuple[str, str]]:
    out = []
    for line in data.split(b"\n"):
        line = line.removesuffix(b"\r")
        name, _, value = line.partition(b":")
        out.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))
    return out


def setup() -> Callable[[bytes], None]:
    from filters import _routing_headers_c as compiled  # type: ignore[attr-defined]
    from filters import routing_headers as pure

    def one_input(data: bytes) -> None:
        headers = headers_of(data)
        for trusted in (True, False):
            agree(
                f"routing headers trusted={trusted}",
                outcome((), compiled.parse_routing_headers, headers, trusted),
                outcome((), pure.parse_routing_headers, headers, trusted),
            )
        # The traceparent parsers on their own, on the raw value (no header framing).
        value = data.decode("utf-8", "surrogateescape")
        agree(
            "traceparent",
            outcome((), compiled.parse_routing_headers, [("traceparent", value)], False),
            outcome((), pure.parse_routing_headers, [("traceparent", value)], False),
        )

    return one_input
