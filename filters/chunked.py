"""Incremental decoder of an HTTP/1.1 chunked body (RFC 9112 section 7.1): bytes in, payload
out, one `feed()` per socket read however many chunks it holds. Sans-I/O.

Pure-Python reference; `filters/_chunked_c.pyx` is the compiled twin and must return the same
bytes and raise the same error after every `feed()` on any input (tests/test_chunked.py).

Grammar (RFC 9112 7.1, 7.1.1, 7.1.2):

    chunked-body = *chunk last-chunk trailer-section CRLF
    chunk        = chunk-size [ chunk-ext ] CRLF chunk-data CRLF
    chunk-size   = 1*HEXDIG
    chunk-ext    = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] )

Strict where framing is at stake (it is what request smuggling feeds on): lines end with
CRLF, never a bare LF; the size is hex digits only (no sign, no "0x", no leading blanks);
after the digits only blanks then ";" may follow, and the extension itself is ignored.
Trailer fields are checked for a "name:" shape, counted against `max_trailer_bytes` and
dropped: a proxy that removes Transfer-Encoding cannot forward them anyway.

An error is sticky: every later `feed()` raises it again. Payload decoded earlier in the
call that raises is discarded with it; the body is broken either way.
"""

from __future__ import annotations

import re
from typing import NoReturn

__all__ = [
    "DEFAULT_MAX_CHUNK_SIZE",
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_TRAILER_BYTES",
    "ChunkedDecoder",
    "ChunkedError",
]

# A size line is a few hex digits; 4 KiB leaves room for extensions nobody sends.
DEFAULT_MAX_LINE_BYTES = 4096
# A chunk is streamed out as it arrives, so its size costs no memory; the bound only
# rejects sizes no engine would send (and keeps the compiled twin's arithmetic in range).
DEFAULT_MAX_CHUNK_SIZE = 1 << 40
DEFAULT_MAX_TRAILER_BYTES = 16 * 1024

_HEX = re.compile(rb"[0-9A-Fa-f]*")

_SIZE, _DATA, _DATA_CR, _DATA_LF, _TRAILER, _DONE = range(6)


class ChunkedError(ValueError):
    """The chunked framing is malformed or breaks a limit."""


def _show(line: bytes) -> str:
    # Error messages quote at most 40 bytes of the offending line.
    return repr(bytes(line[:40])) + ("..." if len(line) > 40 else "")


class ChunkedDecoder:
    """Decodes one chunked body. `feed(data)` returns the payload decodable so far.

    `done` turns true after the last chunk and its trailer section; bytes fed after that
    are kept in `unused` (a sane server sends none: they mean the connection can't be
    reused). Every limit is a constructor argument.
    """

    __slots__ = (
        "_error",
        "_line",
        "_remaining",
        "_state",
        "_trailer_bytes",
        "max_chunk_size",
        "max_line_bytes",
        "max_trailer_bytes",
        "unused",
    )

    def __init__(
        self,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE,
        max_trailer_bytes: int = DEFAULT_MAX_TRAILER_BYTES,
    ) -> None:
        if max_line_bytes < 1 or max_chunk_size < 0 or max_trailer_bytes < 0:
            raise ValueError("ChunkedDecoder limits must be positive")
        if max_chunk_size > 1 << 60:
            raise ValueError("max_chunk_size must be at most 2**60")
        self.max_line_bytes = max_line_bytes
        self.max_chunk_size = max_chunk_size
        self.max_trailer_bytes = max_trailer_bytes
        self.unused = b""
        self._state = _SIZE
        self._line = bytearray()  # an incomplete size or trailer line
        self._remaining = 0  # bytes of the current chunk's data still to come
        self._trailer_bytes = 0
        self._error: str | None = None

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> bytes:
        """Decode `data`; returns the payload it completes (b"" when none)."""
        if self._error is not None:
            raise ChunkedError(self._error)
        if self._state == _DONE:
            self.unused += data
            return b""
        out: list[bytes] = []
        pos = 0
        n = len(data)
        while pos < n:
            state = self._state
            if state == _DATA:
                take = min(self._remaining, n - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                # The common case: the CRLF after the data is in the same read.
                if data[pos : pos + 2] == b"\r\n":
                    pos += 2
                    self._state = _SIZE
                else:
                    self._state = _DATA_CR
            elif state in (_DATA_CR, _DATA_LF):
                if data[pos] != (13 if state == _DATA_CR else 10):
                    self._fail("missing CRLF after chunk data")
                pos += 1
                self._state = _DATA_LF if state == _DATA_CR else _SIZE
            else:  # _SIZE or _TRAILER: a line
                end = data.find(b"\n", pos)
                if end < 0:
                    self._line += data[pos:]
                    if len(self._line) > self.max_line_bytes:
                        self._line_too_long()
                    break
                if self._line:
                    self._line += data[pos:end]
                    line = bytes(self._line)
                    self._line.clear()
                else:
                    line = data[pos:end]
                pos = end + 1
                if len(line) > self.max_line_bytes:
                    self._line_too_long()
                if not line.endswith(b"\r"):
                    self._fail(f"{self._what()} line {_show(line)} does not end with CRLF")
                if state == _SIZE:
                    self._size_line(line[:-1])
                else:
                    self._trailer_line(line[:-1])
                    if self._state == _DONE:
                        self.unused = data[pos:]
                        break
        return b"".join(out)

    def _size_line(self, line: bytes) -> None:
        digits = _HEX.match(line).end()  # type: ignore[union-attr]  # "*" always matches
        rest = line[digits:]
        if not digits or (rest and not rest.lstrip(b" \t").startswith(b";")):
            self._fail(f"invalid chunk size line {_show(line)}")
        size = int(line[:digits], 16)
        if size > self.max_chunk_size:
            self._fail(
                f"chunk size {_show(line[:digits])} exceeds max_chunk_size ({self.max_chunk_size})"
            )
        if size:
            self._remaining = size
            self._state = _DATA
        else:
            self._state = _TRAILER

    def _trailer_line(self, line: bytes) -> None:
        if not line:
            self._state = _DONE
            return
        self._trailer_bytes += len(line) + 2
        if self._trailer_bytes > self.max_trailer_bytes:
            self._fail(f"trailer section exceeds max_trailer_bytes ({self.max_trailer_bytes})")
        colon = line.find(b":")
        if colon <= 0 or b" " in line[:colon] or b"\t" in line[:colon]:
            self._fail(f"malformed trailer field {_show(line)}")

    def _what(self) -> str:
        return "chunk size" if self._state == _SIZE else "trailer"

    def _line_too_long(self) -> NoReturn:
        self._fail(f"{self._what()} line longer than max_line_bytes ({self.max_line_bytes})")

    def _fail(self, message: str) -> NoReturn:
        self._error = message
        self._line.clear()
        raise ChunkedError(message)
