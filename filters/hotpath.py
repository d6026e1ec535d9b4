"""The hot path's one import point: compiled (Cython) twins when built, else the
pure-Python references. Set MESHD_PURE_PYTHON=1 to force the pure-Python ones.

Callers import from here, never from the `_*_c` modules or the twins directly,
so the choice is made once per process and `meshd version` can report it.
"""

from __future__ import annotations

import os

from filters import blockhash as _blockhash_py
from filters import routing_headers as _routing_headers_py
from filters import sse as _sse_py
from filters.routing_headers import RoutingHeaders, TraceContext

IMPLEMENTATION: str

if os.environ.get("MESHD_PURE_PYTHON"):
    block_hashes = _blockhash_py.block_hashes
    parse_routing_headers = _routing_headers_py.parse_routing_headers
    SSEScanner = _sse_py.SSEScanner
    IMPLEMENTATION = "python (forced by MESHD_PURE_PYTHON)"
else:
    try:
        from filters import _blockhash_c, _routing_headers_c, _sse_c
    except ImportError:
        block_hashes = _blockhash_py.block_hashes
        parse_routing_headers = _routing_headers_py.parse_routing_headers
        SSEScanner = _sse_py.SSEScanner
        IMPLEMENTATION = "python (compiled extensions not built)"
    else:
        block_hashes = _blockhash_c.block_hashes  # type: ignore[assignment]
        parse_routing_headers = _routing_headers_c.parse_routing_headers  # type: ignore[assignment]
        SSEScanner = _sse_c.SSEScanner  # type: ignore[assignment,misc]
        IMPLEMENTATION = "cython"

__all__ = [
    "IMPLEMENTATION",
    "RoutingHeaders",
    "SSEScanner",
    "TraceContext",
    "block_hashes",
    "parse_routing_headers",
]
