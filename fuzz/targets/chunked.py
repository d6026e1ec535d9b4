"""Chunked body decoder: filters/_chunked_c.pyx against filters/chunked.py.

The input is a chunked body as an upstream sends it. Both twins, with the default limits
and with small ones, get the same reads and must return the same bytes (or raise the same
ChunkedError) after every feed(); fed whole, a body that decodes must give the same payload,
`done` and `unused` as fed in pieces. Documented error: ChunkedError only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fuzz.common import agree, outcome, splits

INCLUDE = ["filters"]


def setup() -> Callable[[bytes], None]:
    from filters import _chunked_c as compiled  # type: ignore[attr-defined]
    from filters import chunked as pure
    from filters.chunked import ChunkedError

    documented = (ChunkedError,)
    limits: list[dict[str, int]] = [
        {},
        {"max_line_bytes": 32, "max_chunk_size": 300, "max_trailer_bytes": 64},
    ]

    def state(d: Any) -> tuple[bool, bytes]:
        return (d.done, d.unused)

    def run(cls: Any, kw: dict[str, int], reads: list[bytes]) -> list[Any]:
        d = cls(**kw)
        trace = []
        for r in reads:
            trace.append(outcome(documented, d.feed, r))
            trace.append(state(d))
        return trace

    def one_input(data: bytes) -> None:
        reads = splits(data)
        for kw in limits:
            c = run(compiled.ChunkedDecoder, kw, reads)
            p = run(pure.ChunkedDecoder, kw, reads)
            agree(f"chunked {kw or 'default limits'}", c, p)
            whole = run(pure.ChunkedDecoder, kw, [data] if data else [])
            # An error is sticky: every later feed() raises it again; compare the first.
            w_err = [o for o in whole[::2] if o[0] == "error"][:1]
            p_err = [o for o in p[::2] if o[0] == "error"][:1]
            if w_err or p_err:
                agree("chunked whole/split error", w_err, p_err, ("whole", "split"))
                continue
            joined = b"".join(o[1][1] for o in p[::2])
            agree(
                "chunked whole/split",
                (whole[0][1][1] if whole else b"", whole[-1] if whole else (False, b"")),
                (joined, p[-1] if p else (False, b"")),
                ("whole", "split"),
            )

    return one_input
