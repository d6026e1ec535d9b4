"""The wire around meshd's listener without sockets, shared by its fuzz target
(fuzz/targets/http_request.py) and its tests (tests/test_listener.py): a transport that
collects what the listener writes, and a strict parser of what it wrote."""

from __future__ import annotations

import asyncio
from typing import Any


class FakeTransport(asyncio.Transport):
    """Collects what the listener writes; closing it tells the protocol on the next turn."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.out = bytearray()
        self.closing = False
        self.reading = True

    def write(self, data: Any) -> None:
        assert not self.closing, "a write after close"
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return 0


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The listener's answers, parsed strictly (Content-Length or chunked), Date left out."""
    out = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"an unfinished response head: {raw[:80]!r}"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(": ")
            headers[name.lower()] = value
        headers.pop("date", None)
        if status == 100 or headers.get("x-echo-method") == "HEAD":
            # "100 Continue" before the body is read, an answer to HEAD: no body
            out.append((status, headers, b""))
            raw = rest
            continue
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, raw = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                body += rest[:size]
                assert rest[size : size + 2] == b"\r\n", "bad chunk framing in a response"
                rest = rest[size + 2 :]
                if size == 0:
                    break
            raw = rest
        else:
            body, raw = rest, b""
        out.append((status, headers, body))
    return out
