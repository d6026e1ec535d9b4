"""Envoy + `meshd picker` (ext_proc) benchmark, and the renderer of envoy/extproc-picker.yaml
that it and tests/test_extproc.py share. In one run: (1) the picker's decision cost per
request, protobuf decode/encode of every ext_proc message included, paced at --rate; (2) the
latency added by Envoy alone, Envoy + picker and the meshd sidecar over direct, open loop at
--rate, same stub backends. Prints the figures and the ratios.

Run: `python -m loadtest.extproc_bench [--rate 200] [--duration 5] [--tokens 20]`.
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


def render_extproc_config(
    picker: tuple[str, int],
    backends: Sequence[tuple[str, int]],
    *,
    failure_mode_allow: bool = True,
    request_body_mode: str = "BUFFERED",
    response_body_mode: str = "NONE",
    listener_port: int = 0,
    admin_port: int = 0,
    template: Path = EXTPROC_CONFIG,
) -> dict[str, Any]:
    """The bootstrap of `template` with its ports, picker address, fallback endpoints, failure
    mode and body modes replaced; nothing else is touched."""
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
    if request_body_mode == "FULL_DUPLEX_STREAMED":
        # Envoy requires trailers to be sent in full-duplex mode (ext_proc config check).
        mode["request_trailer_mode"] = "SEND"
    if response_body_mode == "FULL_DUPLEX_STREAMED":
        mode["response_trailer_mode"] = "SEND"
    clusters = {c["name"]: c for c in resources["clusters"]}
    clusters["fallback"]["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
                for h, p in backends
            ]
        }
    ]
    (locality,) = clusters["meshd_picker"]["load_assignment"]["endpoints"]
    (ep,) = locality["lb_endpoints"]
    ep["endpoint"]["address"]["socket_address"] = {"address": picker[0], "port_value": picker[1]}
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

    from meshd.extproc import EndpointPicker, PickerSettings, _Stream, endpoint_spec

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


# -- (2) added latency -----------------------------------------------------------------------------


async def _run_load(endpoint: tuple[str, int], rate: float, duration_s: float, tokens: int) -> Any:
    from loadtest.openloop import Endpoint, LoadGenerator, completion_request, summarize

    gen = LoadGenerator([Endpoint(*endpoint)], completion_request(tokens))
    try:
        await gen.prewarm(4)
        await gen.closed_loop(1, 0.5)  # warm-up: connections and the picker's first views
        samples = await gen.open_loop(rate, duration_s, seed=1)
    finally:
        await gen.close()
    return summarize(samples, "open", target_rate=rate, connections=gen.connections_opened)


def added_latency(rate: float, duration_s: float, tokens: int) -> dict[str, Any]:
    from loadtest import overhead
    from loadtest.openloop import Endpoint

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="extproc-bench-") as tmp:
        work = Path(tmp)
        children: list[overhead.Child] = []
        envoys: list[EnvoyProcess] = []
        try:
            for i in range(2):
                cmd = [
                    sys.executable,
                    "-m",
                    "loadtest.stub_backend",
                    "--port",
                    "0",
                    "--tokens",
                    str(tokens),
                ]
                children.append(overhead.start_child(f"backend{i}", cmd, work, 30))
            backends = [Endpoint("127.0.0.1", int(c.ready["port"])) for c in children]
            hps = [(b.host, b.port) for b in backends]
            picker_cmd = [
                sys.executable,
                "-m",
                "meshd.extproc",
                "picker",
                "--listen",
                "127.0.0.1:0",
            ]
            for b in backends:
                picker_cmd += ["--endpoint", f"{b.host}:{b.port}"]
            picker = overhead.start_child("picker", picker_cmd, work, 30)
            children.append(picker)
            phost, _, pport = str(picker.ready["listen"]).rpartition(":")
            plain = start_envoy(render_static_config(hps), work / "envoy-plain")
            envoys.append(plain)
            picked = start_envoy(
                render_extproc_config((phost, int(pport)), hps), work / "envoy-picker"
            )
            envoys.append(picked)
            targets: dict[str, tuple[str, int]] = {
                "direct": hps[0],
                "envoy": plain.listener,
                "envoy+picker": picked.listener,
            }
            settings = overhead.Settings(
                rates=(rate,),
                duration_s=duration_s,
                serial_s=1,
                saturation_s=1,
                concurrency=1,
                backends=2,
                tokens=tokens,
                envoy_concurrency=1,
                warmup_s=0,
                quick=True,
                hotpath=False,
                meshd_overrides=(),
            )
            meshd, target = overhead.start_meshd(backends, settings, work)
            if meshd is not None:
                children.append(meshd)
                targets["meshd sidecar"] = (target.endpoints[0].host, target.endpoints[0].port)
            else:
                out["meshd_error"] = target.error
            for name, ep in targets.items():
                s = asyncio.run(_run_load(ep, rate, duration_s, tokens))
                out[name] = {
                    "ok": s.ok,
                    "errors": s.errors,
                    "ttfb_p50_ms": s.ttfb_ms.p50,
                    "ttfb_p99_ms": s.ttfb_ms.p99,
                    "ttlb_p50_ms": s.ttlb_ms.p50,
                    "ttlb_p99_ms": s.ttlb_ms.p99,
                }
        finally:
            for e in envoys:
                e.stop()
            for c in reversed(children):
                c.stop()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    cost = decision_cost(args.rate, args.duration)
    verdict = "meets" if cost["p99_ms"] < TARGET_DECISION_P99_MS else "MISSES"
    print(
        f"picker decision per request ({int(cost['requests'])} at {args.rate:g}/s, 8 endpoints, "
        f"~1.5 kB shared-prefix prompts): p50 {cost['p50_ms']:.3f} ms, p99 "
        f"{cost['p99_ms']:.3f} ms, max {cost['max_ms']:.3f} ms "
        f"({verdict} the p99 < {TARGET_DECISION_P99_MS:g} ms target)"
    )
    lat = added_latency(args.rate, args.duration, args.tokens)
    direct = lat["direct"]
    print(f"\nopen loop {args.rate:g} req/s x {args.duration:g} s, {args.tokens}-token streams")
    print(
        f"{'target':<15}{'ok':>6}{'err':>5}{'TTFB p50':>10}{'p99':>8}{'TTLB p50':>10}{'p99':>8}"
        f"{'+TTFB p50':>11}{'+TTLB p50':>11}"
    )
    for name, r in lat.items():
        if not isinstance(r, dict):
            continue
        print(
            f"{name:<15}{r['ok']:>6}{r['errors']:>5}{r['ttfb_p50_ms']:>10.2f}{r['ttfb_p99_ms']:>8.2f}"
            f"{r['ttlb_p50_ms']:>10.2f}{r['ttlb_p99_ms']:>8.2f}"
            f"{r['ttfb_p50_ms'] - direct['ttfb_p50_ms']:>+11.2f}"
            f"{r['ttlb_p50_ms'] - direct['ttlb_p50_ms']:>+11.2f}"
        )
    if "meshd_error" in lat:
        print(lat["meshd_error"])
    env, ep = lat["envoy"], lat["envoy+picker"]
    base = max(1e-9, env["ttfb_p50_ms"] - direct["ttfb_p50_ms"])
    print(
        f"\nratios (p50 TTFB): envoy+picker / envoy = "
        f"{ep['ttfb_p50_ms'] / env['ttfb_p50_ms']:.2f}x; added by the picker over Envoy alone "
        f"{ep['ttfb_p50_ms'] - env['ttfb_p50_ms']:+.2f} ms; "
        f"added over direct: {(ep['ttfb_p50_ms'] - direct['ttfb_p50_ms']) / base:.2f}x Envoy's"
    )
    if "meshd sidecar" in lat:
        m = lat["meshd sidecar"]
        print(
            f"envoy+picker / meshd sidecar = {ep['ttfb_p50_ms'] / m['ttfb_p50_ms']:.2f}x (p50 TTFB)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"decision": cost, "latency": lat}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
