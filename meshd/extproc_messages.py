"""The wire side of `meshd picker`: the endpoint picker protocol's names (the destination
header, the `envoy.lb` metadata, the served key, the subset hint) and the ext_proc messages the
picker reads and builds (a header to set, the immediate error answer, the endpoint that served).
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from meshd.errors import error_body

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Set by the data plane on the response: the endpoint that served (protocol v1.0.0); Envoy's
# override_host policy writes it with `selected_host_key`.
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Where Envoy puts the values of `request_attributes` / `response_attributes`.
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
UPSTREAM_ATTRIBUTE = "upstream.address"
# Response attributes the picker reads (the endpoint that served, when no metadata says so).
RESPONSE_ATTRIBUTES = (UPSTREAM_ATTRIBUTE,)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def host_port(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def set_header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(
    status: int, message: str, code: str, retry_after_s: float | None = None
) -> pb.ProcessingResponse:
    """An OpenAI-style JSON error Envoy sends to the client instead of forwarding."""
    body = json.dumps(error_body(status, message, code), separators=(",", ":")).encode()
    headers = [set_header("content-type", "application/json"), set_header("x-meshd-error", code)]
    if retry_after_s is not None:
        headers.append(set_header("retry-after", str(max(1, round(retry_after_s)))))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=body,
            details=f"meshd_{code}",
        )
    )


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint that served, as the data plane reports it: `envoy.lb` metadata first (the
    protocol's way), then the `upstream.address` response attribute."""
    md = req.metadata_context.filter_metadata
    if METADATA_NAMESPACE in md:
        fields = md[METADATA_NAMESPACE].fields
        if SERVED_KEY in fields:
            return fields[SERVED_KEY].string_value or None
    if ATTRIBUTES_NAMESPACE in req.attributes:
        fields = req.attributes[ATTRIBUTES_NAMESPACE].fields
        if UPSTREAM_ATTRIBUTE in fields:
            return fields[UPSTREAM_ATTRIBUTE].string_value or None
    return None


def subset_hint(md: base_pb2.Metadata) -> frozenset[str] | None:
    ns = md.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    lv = ns.fields[SUBSET_KEY].list_value
    return frozenset(v.string_value for v in lv.values)
