"""The request body's parse: filters/_request_c.pyx against filters/request.py (what the
sidecar's request layer runs, compiled, against its reference).

The input is a request body, parsed as a chat, a completion and an embedding request.
Both twins must give the same InferenceRequest (its type, every field with its type, and
its parsed `doc`) or the same RequestError (message, param, code). Documented error:
RequestError only; RecursionError and ValueError (the stdlib's own, a body nested near
the recursion limit or an integer past the digit limit) must then come from both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fuzz.common import agree, typed

INCLUDE = ["filters"]


def setup() -> Callable[[bytes], None]:
    from filters import _request_c as compiled  # type: ignore[attr-defined]
    from filters import request as pure

    def parse(fn: Any, kind: str, body: bytes) -> Any:
        try:
            r = fn(kind, body)
        except pure.RequestError as exc:
            return ("error", type(exc).__name__, str(exc), exc.param, exc.code)
        except (RecursionError, ValueError) as exc:
            return ("raised", type(exc).__name__)
        return ("ok", type(r).__name__, typed(r), typed(r.doc))

    def one_input(data: bytes) -> None:
        for kind in ("chat", "completion", "embedding"):
            agree(
                f"request {kind}",
                parse(compiled.parse_inference_request, kind, data),
                parse(pure.parse_inference_request, kind, data),
            )

    return one_input
