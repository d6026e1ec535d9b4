"""What can go wrong with an upstream exchange: the exceptions meshd/upstream.py's pool
raises, each naming the endpoint, which the attempts layer and the relay tell apart.
"""

from __future__ import annotations

__all__ = [
    "StaleConnection",
    "UpstreamClosedError",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "describe_error",
]


class UpstreamError(Exception):
    """The upstream exchange failed; the message names the endpoint."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(f"{endpoint}: {message}")
        self.endpoint = endpoint


class UpstreamConnectError(UpstreamError):
    """No connection (refused, timed out, unresolvable, pool exhausted): nothing was sent."""


class UpstreamProtocolError(UpstreamError):
    """The upstream broke HTTP/1.1 framing or a limit (status line, fields, head size, chunks)."""


class UpstreamClosedError(UpstreamError):
    """The connection closed or reset after the request was sent, before the body's end."""


class StaleConnection(Exception):
    """A reused keep-alive connection closed before any response byte: retry on a fresh one."""


def describe_error(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
