"""`meshd picker`: an Envoy ext_proc server that picks the endpoint for each inference request
with the same `filters/` router the sidecar uses, and answers in the Gateway API Inference
Extension's endpoint picker protocol (header + `envoy.lb` dynamic metadata).

Protocols followed (looked up, not copied):
- Envoy ExternalProcessor (envoyproxy/envoy:
  api/envoy/service/ext_proc/v3/external_processor.proto), bindings from the `xds-protos` wheel.
- Endpoint picker protocol (kubernetes-sigs/gateway-api-inference-extension:
  docs/proposals/004-endpoint-picker-protocol/README.md): `x-gateway-destination-endpoint`
  header and `envoy.lb` metadata with the same `ip:port[,ip:port...]` value; 503 when no
  endpoint is ready, 429 when shedding; the optional `envoy.lb.subset_hint` subset; gRPC health
  for "", `liveness`, `readiness` and the ext_proc service name.
- gRPC health checking (grpc/grpc: doc/health-checking.md), implemented here on a generic
  handler: its two messages have one field each.

Body modes: BUFFERED (Envoy waits for the headers answer, then sends the whole body; the
destination rides on the body answer) and FULL_DUPLEX_STREAMED (Envoy sends headers and body
without waiting; the headers answer is held until the body is complete, then the body is
sent back whole). With STREAMED Envoy holds body chunks until the headers are answered, so
only a header-based pick is possible there, unless Envoy sends the body without waiting
(`send_body_without_waiting_for_header_response`): then the headers answer is held until the
body is complete, and every held chunk is answered after it.

Request headers must be sent (`request_header_mode: SEND`): with them skipped Envoy passes the
headers on at once, so the router picks the upstream before the body (and the picker's answer)
arrive, and it ignores the header mutation and metadata of the body answer (seen with 1.40).

Fallbacks: with `--fallbacks N` the value is `primary,fallback1,...`; Envoy's override_host load
balancing policy walks the list on retries and reports the endpoint that served under
`envoy.lb` / `x-gateway-destination-endpoint-served` (selected_host_key), which the picker reads
on the response (or, failing that, the `upstream.address` response attribute) to charge the
skipped endpoints with a connect failure and the rest of the request to the one that served.

Traces (`--otlp-endpoint`): a span per decision, continuing the client's traceparent; the
answer sets `traceparent` naming that span (and `tracestate`: the span's, else the client's;
removed when there is none), so Envoy's upstream request, and the engine's work, continue the
trace under the decision. Without a tracer the client's headers pass untouched. Tested with
Envoy's own tracing off; with it on, Envoy's router may write its own span there instead.

Endpoints are static (`--endpoint`). To take engine state from meshd's control plane the
picker would run the sidecar's subscriber (meshd/control_feed.py ControlFeed) on its loop with
its router as the one pool (envoy/README.md, "Endpoints from the control plane").

The parts: meshd/extproc_picker.py (the ExternalProcessor: one stream per request),
meshd/extproc_messages.py (the protocol's names and messages), meshd/extproc_spans.py (the
spans), meshd/grpc_health.py (gRPC health); this file serves them and is the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from filters.disagg import FASTER_WHOLE_MARGIN_S, FASTER_WHOLE_STALL_WEIGHT, PREFILL_HEADERS
from filters.pool_router import POLICIES, EndpointSpec, PoolRouter
from meshd.extproc_messages import (
    DESTINATION_HEADER,
    EXT_PROC_SERVICE,
    METADATA_NAMESPACE,
    immediate,
)
from meshd.extproc_pd import PdSettings
from meshd.extproc_picker import (
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_MAX_BODY_BYTES,
    Decision,
    EndpointPicker,
    PickerSettings,
)
from meshd.grpc_health import NOT_SERVING, SERVICE_UNKNOWN, SERVING, HealthService
from meshd.heap import settle

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

log = logging.getLogger("meshd.picker")

HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)


# -- the server ----------------------------------------------------------------------------------


class PickerServer:
    """The grpc.aio server: ext_proc + health on one port."""

    def __init__(
        self,
        settings: PickerSettings,
        listen: str = "127.0.0.1:9002",
        *,
        router: PoolRouter | None = None,
        prefill_router: PoolRouter | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.picker = EndpointPicker(
            settings, router=router, prefill_router=prefill_router, tracer=tracer
        )
        self.listen = listen
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def health(self, service: str) -> int:
        if service not in HEALTH_SERVICES:
            return SERVICE_UNKNOWN
        if service == "liveness":
            return SERVING
        return SERVING if self.picker.serving else NOT_SERVING

    async def start(self) -> int:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, server)
        server.add_generic_rpc_handlers((HealthService(self.health),))
        self.port = server.add_insecure_port(self.listen)
        if not self.port:
            raise OSError(f"cannot listen on {self.listen}")
        await server.start()
        self._server = server
        return self.port

    async def drain_and_stop(self, grace_s: float | None = None) -> None:
        """Readiness goes NOT_SERVING, new picks get 503; running streams get `grace_s`."""
        self.picker.serving = False
        if self._server is not None:
            grace = self.picker.settings.drain_grace_s if grace_s is None else grace_s
            await self._server.stop(grace)
            self._server = None

    async def kill(self) -> None:
        """Stop at once, cancelling every stream (tests: the picker dies mid-run)."""
        if self._server is not None:
            await self._server.stop(None)
            self._server = None


# -- CLI -----------------------------------------------------------------------------------------


def endpoint_spec(text: str) -> EndpointSpec:
    """`host:port` or `host:port=GPU` (the --endpoint flag) as an EndpointSpec."""
    addr, _, gpu = text.partition("=")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port[=GPU], got {text!r}")
    return EndpointSpec(f"http://{addr}", gpu=gpu or None)


def _margin(text: str) -> float | None:
    """--faster-whole-margin-s: seconds >= 0, or 'off'."""
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds or 'off', got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "picker",
        help="run the Envoy ext_proc endpoint picker",
        description="Serve Envoy's ext_proc API: pick the endpoint for each inference request "
        "and answer in the Gateway API Inference Extension's endpoint picker protocol "
        f"({DESTINATION_HEADER} header and {METADATA_NAMESPACE} metadata). Prints "
        '{"event": "ready", "listen": ...} once it listens; SIGTERM drains.',
    )
    p.add_argument("--listen", default="127.0.0.1:9002", help="gRPC address (default %(default)s)")
    p.add_argument(
        "--endpoint",
        action="append",
        required=True,
        type=endpoint_spec,
        metavar="HOST:PORT[=GPU]",
        help="an engine endpoint; repeat for each (GPU e.g. H100)",
    )
    p.add_argument("--policy", choices=POLICIES, default="meshd")
    pd = p.add_argument_group(
        "prefill/decode",
        "With --prefill-endpoint the --endpoints are decode endpoints (each behind a proxy "
        "that runs the prefill step: a meshd sidecar, or llm-d's routing sidecar); a request "
        f"worth splitting names its prefill endpoint in {', '.join(PREFILL_HEADERS)}.",
    )
    pd.add_argument(
        "--prefill-endpoint",
        action="append",
        default=[],
        type=endpoint_spec,
        metavar="HOST:PORT[=GPU]",
        help="a prefill engine endpoint; repeat for each",
    )
    pd.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=256,
        help="uncached prompt tokens under which a request is served whole (default %(default)s)",
    )
    pd.add_argument(
        "--faster-whole-margin-s",
        type=_margin,
        default=FASTER_WHOLE_MARGIN_S,
        help="serve a request whole when a decode endpoint is predicted to give its first "
        "token sooner than the split by more than this many seconds...; 'off': never "
        "(default %(default)s)",
    )
    pd.add_argument(
        "--faster-whole-stall-weight",
        type=float,
        default=FASTER_WHOLE_STALL_WEIGHT,
        help="...plus this x the streams decoding on that endpoint x its predicted TTFT "
        "there (the stall its prefill puts into them) (default %(default)s)",
    )
    pd.add_argument(
        "--kv-link-gb-per-s",
        type=float,
        default=50.0,
        help="the KV link between prefill and decode engines, GB/s (default %(default)s)",
    )
    pd.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="KV bytes a token of the model occupies (default: the GPU profile's)",
    )
    p.add_argument("--max-in-flight", type=int, default=None, help="shed with 429 above this")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument(
        "--fallbacks",
        type=int,
        default=0,
        help="fallback endpoints after the primary in the answer (0 for ORIGINAL_DST clusters)",
    )
    p.add_argument(
        "--trust-routing-headers",
        action="store_true",
        help="parse x-meshd-* headers from Envoy (only when Envoy strips them from clients)",
    )
    p.add_argument(
        "--no-refuse-predicted-late",
        dest="refuse_predicted_late",
        action="store_false",
        help="try every request; by default a new task's request (x-meshd-deadline-ms, with "
        "--trust-routing-headers) that the best endpoint is predicted to finish after its "
        "deadline gets 429 deadline_unmeetable (filters/deadline.py)",
    )
    p.add_argument("--drain-grace-s", type=float, default=DEFAULT_DRAIN_GRACE_S)
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="export a span per decision over OTLP/gRPC (default: no spans at all)",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=1.0,
        help="share of new traces kept; a client's sampled flag is honoured (default 1.0)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = PickerSettings(
        endpoints=tuple(args.endpoint),
        policy=args.policy,
        trust_routing_headers=args.trust_routing_headers,
        max_body_bytes=args.max_body_bytes,
        max_in_flight=args.max_in_flight,
        fallbacks=args.fallbacks,
        refuse_predicted_late=args.refuse_predicted_late,
        drain_grace_s=args.drain_grace_s,
        pd=PdSettings(
            tuple(args.prefill_endpoint),
            min_prefill_tokens=args.min_prefill_tokens,
            kv_link_gb_per_s=args.kv_link_gb_per_s,
            kv_bytes_per_token=args.kv_bytes_per_token,
            faster_whole_margin_s=args.faster_whole_margin_s,
            faster_whole_stall_weight=args.faster_whole_stall_weight,
        )
        if args.prefill_endpoint
        else None,
    )
    provider: TracerProvider | None = None
    if args.otlp_endpoint:
        from meshd.telemetry import setup_tracing

        provider = setup_tracing("meshd-picker", args.otlp_endpoint, args.trace_sample_ratio)
    try:
        tracer = provider.get_tracer("meshd.picker") if provider is not None else None
        return asyncio.run(_serve(settings, args.listen, tracer))
    finally:
        if provider is not None:
            provider.shutdown()  # flushes the spans still queued


async def _serve(settings: PickerSettings, listen: str, tracer: Tracer | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = PickerServer(settings, listen, tracer=tracer)
    port = await server.start()
    # Started: what start-up built lives as long as the process; no full collection walks
    # it again (a stall of every request's decision; meshd/heap.py).
    log.info("froze %d objects built at start", settle())
    host = listen.rpartition(":")[0]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Once SIGTERM drains: a reader may send one as soon as this is read.
    print(json.dumps({"event": "ready", "listen": f"{host}:{port}"}), flush=True)
    await stop.wait()
    print(json.dumps({"event": "draining", "in_flight": server.picker.in_flight}), flush=True)
    await server.drain_and_stop()
    return 0


__all__ = [
    "DESTINATION_HEADER",
    "Decision",
    "EndpointPicker",
    "PickerServer",
    "PickerSettings",
    "endpoint_spec",
    "immediate",
    "register",
]


def main(argv: list[str] | None = None) -> int:
    """`python -m meshd.extproc picker ...`, for use before the CLI lists this module."""
    parser = argparse.ArgumentParser(prog="meshd")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
