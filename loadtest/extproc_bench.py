"""Envoy + `meshd picker` (ext_proc) benchmark, and the renderer of envoy/extproc-picker.yaml
that it and tests/test_extproc.py share. In one run: (1) the picker's decision cost per
request, protobuf decode/encode of every ext_proc message included, paced at --rate; (2) the
latency added by Envoy alone, Envoy + picker and the meshd sidecar over direct, open loop at
--rate, same stub backends. Prints the figures and the ratios.

Where the picker's added latency goes: a null ext_proc processor (grpc.aio, no work) shows
what grpcio's round trips cost on their own; the variants show what a round trip less buys.

Run: `python -m loadtest.extproc_bench [--rate 200] [--duration 6] [--rounds 3] [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from loadtest.envoy_bin import REPO_ROOT, EnvoyProcess, render_static_config, start_envoy

EXTPROC_CONFIG = REPO_ROOT / "envoy" / "extproc-picker.yaml"
FALLBACK_CONFIG = REPO_ROOT / "envoy" / "extproc-fallback.yaml"
PICKER_CLUSTER = "meshd_picker"


def render_extproc_config(
    picker: tuple[str, int],
    backends: Sequence[tuple[str, int]],
    *,
    failure_mode_allow: bool = True,
    request_body_mode: str = "BUFFERED",
    response_body_mode: str = "NONE",
    request_header_mode: str | None = None,
    response_header_mode: str | None = None,
    send_body_early: bool = False,
    listener_port: int = 0,
    admin_port: int = 0,
    template: Path = EXTPROC_CONFIG,
) -> dict[str, Any]:
    """The bootstrap of `template` with its ports, picker address, backend endpoints (every
    STATIC cluster but the picker's), failure mode and processing modes replaced; nothing else
    is touched. `request_header_mode`/`response_header_mode` None keep the template's (SEND);
    `send_body_early` sets send_body_without_waiting_for_header_response (STREAMED only)."""
    if not backends:
        raise ValueError("at least one backend")
    config: dict[str, Any] = copy.deepcopy(yaml.safe_load(template.read_text()))
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    resources = config["static_resources"]
    (listener,) = resources["listeners"]
    listener["address"]["socket_address"]["port_value"] = listener_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    cfg = ext_proc["typed_config"]
    cfg["failure_mode_allow"] = failure_mode_allow
    mode = cfg["processing_mode"]
    mode["request_body_mode"] = request_body_mode
    mode["response_body_mode"] = response_body_mode
    if request_header_mode is not None:
        mode["request_header_mode"] = request_header_mode
    if response_header_mode is not None:
        mode["response_header_mode"] = response_header_mode
    if send_body_early:
        cfg["send_body_without_waiting_for_header_response"] = True
    if request_body_mode == "FULL_DUPLEX_STREAMED":
        # Envoy requires trailers to be sent in full-duplex mode (ext_proc config check).
        mode["request_trailer_mode"] = "SEND"
    if response_body_mode == "FULL_DUPLEX_STREAMED":
        mode["response_trailer_mode"] = "SEND"
    endpoints = [
        {
            "lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
                for h, p in backends
            ]
        }
    ]
    for cluster in resources["clusters"]:
        if cluster["name"] == PICKER_CLUSTER:
            (locality,) = cluster["load_assignment"]["endpoints"]
            (ep,) = locality["lb_endpoints"]
            address = {"address": picker[0], "port_value": picker[1]}
            ep["endpoint"]["address"]["socket_address"] = address
        elif cluster.get("type") == "STATIC":
            cluster["load_assignment"]["endpoints"] = copy.deepcopy(endpoints)
    return config


# -- (1) decision cost ----------------------------------------------------------------------------

TARGET_DECISION_P99_MS = 2.0


def _messages(prompt: str, tokens: int) -> list[bytes]:
    """The ext_proc messages Envoy sends for one BUFFERED request, serialised."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    headers = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "gateway"),
        ("content-type", "application/json"),
        ("user-agent", "bench"),
        ("x-request-id", "6b1c2f0e-0000-4000-8000-000000000000"),
    ]
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
    )
    body = json.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": tokens, "stream": True}
    ).encode()
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm)).SerializeToString(),
        pb.ProcessingRequest(
            request_body=pb.HttpBody(body=body, end_of_stream=True)
        ).SerializeToString(),
        pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]
                )
            )
        ).SerializeToString(),
    ]


