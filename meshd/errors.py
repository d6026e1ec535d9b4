"""OpenAI-style error bodies, one shape for every error meshd itself returns:
`{"error": {"message", "type", "param", "code"}}`, as JSON or as an SSE event."""

from __future__ import annotations

import json

# HTTP status -> OpenAI error type, for errors meshd raises itself.
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    502: "upstream_error",
    503: "overloaded_error",
    504: "timeout_error",
    508: "server_error",
}


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """The event sent when a stream that has already begun cannot go on."""
    payload = json.dumps(error_body(status, message, code), separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
