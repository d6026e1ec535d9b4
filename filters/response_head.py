"""Parse an HTTP/1.1 response head: the status line and fields (RFC 9112 sections 4 and 5,
obs-fold replaced by SP as 5.2 allows) and the body's length (6.3).

Sans-I/O: the head's bytes (without its blank line) in, a `ResponseHead` tuple or a
`ResponseHeadError` naming what is wrong out. Pure-Python reference;
`filters/_response_head_c.pyx` is the compiled twin and must return equal results for any
input. Callers (meshd/upstream_connection.py) import `parse_response_head` from
`filters.hotpath`.
"""

from __future__ import annotations

import re

__all__ = [
    "CHUNKED",
    "LENGTH",
    "NONE",
    "UNTIL_CLOSE",
    "ResponseHead",
    "ResponseHeadError",
    "parse_response_head",
]

# How the body is framed (meshd/upstream_response.py BodyFraming has the same values).
NONE = 0
LENGTH = 1
CHUNKED = 2
UNTIL_CLOSE = 3

# (status, reason, fields in order, media type, framing, Content-Length, keep-alive)
ResponseHead = tuple[int, str, list[tuple[str, str]], str, int, int, bool]


class ResponseHeadError(ValueError):
    """A malformed or unsupported response head; the message says what."""


_STATUS_LINE = re.compile(r"HTTP/1\.([01]) ([0-9]{3})(?: ([^\r\n\x00]*))?")
# field-line = field-name ":" OWS field-value OWS; the name is a token (RFC 9110 5.1, 5.5).
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_FIELD_LINE = re.compile(rf"({_TOKEN}):[ \t]*([^\r\n\x00]*?)[ \t]*")
# The usual head, every line one well-formed field (no obs-fold): checked whole by one
# match, then split on CRLF and each line's first colon (a token holds none), with OWS
# stripped from the value, instead of a match per line with a lazy value that backtracks at
# every character. Splitting costs less than a capturing findall (3.3 us vs 5.1 us for a
# 5-field head, timeit).
_FIELD_BLOCK = re.compile(rf"(?:{_TOKEN}:[^\r\n\x00]*\r\n)*")


def parse_response_head(head: bytes, max_headers: int, is_head: bool) -> ResponseHead | None:
    """The head of a response to a request (`is_head`: a HEAD request, whose response has
    no body); None for a 1xx interim response (skip it). Raises ResponseHeadError."""
    first, _, block = head.decode("utf-8", "surrogateescape").partition("\r\n")
    status_line = _STATUS_LINE.fullmatch(first)
    if status_line is None:
        raise ResponseHeadError(f"malformed status line {first[:80]!r}")
    minor, code, reason = status_line.groups()
    status = int(code)
    if 100 <= status < 200:
        if status == 101:
            raise ResponseHeadError("unexpected 101 Switching Protocols")
        return None
    headers: list[tuple[str, str]] = []
    if block:
        block += "\r\n"
        lines = block.count("\r\n")
        if lines > max_headers:
            raise ResponseHeadError(
                f"{lines} response header lines exceed max_headers ({max_headers})"
            )
        if _FIELD_BLOCK.fullmatch(block) is not None:
            for line in block.split("\r\n")[:-1]:
                name, _, value = line.partition(":")
                headers.append((name, value.strip(" \t")))
        else:
            headers = _fields_line_by_line(block)
    return framing(status, reason or "", headers, minor == "0", is_head)


def framing(
    status: int, reason: str, headers: list[tuple[str, str]], close: bool, is_head: bool
) -> ResponseHead:
    """The body's framing from the fields (RFC 9112 6.3). `close`: an HTTP/1.0 response."""
    content_length: str | None = None
    chunked = False
    content_type = "application/octet-stream"  # RFC 9110 8.3, when none is given
    for name, value in headers:
        lname = name.lower()
        if lname == "content-length":
            for part in value.split(","):
                part = part.strip(" \t")
                if (
                    not part.isdigit()
                    or not part.isascii()
                    or (content_length is not None and int(part) != int(content_length))
                ):
                    raise ResponseHeadError(f"invalid Content-Length {value!r}")
                content_length = part
        elif lname == "transfer-encoding":
            codings = [c.strip(" \t").lower() for c in value.split(",") if c.strip(" \t")]
            if chunked or codings != ["chunked"]:
                # Another coding would reach the client still encoded once we drop the
                # header; refusing is safer than relaying bytes nobody can read.
                raise ResponseHeadError(f"unsupported Transfer-Encoding {value!r} (only chunked)")
            chunked = True
        elif lname == "connection":
            if any(t.strip(" \t").lower() == "close" for t in value.split(",")):
                close = True
        elif lname == "content-type":
            content_type = media_type(value)
    if is_head or status in (204, 304):
        mode, length = NONE, 0
    elif chunked:
        if content_length is not None:
            # RFC 9112 6.3 item 3: both may be a smuggling attempt; handle as an error.
            raise ResponseHeadError("response has both Transfer-Encoding and Content-Length")
        mode, length = CHUNKED, 0
    elif content_length is not None:
        length = int(content_length)
        mode = LENGTH if length else NONE
    else:
        mode, length, close = UNTIL_CLOSE, 0, True
    return (status, reason, headers, content_type, mode, length, not close)


def _fields_line_by_line(block: str) -> list[tuple[str, str]]:
    """The fields of a head `_FIELD_BLOCK` refused: obs-fold joined, else the error."""
    headers: list[tuple[str, str]] = []
    for line in block.split("\r\n")[:-1]:
        if line[:1] in (" ", "\t") and headers:
            # obs-fold: the line continues the previous field's value (RFC 9112 5.2).
            name, value = headers[-1]
            folded = line.strip(" \t")
            headers[-1] = (name, f"{value} {folded}" if folded else value)
            continue
        field_line = _FIELD_LINE.fullmatch(line)
        if field_line is None:
            raise ResponseHeadError(f"malformed response header {line[:80]!r}")
        name, value = field_line.groups()
        headers.append((name, value))
    return headers


def media_type(value: str) -> str:
    return value.split(";", 1)[0].strip(" \t").lower()