def decision_cost(rate: float, duration_s: float, endpoints: int = 8) -> dict[str, float]:
    """Drive EndpointPicker's message handler as the gRPC stream does, paced at `rate`, over
    a rolling set of shared-prefix prompts; the time of the request-side messages (headers +
    body: decode, parse, hash, pick, encode) is the decision cost per request."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from meshd.extproc import endpoint_spec
    from meshd.extproc_picker import EndpointPicker, PickerSettings, _Stream

    settings = PickerSettings(
        endpoints=tuple(endpoint_spec(f"10.0.0.{i + 1}:8000=H100") for i in range(endpoints))
    )
    picker = EndpointPicker(settings)
    system = [f"System prompt {g}: " + "be helpful and precise. " * 60 for g in range(16)]
    n = max(1, int(rate * duration_s))
    costs: list[float] = []
    pending: list[_Stream] = []
    t_start = time.perf_counter()
    for i in range(n):
        # Paced: the router's in-flight state is what it would be at this rate.
        wait = t_start + i / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        msgs = _messages(system[i % 16] + f" question {i}", 64)
        s = _Stream(rid=i + 1)
        t0 = time.perf_counter()
        for raw in msgs[:2]:
            for resp in picker._handle(s, pb.ProcessingRequest.FromString(raw)):
                resp.SerializeToString()
        costs.append(time.perf_counter() - t0)
        picker._handle(s, pb.ProcessingRequest.FromString(msgs[2]))
        pending.append(s)
        if len(pending) > 20:  # ~100 ms of residence at 200 req/s
            picker._close(pending.pop(0))
    costs.sort()
    return {
        "requests": float(n),
        "p50_ms": costs[len(costs) // 2] * 1e3,
        "p99_ms": costs[min(len(costs) - 1, int(len(costs) * 0.99))] * 1e3,
        "max_ms": costs[-1] * 1e3,
    }


def span_cost(n: int = 3000, endpoints: int = 8) -> dict[str, float]:
    """Mean time per request of the picker's whole message handling (headers, body, response
    headers, close), without a tracer and with one that exports nowhere (setup_tracing with no
    endpoint: spans are made and ended, then dropped), interleaved in blocks."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from meshd.extproc import endpoint_spec
    from meshd.extproc_picker import EndpointPicker, PickerSettings, _Stream
    from meshd.telemetry import setup_tracing

    settings = PickerSettings(
        endpoints=tuple(endpoint_spec(f"10.0.0.{i + 1}:8000=H100") for i in range(endpoints))
    )
    tracer = setup_tracing("meshd-picker-bench", None).get_tracer("bench")
    pickers = {"off": EndpointPicker(settings), "on": EndpointPicker(settings, tracer=tracer)}
    msgs = [
        [pb.ProcessingRequest.FromString(m) for m in _messages(f"prompt {i % 16} " * 80, 64)]
        for i in range(64)
    ]
    total = {"off": 0.0, "on": 0.0}
    block = 100
    for start in range(0, n, block):
        for name, picker in pickers.items():
            t0 = time.perf_counter()
            for i in range(start, start + block):
                s = _Stream(rid=i + 1)
                for m in msgs[i % 64]:
                    for resp in picker._handle(s, m):
                        resp.SerializeToString()
                picker._close(s)
            total[name] += time.perf_counter() - t0
    per = {k: v / n * 1e6 for k, v in total.items()}
    return {"off_us": per["off"], "on_us": per["on"], "span_us": per["on"] - per["off"]}


# -- (2) added latency -----------------------------------------------------------------------------

# Envoy + picker configurations compared; each is (template, render overrides, picker flags).
PickerVariant = tuple[Path, dict[str, Any], tuple[str, ...]]
VARIANTS: dict[str, PickerVariant] = {
    # envoy/extproc-picker.yaml as written: headers, then the BUFFERED body, response headers.
    "picker": (EXTPROC_CONFIG, {}, ()),
    # The body sent without waiting for the headers answer (STREAMED): one wait, not two.
    "picker streamed-early": (
        EXTPROC_CONFIG,
        {"request_body_mode": "STREAMED", "send_body_early": True},
        (),
    ),
    # No response headers to the picker: the round trip Envoy waits on before the first byte.
    "picker no-response": (EXTPROC_CONFIG, {"response_header_mode": "SKIP"}, ()),
    # envoy/extproc-fallback.yaml: override_host on the metadata, retries, 2 fallbacks.
    "picker fallback": (FALLBACK_CONFIG, {}, ("--fallbacks", "2")),
}
QUICK_VARIANTS = ("picker", "picker streamed-early")


async def _samples(
    endpoint: tuple[str, int], rate: float, duration_s: float, tokens: int, serial: int
) -> tuple[list[Any], list[Any]]:
    from loadtest.openloop import Endpoint, LoadGenerator, completion_request

    gen = LoadGenerator([Endpoint(*endpoint)], completion_request(tokens))
    try:
        await gen.prewarm(2)
        one = [await gen.one() for _ in range(serial)]
        open_ = await gen.open_loop(rate, duration_s, seed=1)
    finally:
        await gen.close()
    return one, open_


