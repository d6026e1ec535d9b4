"""The per-field loops of a proxied HTTP/1.1 exchange: a request head's fields as the parser
gave them (bytes) read within the listener's limits, and a message's fields split into what
is forwarded and what is the hop's own (RFC 9110 7.6.1).

Sans-I/O, pure-Python reference; `filters/_http_fields_c.pyx` is the compiled twin and must
return equal results for any input. Callers (meshd/listener.py, meshd/intake.py,
meshd/relay.py) import from `filters.hotpath`.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["RequestFields", "SplitFields", "read_request_fields", "split_fields"]

# (fields decoded, Content-Length, Expect, the limit passed: "count", "size" or None)
RequestFields = tuple[list[tuple[str, str]], int | None, str | None, str | None]
# (fields forwarded, Connection values, Via values, the last x-request-id)
SplitFields = tuple[list[tuple[str, str]], list[str], list[str], str | None]


def read_request_fields(
    raw: Iterable[tuple[bytes, bytes]], max_count: int, max_bytes: int
) -> RequestFields:
    """Names as Latin-1, values as UTF-8 with surrogate escapes, in order, until the first
    limit a field passes: more than `max_count` fields ("count"), or names and values over
    `max_bytes` together ("size"). Content-Length and Expect are noted (the parser has
    checked Content-Length is one decimal number)."""
    headers: list[tuple[str, str]] = []
    size = 0
    content_length: int | None = None
    expect: str | None = None
    for name, value in raw:
        text = value.decode("utf-8", "surrogateescape")
        headers.append((name.decode("latin-1"), text))
        size += len(name) + len(value)
        n = len(name)
        if n == 14 and name.lower() == b"content-length":
            content_length = int(text)
        elif n == 6 and name.lower() == b"expect":
            expect = text
        if len(headers) > max_count:
            return headers, content_length, expect, "count"
        if size > max_bytes:
            return headers, content_length, expect, "size"
    return headers, content_length, expect, None


def split_fields(
    headers: Iterable[tuple[str, str]], drop: frozenset[str], via_apart: bool
) -> SplitFields:
    """The fields whose lower-cased name is not in `drop`, in order; the values of the
    Connection fields (whether or not `drop` names it); with `via_apart`, Via fields are
    taken out and their values returned; the value of the last x-request-id forwarded."""
    out: list[tuple[str, str]] = []
    connection: list[str] = []
    via: list[str] = []
    request_id: str | None = None
    for name, value in headers:
        lname = name.lower()
        if lname == "connection":
            connection.append(value)
        if lname in drop:
            continue
        if via_apart and lname == "via":
            via.append(value)
            continue
        if lname == "x-request-id":
            request_id = value
        out.append((name, value))
    return out, connection, via, request_id
