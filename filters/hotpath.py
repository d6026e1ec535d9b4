"""The hot path's one import point: compiled (Cython) twins when built, else the
pure-Python references. Set MESHD_PURE_PYTHON=1 to force the pure-Python ones.

Callers import from here, never from the `_*_c` modules or the twins directly,
so the choice is made once per process and `meshd version` can report it.
"""

from __future__ import annotations

import importlib
import os

from filters import blockhash as _blockhash_py
from filters import chunked as _chunked_py
from filters import http_fields as _http_fields_py
from filters import request as _request_py
from filters import request_head as _request_head_py
from filters import response_head as _response_head_py
from filters import routing_headers as _routing_headers_py
from filters import sse as _sse_py
from filters.routing_headers import RoutingHeaders, TraceContext

# The pure-Python twins define the types; the compiled ones match them exactly.
block_hashes = _blockhash_py.block_hashes
parse_routing_headers = _routing_headers_py.parse_routing_headers
SSEScanner: type[_sse_py.SSEScanner] = _sse_py.SSEScanner
ChunkedDecoder: type[_chunked_py.ChunkedDecoder] = _chunked_py.ChunkedDecoder
parse_response_head = _response_head_py.parse_response_head
read_request_fields = _http_fields_py.read_request_fields
split_fields = _http_fields_py.split_fields
read_simple_request = _request_head_py.read_simple_request
parse_inference_request = _request_py.parse_inference_request
IMPLEMENTATION = "python (forced by MESHD_PURE_PYTHON)"

if not os.environ.get("MESHD_PURE_PYTHON"):
    try:
        _compiled = [
            importlib.import_module(f"filters.{name}")
            for name in (
                "_blockhash_c",
                "_routing_headers_c",
                "_sse_c",
                "_chunked_c",
                "_response_head_c",
                "_http_fields_c",
                "_request_head_c",
                "_request_c",
            )
        ]
    except ImportError:
        IMPLEMENTATION = "python (compiled extensions not built)"
    else:
        block_hashes = _compiled[0].block_hashes
        parse_routing_headers = _compiled[1].parse_routing_headers
        SSEScanner = _compiled[2].SSEScanner
        ChunkedDecoder = _compiled[3].ChunkedDecoder
        parse_response_head = _compiled[4].parse_response_head
        read_request_fields = _compiled[5].read_request_fields
        split_fields = _compiled[5].split_fields
        read_simple_request = _compiled[6].read_simple_request
        parse_inference_request = _compiled[7].parse_inference_request
        IMPLEMENTATION = "cython"

__all__ = [
    "IMPLEMENTATION",
    "ChunkedDecoder",
    "RoutingHeaders",
    "SSEScanner",
    "TraceContext",
    "block_hashes",
    "parse_inference_request",
    "parse_response_head",
    "parse_routing_headers",
    "read_request_fields",
    "read_simple_request",
    "split_fields",
]