def _p50(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] * 1e3 if xs else float("nan")


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e3 if xs else float("nan")


def added_latency(
    rate: float,
    duration_s: float,
    tokens: int,
    *,
    rounds: int = 3,
    serial: int = 100,
    variants: Sequence[str] = tuple(VARIANTS),
    progress: bool = True,
) -> dict[str, Any]:
    """Direct, Envoy alone, a null ext_proc processor (grpcio's floor: answers at once, does
    nothing), each picker variant, and the meshd sidecar, against the same stub backends.
    Targets take turns in `rounds` rounds (each: `serial` one-at-a-time requests, then open
    loop at `rate` for duration_s/rounds), so drift on a shared machine hits all alike. Also
    the CPU seconds per request of each processor process."""
    from tqdm import tqdm

    from loadtest import overhead, procstats
    from loadtest.openloop import Endpoint

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="extproc-bench-") as tmp:
        work = Path(tmp)
        children: list[overhead.Child] = []
        envoys: list[EnvoyProcess] = []
        try:
            for i in range(3):
                cmd = [sys.executable, "-m", "loadtest.stub_backend", "--port", "0"]
                cmd += ["--tokens", str(tokens)]
                children.append(overhead.start_child(f"backend{i}", cmd, work, 30))
            backends = [Endpoint("127.0.0.1", int(c.ready["port"])) for c in children]
            hps = [(b.host, b.port) for b in backends]
            targets: dict[str, tuple[str, int]] = {"direct": hps[0]}
            pids: dict[str, int] = {}
            plain = start_envoy(render_static_config(hps), work / "envoy-plain")
            envoys.append(plain)
            targets["envoy"] = plain.listener

            def processor(
                name: str, cmd: list[str], template: Path, render: dict[str, Any]
            ) -> None:
                child = overhead.start_child(name.replace(" ", "-"), cmd, work, 30)
                children.append(child)
                host, _, port = str(child.ready["listen"]).rpartition(":")
                config = render_extproc_config((host, int(port)), hps, template=template, **render)
                e = start_envoy(config, work / f"envoy-{name.replace(' ', '-')}")
                envoys.append(e)
                targets[f"envoy+{name}"] = e.listener
                pids[f"envoy+{name}"] = child.proc.pid

            base = [sys.executable, "-m", "loadtest.extproc_bench"]
            null = [*base, "--serve-null", f"{hps[0][0]}:{hps[0][1]}"]
            processor("null processor", null, EXTPROC_CONFIG, {})
            for name in variants:
                template, render, flags = VARIANTS[name]
                cmd = [sys.executable, "-m", "meshd.extproc", "picker", "--listen", "127.0.0.1:0"]
                for b in backends:
                    cmd += ["--endpoint", f"{b.host}:{b.port}"]
                processor(name, [*cmd, *flags], template, render)
            settings = overhead.process_settings(tokens=tokens, backends=3, rate=rate)
            meshd, target = overhead.start_meshd(backends, settings, work)
            if meshd is not None:
                children.append(meshd)
                targets["meshd sidecar"] = (target.endpoints[0].host, target.endpoints[0].port)
            else:
                out["meshd_error"] = target.error
            one: dict[str, list[Any]] = {k: [] for k in targets}
            open_: dict[str, list[Any]] = {k: [] for k in targets}
            cpu = dict.fromkeys(targets, 0.0)
            bar = tqdm(total=rounds * len(targets), desc="rounds x targets", disable=not progress)
            for _ in range(rounds):
                for name, ep in targets.items():
                    pid = pids.get(name)
                    c0 = procstats.cpu_seconds(pid) if pid else 0.0
                    got = asyncio.run(_samples(ep, rate, duration_s / rounds, tokens, serial))
                    if pid:
                        cpu[name] += procstats.cpu_seconds(pid) - c0
                    one[name] += got[0]
                    open_[name] += got[1]
                    bar.update()
            bar.close()
            for name in targets:
                ok_one = [x.ttfb for x in one[name] if x.ok]
                ok_open = [x.ttfb for x in open_[name] if x.ok]
                n = len(one[name]) + len(open_[name])
                out[name] = {
                    "ok": len(ok_one) + len(ok_open),
                    "errors": n - len(ok_one) - len(ok_open),
                    "serial_ttfb_p50_ms": _p50(ok_one),
                    "ttfb_p50_ms": _p50(ok_open),
                    "ttfb_p99_ms": _p99(ok_open),
                    "ttlb_p50_ms": _p50([x.ttlb for x in open_[name] if x.ok]),
                    "cpu_us_per_request": cpu[name] / n * 1e6 if name in pids and n else None,
                }
        finally:
            for e in envoys:
                e.stop()
            for c in reversed(children):
                c.stop()
    return out


