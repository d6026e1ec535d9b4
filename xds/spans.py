"""The control plane's span vocabulary (meshd.telemetry re-exports it): xds/ depends on
nothing of meshd/, so its names live here. Spans themselves come from the tracer provider
the caller passes to ControlPlane (none: no spans, no cost)."""

from __future__ import annotations

SPAN_XDS_PUBLISH = "meshd.xds.publish"
SPAN_XDS_PUSH = "meshd.xds.push"
ATTR_XDS_NODE = "meshd.xds.node"
ATTR_XDS_TYPE_URL = "meshd.xds.type_url"
ATTR_XDS_VERSION = "meshd.xds.version"
ATTR_XDS_NONCE = "meshd.xds.nonce"
ATTR_XDS_RESOURCES = "meshd.xds.resources"  # resources in the message
ATTR_XDS_REMOVED = "meshd.xds.removed"
ATTR_XDS_DELTA = "meshd.xds.delta"  # delta xDS (else state of the world)
ATTR_XDS_NACK = "meshd.xds.nack"  # the client's error_detail, on the push it refused
ATTR_XDS_CHANGED = "meshd.xds.changed"  # resources a publish actually changed
ATTR_XDS_PEER = "meshd.xds.peer"  # the publisher's gRPC peer
ATTR_XDS_UNANSWERED = "meshd.xds.unanswered"  # the stream closed before the client answered
EVENT_XDS_NACK = "meshd.xds.nack"  # on a push span: the client refused it (error_detail)
# Shared with meshd's own spans (the same strings as meshd.telemetry's).
ATTR_ENGINE = "meshd.engine"
ATTR_REASON = "meshd.reason"
