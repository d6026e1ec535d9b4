"""Benchmark of the Cython hot path against its pure-Python twins, measured in one run:
block hashing of a 100,000-token prompt, scanning a 1 MB vLLM-style SSE stream (in
1,400-byte reads, and one event per read as engines write them), routing-header
parsing per request, and the request body's parse (a small chat request, and the load
generator's streamed completion). `python -m loadtest.hotpath_bench [--json PATH]`.

The figures quoted in the docstrings of filters/_*_c.pyx come from this script.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

from filters import blockhash as blockhash_py
from filters import request as request_py
from filters import routing_headers as routing_headers_py
from filters import sse as sse_py
from filters.request import RequestKind

PROMPT_TOKENS = 100_000
BYTES_PER_TOKEN = 4  # English averages ~4 characters per BPE token
SSE_BYTES = 1 << 20
SSE_CHUNK = 1400  # about one TCP segment per read
MIN_REPEAT_S = 0.02  # each timed repeat runs the case at least this long

_SYLLABLES = ["ka", "to", "ri", "en", "the", "an", "st", "or", "ing", "al", "re", "de", "co"]


def word_text(n_bytes: int, seed: int = 1) -> str:
    """Deterministic word-like ASCII text with punctuation and newlines, `n_bytes` long."""
    rnd = random.Random(seed)
    words = ["".join(rnd.choice(_SYLLABLES) for _ in range(rnd.randint(1, 4))) for _ in range(4000)]
    parts: list[str] = []
    size = 0
    while size <= n_bytes:
        w = rnd.choice(words)
        r = rnd.random()
        if r < 0.06:
            w += ","
        elif r < 0.10:
            w += "."
        elif r < 0.11:
            w += "\n"
        parts.append(w)
        size += len(w) + 1
    return " ".join(parts)[:n_bytes]


def vllm_chat_stream(n_bytes: int, seed: int = 2) -> bytes:
    """A vLLM-shaped /v1/chat/completions stream (include_usage) of about `n_bytes`.

    One token per event as vLLM sends them; ~3% of tokens hold a newline or a quote,
    which JSON escapes, and some are non-ASCII.
    """
    rnd = random.Random(seed)
    vocab = [" the", " model", " cache", ",", ".", " token", " and", "ing", " ré", " 数据", " of"]
    head = '{"id":"chatcmpl-5d0e8a","object":"chat.completion.chunk","created":1718000000,'
    head += '"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":'
    tail = ',"logprobs":null,"finish_reason":null}]}'
    out = [b"data: " + (head + '{"role":"assistant","content":""}' + tail).encode() + b"\n\n"]
    size = len(out[0])
    n = 0
    while size < n_bytes:
        r = rnd.random()
        tok = "\n" if r < 0.02 else ' "' if r < 0.03 else rnd.choice(vocab)
        ev = b"data: " + (head + json.dumps({"content": tok}, ensure_ascii=False) + tail).encode()
        ev += b"\n\n"
        out.append(ev)
        size += len(ev)
        n += 1
    stop = head + '{"content":""},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}'
    usage = (
        '{"id":"chatcmpl-5d0e8a","object":"chat.completion.chunk","created":1718000000,'
        '"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],'
        f'"usage":{{"prompt_tokens":812,"total_tokens":{812 + n},"completion_tokens":{n}}}}}'
    )
    out += [b"data: " + stop.encode() + b"\n\n", b"data: " + usage.encode() + b"\n\n"]
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


REQUEST_HEADERS: list[tuple[str, str]] = [
    ("Host", "vllm-0.inference.svc:8000"),
    ("Content-Type", "application/json"),
    ("Accept", "text/event-stream"),
    ("User-Agent", "OpenAI/Python 1.40.0"),
    ("Content-Length", "1834"),
    ("X-Meshd-Tenant", "acme"),
    ("X-Meshd-Priority", "high"),
    ("X-Meshd-Deadline-Ms", "2500"),
    ("X-Meshd-Session-Id", "sess-01HZX3"),
    ("X-Meshd-Workflow-Id", "wf/research-42"),
    ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
]


# (kind, body): a small chat request, and loadtest.openloop's streamed completion.
REQUEST_BODIES: list[tuple[RequestKind, bytes]] = [
    (
        "chat",
        json.dumps(
            {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name three primes."},
                ],
                "stream": True,
                "max_tokens": 64,
            }
        ).encode(),
    ),
    (
        "completion",
        b'{"model": "stub-model", "max_tokens": 1, "stream": true, '
        b'"prompt": "Benchmark prompt: tell me about the quick brown fox."}',
    ),
]


@dataclass(frozen=True, slots=True)
class Result:
    case: str
    unit: str  # what one call does
    pure_s: float  # median seconds per call, pure Python
    cython_s: float | None  # median seconds per call, Cython (None: not built)
    ratio: float | None  # pure_s / cython_s


def time_per_call(fn: Callable[[], Any], repeats: int) -> float:
    """Median over `repeats` of the mean time of one call (calls batched to >= 20 ms)."""
    fn()  # warm caches, imports, allocator
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    number = max(1, int(MIN_REPEAT_S / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def scan(cls: Any, body: bytes, chunk: int) -> Callable[[], Any]:
    def go() -> Any:
        s = cls()
        for i in range(0, len(body), chunk):
            s.feed(body[i : i + chunk])
        return s.tokens

    return go


def scan_events(cls: Any, events: list[bytes]) -> Callable[[], Any]:
    def go() -> Any:
        s = cls()
        for e in events:
            s.feed(e)
        return s.tokens

    return go


def load_compiled() -> dict[str, ModuleType] | None:
    try:
        return {
            name: importlib.import_module(f"filters._{name}_c")
            for name in ("blockhash", "routing_headers", "sse", "request")
        }
    except ImportError:
        return None


def check_equal(compiled: dict[str, ModuleType], prompt: str, stream: bytes) -> None:
    """Refuse to report a speed-up for twins that disagree on the benchmark inputs."""
    if compiled["blockhash"].block_hashes(prompt, "m") != blockhash_py.block_hashes(prompt, "m"):
        raise SystemExit("twins disagree on block_hashes")
    a, b = sse_py.SSEScanner(collect_text=True), compiled["sse"].SSEScanner(collect_text=True)
    for i in range(0, len(stream), SSE_CHUNK):
        a.feed(stream[i : i + SSE_CHUNK])
        b.feed(stream[i : i + SSE_CHUNK])
    fields = ("events", "tokens", "done", "usage", "finish_reason", "response_id", "text")
    if any(getattr(a, f) != getattr(b, f) for f in fields):
        raise SystemExit("twins disagree on SSEScanner")
    for kind, body in REQUEST_BODIES:
        ref = request_py.parse_inference_request(kind, body)
        got = compiled["request"].parse_inference_request(kind, body)
        if got != ref or got.doc != ref.doc:
            raise SystemExit(f"twins disagree on parse_inference_request ({kind})")
    h_py = routing_headers_py.parse_routing_headers(REQUEST_HEADERS, True)
    if compiled["routing_headers"].parse_routing_headers(REQUEST_HEADERS, True) != h_py:
        raise SystemExit("twins disagree on parse_routing_headers")


def run(repeats: int, sse_chunk: int) -> tuple[list[Result], dict[str, Any]]:
    prompt = word_text(PROMPT_TOKENS * BYTES_PER_TOKEN)
    stream = vllm_chat_stream(SSE_BYTES)
    events = [e + b"\n\n" for e in stream.split(b"\n\n")[:-1]]
    compiled = load_compiled()
    if compiled is not None:
        check_equal(compiled, prompt, stream)
    cases: list[tuple[str, str, Callable[[], Any], Callable[[], Any] | None]] = [
        (
            "block_hashes",
            f"{PROMPT_TOKENS:,}-token prompt ({len(prompt.encode()):,} B, 64-byte blocks)",
            lambda: blockhash_py.block_hashes(prompt, "m"),
            (lambda: compiled["blockhash"].block_hashes(prompt, "m")) if compiled else None,
        ),
        (
            "SSEScanner.feed",
            f"{len(stream):,} B vLLM chat stream in {sse_chunk:,} B chunks",
            scan(sse_py.SSEScanner, stream, sse_chunk),
            scan(compiled["sse"].SSEScanner, stream, sse_chunk) if compiled else None,
        ),
        (
            "SSEScanner.feed/event",
            f"the same stream, {len(events):,} reads of one event each",
            scan_events(sse_py.SSEScanner, events),
            scan_events(compiled["sse"].SSEScanner, events) if compiled else None,
        ),
        (
            "parse_routing_headers",
            f"one request, {len(REQUEST_HEADERS)} headers (5 x-meshd, traceparent, tracestate)",
            lambda: routing_headers_py.parse_routing_headers(REQUEST_HEADERS, True),
            (
                (lambda: compiled["routing_headers"].parse_routing_headers(REQUEST_HEADERS, True))
                if compiled
                else None
            ),
        ),
    ]
    for kind, body in REQUEST_BODIES:
        pure_parse = functools.partial(request_py.parse_inference_request, kind, body)
        c_parse = (
            functools.partial(compiled["request"].parse_inference_request, kind, body)
            if compiled
            else None
        )
        cases.append(
            (f"parse_request/{kind}", f"a {len(body)} B {kind} request body", pure_parse, c_parse)
        )
    results = []
    for name, unit, pure_fn, c_fn in cases:
        p = time_per_call(pure_fn, repeats)
        c = time_per_call(c_fn, repeats) if c_fn is not None else None
        results.append(Result(name, unit, p, c, p / c if c else None))
    meta = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "repeats": repeats,
        "compiled": compiled is not None,
        "sse_events": stream.count(b"\n\n"),
    }
    return results, meta


def fmt_time(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.2f} us"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.hotpath_bench", description=__doc__)
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per case (median)")
    ap.add_argument("--sse-chunk", type=int, default=SSE_CHUNK, help="bytes per feed() call")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    results, meta = run(args.repeats, args.sse_chunk)
    print(
        f"meshd hot path: Cython vs pure Python (median of {args.repeats}, "
        f"Python {meta['python']}, {meta['machine']})"
    )
    if not meta["compiled"]:
        print("compiled twins not built: run `python setup.py build_ext --inplace`")
    print(f"{'case':<26} {'pure':>11} {'cython':>11} {'pure/cython':>12}  per call")
    for r in results:
        ratio = f"{r.ratio:.1f}x" if r.ratio is not None else "n/a"
        print(
            f"{r.case:<26} {fmt_time(r.pure_s):>11} {fmt_time(r.cython_s):>11} "
            f"{ratio:>12}  {r.unit}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