def serve_null(destination: str) -> int:
    """A null ext_proc processor on grpc.aio: answers every message at once, routing to
    `destination`; what grpcio costs with no picking at all."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from meshd.extproc_messages import DESTINATION_HEADER, set_header

    route = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(
            set_headers=[set_header(DESTINATION_HEADER, destination)]
        ),
        clear_route_cache=True,
    )
    answers = {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse(response=route)),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    }

    class Null(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: Any, context: Any) -> Any:
            async for req in request_iterator:
                answer = answers.get(req.WhichOneof("request") or "")
                if answer is not None:
                    yield answer

    async def main() -> int:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(Null(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(json.dumps({"event": "ready", "listen": f"127.0.0.1:{port}"}), flush=True)
        await server.wait_for_termination()
        return 0

    import grpc

    return asyncio.run(main())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--duration", type=float, default=6.0, help="open-loop seconds per target")
    p.add_argument("--rounds", type=int, default=3, help="turns each target takes")
    p.add_argument("--serial", type=int, default=100, help="one-at-a-time requests per round")
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="two variants, shorter: under 60 s")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--serve-null", metavar="HOST:PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_null:
        return serve_null(args.serve_null)
    if args.quick:
        args.duration, args.rounds, args.serial = min(args.duration, 2.0), 2, 40
    cost = decision_cost(args.rate, min(args.duration, 5.0))
    verdict = "meets" if cost["p99_ms"] < TARGET_DECISION_P99_MS else "MISSES"
    print(
        f"picker decision per request ({int(cost['requests'])} at {args.rate:g}/s, 8 endpoints, "
        f"~1.5 kB shared-prefix prompts): p50 {cost['p50_ms']:.3f} ms, p99 "
        f"{cost['p99_ms']:.3f} ms, max {cost['max_ms']:.3f} ms "
        f"({verdict} the p99 < {TARGET_DECISION_P99_MS:g} ms target)"
    )
    spans = span_cost(1000 if args.quick else 3000)
    print(
        f"picker messages per request, unpaced: {spans['off_us']:.1f} us without spans, "
        f"{spans['on_us']:.1f} us with a span per decision exported nowhere "
        f"(+{spans['span_us']:.1f} us; no --otlp-endpoint: no spans at all)"
    )
    variants = QUICK_VARIANTS if args.quick else tuple(VARIANTS)
    lat = added_latency(
        args.rate,
        args.duration,
        args.tokens,
        rounds=args.rounds,
        serial=args.serial,
        variants=variants,
    )
    direct = lat["direct"]
    print(
        f"\n{args.rounds} rounds; each: {args.serial} requests one at a time, then open loop "
        f"{args.rate:g} req/s x {args.duration / args.rounds:g} s; {args.tokens}-token streams"
    )
    print(
        f"{'target':<30}{'ok':>6}{'err':>5}{'1-at-a-time':>12}{'open p50':>10}{'p99':>8}"
        f"{'+1-at-a-time':>13}{'+open p50':>10}{'CPU/req':>9}"
    )
    for name, r in lat.items():
        if not isinstance(r, dict):
            continue
        cpu = f"{r['cpu_us_per_request']:.0f}us" if r["cpu_us_per_request"] is not None else "-"
        print(
            f"{name:<30}{r['ok']:>6}{r['errors']:>5}{r['serial_ttfb_p50_ms']:>12.2f}"
            f"{r['ttfb_p50_ms']:>10.2f}{r['ttfb_p99_ms']:>8.2f}"
            f"{r['serial_ttfb_p50_ms'] - direct['serial_ttfb_p50_ms']:>+13.2f}"
            f"{r['ttfb_p50_ms'] - direct['ttfb_p50_ms']:>+10.2f}{cpu:>9}"
        )
    if "meshd_error" in lat:
        print(lat["meshd_error"])
    env = lat["envoy"]
    print("\nover Envoy alone (p50 TTFB, one at a time / open loop):")
    for name, r in lat.items():
        if isinstance(r, dict) and name.startswith("envoy+"):
            print(
                f"  {name:<28} {r['serial_ttfb_p50_ms'] - env['serial_ttfb_p50_ms']:+.2f} ms / "
                f"{r['ttfb_p50_ms'] - env['ttfb_p50_ms']:+.2f} ms "
                f"({r['ttfb_p50_ms'] / env['ttfb_p50_ms']:.2f}x Envoy's open-loop p50)"
            )
    if "meshd sidecar" in lat:
        m, ep = lat["meshd sidecar"], lat["envoy+picker"]
        print(
            f"envoy+picker / meshd sidecar = {ep['ttfb_p50_ms'] / m['ttfb_p50_ms']:.2f}x "
            "(open-loop p50 TTFB)"
        )
    if args.json:
        doc = {"decision": cost, "spans": spans, "latency": lat}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
