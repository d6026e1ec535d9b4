"""The plainest HTTP/1.1 request, read whole in one pass: the listener's fast path for a
read that holds exactly one request of the common shape (a known method, an origin-form
target, ASCII fields, a Content-Length body or none), which is what an inference client
sends. Anything else gives None and goes to llhttp (meshd/listener.py), which answers
the odd, the malformed and the over-limit cases; so this reads a request only where
llhttp would read the same request (tests/test_request_head.py holds the two to that
with hypothesis), and never refuses one.

Sans-I/O, pure-Python reference; `filters/_request_head_c.pyx` is the compiled twin and
must return equal results for any input. Callers import from `filters.hotpath`.
"""

from __future__ import annotations

import re

__all__ = ["SimpleRequest", "read_simple_request"]

# (method, target, HTTP version, fields in order, keep-alive, Content-Length, body)
SimpleRequest = tuple[str, str, str, list[tuple[str, str]], bool, int | None, bytes]

METHODS = frozenset({b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH"})
# An origin-form target of unreserved, sub-delims, ":@/?" and percent signs: what llhttp
# takes unchanged (no fragment, no spaces, no characters its URL parser may judge).
_TARGET = re.compile(rb"/[A-Za-z0-9\-._~!$&'()*+,;=:@/?%]*")
_NAME = re.compile(rb"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")
# Field values: printable ASCII and spaces, neither empty nor ending in a space (llhttp's
# handling of trailing whitespace and of empty values is left to llhttp).
_VALUE = re.compile(rb"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
_DIGITS = re.compile(rb"[0-9]{1,15}")
# Fields whose meaning llhttp acts on beyond framing by Content-Length: left to it.
_DECLINED = frozenset({b"transfer-encoding", b"upgrade", b"expect", b"proxy-connection"})


def read_simple_request(
    data: bytes, max_count: int, max_bytes: int, max_body: int
) -> SimpleRequest | None:
    """`data` as one whole request of the plain shape, ending exactly where its body does,
    within the limits (at most `max_count` fields, names and values at most `max_bytes`
    together, a body at most `max_body` bytes); else None."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].split(b"\r\n")
    first = lines[0].split(b" ")
    if len(first) != 3 or first[0] not in METHODS or first[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        return None
    if _TARGET.fullmatch(first[1]) is None or len(lines) - 1 > max_count:
        return None
    headers: list[tuple[str, str]] = []
    size = 0
    content_length: int | None = None
    connection: bytes | None = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        value = value.lstrip(b" ")
        if not colon or _NAME.fullmatch(name) is None or _VALUE.fullmatch(value) is None:
            return None
        lower = name.lower()
        if lower in _DECLINED:
            return None
        if lower == b"content-length":
            if content_length is not None or _DIGITS.fullmatch(value) is None:
                return None
            content_length = int(value)
        elif lower == b"connection":
            if connection is not None:
                return None
            connection = value.lower()
            if connection not in (b"keep-alive", b"close"):
                return None
        size += len(name) + len(value)
        headers.append((name.decode("ascii"), value.decode("ascii")))
    if size > max_bytes:
        return None
    start = end + 4
    length = 0 if content_length is None else content_length
    if length > max_body or len(data) - start != length:
        return None
    version = "1.1" if first[2] == b"HTTP/1.1" else "1.0"
    keep_alive = connection != b"close" if version == "1.1" else connection == b"keep-alive"
    return (
        first[0].decode("ascii"),
        first[1].decode("ascii"),
        version,
        headers,
        keep_alive,
        content_length,
        data[start:],
    )
