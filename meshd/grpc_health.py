"""gRPC health checking (grpc/grpc: doc/health-checking.md) on a generic handler, for the
picker's port: its two messages have one field each, so a tiny codec replaces the generated
bindings. The caller's `status(service)` answers each check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

SERVING, NOT_SERVING, SERVICE_UNKNOWN = 1, 2, 3


def _decode_health_request(data: bytes) -> str:
    """HealthCheckRequest{string service = 1}: the only field, so a tiny decoder suffices."""
    i, n = 0, len(data)
    service = ""
    while i < n:
        tag, i = _varint(data, i)
        wire = tag & 7
        if wire == 2:
            length, i = _varint(data, i)
            if tag >> 3 == 1:
                service = data[i : i + length].decode("utf-8", "replace")
            i += length
        elif wire == 0:
            _, i = _varint(data, i)
        else:
            raise ValueError("unexpected wire type in HealthCheckRequest")
    return service


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _encode_health_response(status: int) -> bytes:
    return bytes((0x08, status))  # field 1, varint; the statuses are < 128


class HealthService(grpc.GenericRpcHandler):
    """grpc.health.v1.Health/Check (Watch answers UNIMPLEMENTED, which the spec allows
    clients to treat as "use Check")."""

    def __init__(self, status: Callable[[str], int]) -> None:
        self._status = status

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method != "/grpc.health.v1.Health/Check":
            return None
        return grpc.unary_unary_rpc_method_handler(
            self._check,
            request_deserializer=_decode_health_request,
            response_serializer=_encode_health_response,
        )

    async def _check(self, service: str, context: grpc.aio.ServicerContext[Any, Any]) -> int:
        status = self._status(service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return status
