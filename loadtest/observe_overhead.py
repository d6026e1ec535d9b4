"""What meshd/observe.py costs per request: begin .. finish of a streamed chat request with
one retry (two attempts, a first token, usage), with tracing and the access log off, each
on alone (tracing also at sample ratio 0: spans made, none recorded), and both on (spans
exported over OTLP/gRPC to a real receiver, tests/otlp_receiver.py; log lines to a temp
file). The baseline, measured in the same run, is the metric updates the sidecar made
itself before the observer (requests, duration, TTFT).

Run: `python -m loadtest.observe_overhead [--quick] [--requests N]`. Prints us/request and
the ratio to the baseline; one process, so figures are noisy on a shared box.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from filters.hotpath import parse_routing_headers
from filters.request import parse_inference_request
from meshd import telemetry
from meshd.access_log import AccessLogWriter
from meshd.metrics import DataPlaneMetrics
from meshd.observe import RequestObserver

BODY = b'{"model":"llama-3-8b","stream":true,"messages":[{"role":"user","content":"hi"}]}'
HEADERS = [("x-meshd-tenant", "acme"), ("x-meshd-task-id", "t-1"), ("x-request-id", "r")]
USAGE = {
    "prompt_tokens": 600,
    "completion_tokens": 64,
    "prompt_tokens_details": {"cached_tokens": 512},
}
UPSTREAM = [("x-request-id", "r"), ("via", "1.1 meshd")]


def one_request(observer: RequestObserver, i: int) -> None:
    inf = _INF
    now = time.monotonic()
    req = observer.begin("chat", "default", inf, _ROUTING, "r", now)
    a = req.attempt("http://10.0.0.1:8000", "H100", now)
    a.inject_headers(UPSTREAM)
    a.end("connect_error", 0, None, None, None, now)
    b = req.attempt("http://10.0.0.2:8000", "H100", now, reason="connect_error")
    b.inject_headers(UPSTREAM)
    b.first_token(now + 0.05)
    b.end("ok", 200, None, None, None, now + 0.5)
    req.finish("ok", USAGE, now + 0.5, status=200)


def baseline(metrics: DataPlaneMetrics, i: int) -> None:
    """The sidecar's own per-request metric calls before meshd/observe.py existed."""
    now = time.monotonic()
    metrics.ttft.labels("default", "http://10.0.0.2:8000").observe(0.05)
    metrics.requests.labels("chat", "default", "ok").inc()
    metrics.request_duration.labels("chat", "default").observe(time.monotonic() - now)


_INF = parse_inference_request("chat", BODY)
_ROUTING, _ = parse_routing_headers(HEADERS, True)


def time_per_call(fn: Callable[[int], None], n: int) -> float:
    for i in range(min(n, 500)):  # warm the label caches
        fn(i)
    gc.collect()
    best = float("inf")
    for _ in range(3):  # best of three: the others are the box's noise
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.observe_overhead")
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--quick", action="store_true", help="2,000 requests per case")
    args = p.parse_args(argv)
    n = 2_000 if args.quick else args.requests
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from otlp_receiver import OtlpReceiver
    from tqdm import tqdm

    receiver = OtlpReceiver().start()
    tmp = tempfile.TemporaryDirectory()
    results: dict[str, float] = {}
    cases = [
        "baseline",
        "observer: all off",
        "access log",
        "tracing (ratio 0)",
        "tracing (ratio 1)",
        "both on",
    ]
    try:
        for case in tqdm(cases, desc="cases", file=sys.stderr, leave=False):
            metrics = DataPlaneMetrics()
            if case == "baseline":
                results[case] = time_per_call(functools.partial(baseline, metrics), n)
                continue
            provider = None
            writer = None
            if case.startswith("tracing") or case == "both on":
                ratio = 0.0 if case == "tracing (ratio 0)" else 1.0
                provider = telemetry.setup_tracing(
                    "bench", receiver.endpoint, ratio, max_queue_size=1 << 16
                )
            if case in ("access log", "both on"):
                writer = AccessLogWriter(Path(tmp.name) / f"{len(results)}.jsonl")
            observer = RequestObserver(metrics, tracer_provider=provider, access_log=writer)
            results[case] = time_per_call(functools.partial(one_request, observer), n)
            observer.close()
    finally:
        receiver.stop()
        tmp.cleanup()
    base = results["baseline"]
    print(f"per request, {n} requests per case (best of 3), 2 attempts + first token + usage:")
    for case, us in results.items():
        print(f"  {case:<20} {us:8.1f} us   x{us / base:5.1f} baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
