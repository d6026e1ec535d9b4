"""The request body's parse (filters/request.py): msgspec's decode with json.loads where
msgspec refuses (what the sidecar runs) against json.loads alone (the reference).

The input is a request body, parsed as a chat, a completion and an embedding request.
Both must give the same InferenceRequest (its parsed `doc` included, with value types) or
the same RequestError (message and param). Documented error: RequestError only. The one
documented difference: a body nested within a few levels of the recursion limit, which
json.loads refuses ("nests too deeply") and msgspec decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fuzz.common import agree, outcome, typed

INCLUDE = ["filters"]


def setup() -> Callable[[bytes], None]:
    from filters import request as rq

    documented = (rq.RequestError,)

    def parse(kind: Any, body: bytes, loads: Any) -> Any:
        try:
            r = rq._parse(kind, body, loads)
        except rq.RequestError as exc:
            return ("error", str(exc), exc.param, exc.code)
        return ("ok", typed(r), typed(r.doc))

    def one_input(data: bytes) -> None:
        for kind in ("chat", "completion", "embedding"):
            fast = parse(kind, data, rq._loads)
            ref = parse(kind, data, rq._loads_stdlib)
            if ref[0] == "error" and ref[1] == "the request body nests too deeply to parse":
                continue  # the documented band (see the module docstring)
            agree(f"request {kind}", fast, ref, ("msgspec", "json.loads"))
        # What the sidecar calls: only RequestError may leave it.
        outcome(documented, rq.parse_inference_request, "chat", data)

    return one_input
