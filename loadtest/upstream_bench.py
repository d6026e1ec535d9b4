"""Benchmark of meshd's upstream client against aiohttp's, measured in one run: sequential
200-token streamed completions from the zero-delay stub backend (time to first decoded
byte, time to the end, client CPU per request), and the chunked decoder's Cython twin
against the pure-Python one on a 1 MB chunked SSE body.

Run `python -m loadtest.upstream_bench [--requests N] [--rounds R] [--quick] [--json PATH]`.
The stub runs in a child process, so the CPU figures are the client's alone. The figures
quoted in filters/_chunked_c.pyx come from this script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from filters import chunked as chunked_py
from loadtest.hotpath_bench import time_per_call, vllm_chat_stream
from meshd.upstream import UpstreamPool

TOKENS = 200
DECODE_BYTES = 1 << 20
READ_SIZE = 64 * 1024  # bytes per simulated socket read
READY_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True)
class ClientResult:
    client: str
    requests: int
    ttfb_ms_p50: float  # request sent -> first decoded body byte
    ttfb_ms_p90: float
    end_ms_p50: float  # request sent -> end of body
    end_ms_p90: float
    cpu_ms_per_request: float  # this process's CPU (user + system) per request
    reads_per_request: float  # non-empty body pieces the client handed over


@dataclass(frozen=True, slots=True)
class DecodeResult:
    case: str
    pure_s: float
    cython_s: float | None
    ratio: float | None


def start_stub() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.stub_backend", "--port", "0", "--tokens", str(TOKENS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        with_event = json.loads(line) if line.startswith("{") else {}
        if with_event.get("event") == "ready":
            return proc, int(with_event["port"])
    proc.kill()
    raise RuntimeError("the stub backend did not print its ready line")


REQUEST_BODY = json.dumps(
    {"model": "stub-model", "prompt": "Say something.", "stream": True, "max_tokens": TOKENS}
).encode()
REQUEST_HEADERS = [("Content-Type", "application/json"), ("Accept", "text/event-stream")]

# One streamed request: returns (seconds to first byte, seconds to end, body pieces, bytes).
Fetch = Callable[[], Awaitable[tuple[float, float, int, int]]]


def aiohttp_client(base: str) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    # Configured as meshd/sidecar.py configures its session today.
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=0, limit_per_host=64, keepalive_timeout=30, enable_cleanup_closed=False
        ),
        timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5, sock_read=None),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
    )
    url = base + "/v1/completions"

    async def fetch() -> tuple[float, float, int, int]:
        t0 = time.perf_counter()
        first = 0.0
        pieces = size = 0
        resp = await session.request("POST", url, data=REQUEST_BODY, headers=REQUEST_HEADERS)
        async for piece in resp.content.iter_any():
            if not pieces:
                first = time.perf_counter()
            pieces += 1
            size += len(piece)
        end = time.perf_counter()
        resp.release()
        return first - t0, end - t0, pieces, size

    return fetch, session.close


def pool_client(base: str) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    pool = UpstreamPool(
        connect_timeout_s=5, keepalive_timeout_s=30, max_connections_per_endpoint=64
    )

    async def fetch() -> tuple[float, float, int, int]:
        t0 = time.perf_counter()
        first = 0.0
        pieces = size = 0
        resp = await pool.request(base, "POST", "/v1/completions", REQUEST_HEADERS, REQUEST_BODY)
        while piece := await resp.read():
            if not pieces:
                first = time.perf_counter()
            pieces += 1
            size += len(piece)
        end = time.perf_counter()
        resp.release()
        return first - t0, end - t0, pieces, size

    return fetch, pool.close


async def measure_clients(
    port: int, requests: int, rounds: int, gap_s: float = 0.0
) -> list[ClientResult]:
    base = f"http://127.0.0.1:{port}"
    clients = {"aiohttp.ClientSession": aiohttp_client(base), "UpstreamPool": pool_client(base)}
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in clients}
    cpu: dict[str, float] = dict.fromkeys(clients, 0.0)
    sizes: set[int] = set()
    for fetch, _ in clients.values():
        for _ in range(20):  # warm: connections, code paths, allocator
            await fetch()
    # Alternate the clients round by round, so drift on a shared machine hits both alike.
    for _ in range(rounds):
        for name, (fetch, _) in clients.items():
            c0 = time.process_time()
            for _ in range(requests):
                if gap_s:
                    await asyncio.sleep(gap_s)  # idle between requests, as at a low rate
                first, end, pieces, size = await fetch()
                samples[name].append((first, end, pieces))
                sizes.add(size)
            cpu[name] += time.process_time() - c0
    for _, close in clients.values():
        await close()
    if len(sizes) != 1:
        raise RuntimeError(f"the clients read different bodies: sizes {sorted(sizes)}")
    results = []
    for name, rows in samples.items():
        firsts = sorted(r[0] for r in rows)
        ends = sorted(r[1] for r in rows)
        results.append(
            ClientResult(
                client=name,
                requests=len(rows),
                ttfb_ms_p50=1e3 * statistics.median(firsts),
                ttfb_ms_p90=1e3 * firsts[int(0.9 * (len(firsts) - 1))],
                end_ms_p50=1e3 * statistics.median(ends),
                end_ms_p90=1e3 * ends[int(0.9 * (len(ends) - 1))],
                cpu_ms_per_request=1e3 * cpu[name] / len(rows),
                reads_per_request=statistics.mean(r[2] for r in rows),
            )
        )
    return results


def chunk_encode_events(stream: bytes) -> bytes:
    """One chunk per SSE event, as a server writing one event per write sends them."""
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


def decode(cls: Any, body: bytes, read_size: int) -> Callable[[], Any]:
    reads = [body[i : i + read_size] for i in range(0, len(body), read_size)]

    def go() -> Any:
        d = cls()
        out = [d.feed(r) for r in reads]
        assert d.done
        return out

    return go


def measure_decoder(repeats: int) -> list[DecodeResult]:
    try:
        from filters import _chunked_c  # type: ignore[attr-defined]
    except ImportError:
        compiled: Any = None
    else:
        compiled = _chunked_c.ChunkedDecoder
    body = chunk_encode_events(vllm_chat_stream(DECODE_BYTES))
    payload = b"".join(decode(chunked_py.ChunkedDecoder, body, READ_SIZE)())
    if compiled is not None and b"".join(decode(compiled, body, READ_SIZE)()) != payload:
        raise RuntimeError("the chunked twins decoded different payloads")
    # The stub's 200-token answer arriving in one read: the relay's case.
    stub_events = [b"data: " + b"x" * 180 + b"\n\n"] * TOKENS + [b"data: [DONE]\n\n"]
    stub_body = chunk_encode_events(b"".join(stub_events))
    cases = [
        ("1 MB chunked SSE body, 64 KiB reads", body, READ_SIZE),
        (f"{TOKENS}-event chunked answer, one read", stub_body, len(stub_body)),
    ]
    results = []
    for case, data, read_size in cases:
        pure_s = time_per_call(decode(chunked_py.ChunkedDecoder, data, read_size), repeats)
        cython_s = time_per_call(decode(compiled, data, read_size), repeats) if compiled else None
        ratio = pure_s / cython_s if cython_s else None
        results.append(DecodeResult(case, pure_s, cython_s, ratio))
    return results


def _ms(x: float) -> str:
    return f"{x:.3f}"


def format_report(
    clients: list[ClientResult], decoder: list[DecodeResult], gap_ms: float = 0.0
) -> str:
    gap = f", {gap_ms:g} ms idle before each" if gap_ms else ""
    lines = [
        f"sequential {TOKENS}-token streamed completions from the zero-delay stub "
        f"({clients[0].requests} requests per client{gap})",
        f"{'client':<24}{'ttfb p50':>10}{'ttfb p90':>10}{'end p50':>10}{'end p90':>10}"
        f"{'cpu/req':>10}{'reads/req':>11}",
    ]
    for c in clients:
        lines.append(
            f"{c.client:<24}{_ms(c.ttfb_ms_p50):>10}{_ms(c.ttfb_ms_p90):>10}"
            f"{_ms(c.end_ms_p50):>10}{_ms(c.end_ms_p90):>10}{_ms(c.cpu_ms_per_request):>10}"
            f"{c.reads_per_request:>11.1f}"
        )
    a, b = clients
    lines.append(
        f"{'ratio aiohttp/pool':<24}{a.ttfb_ms_p50 / b.ttfb_ms_p50:>10.2f}"
        f"{a.ttfb_ms_p90 / b.ttfb_ms_p90:>10.2f}{a.end_ms_p50 / b.end_ms_p50:>10.2f}"
        f"{a.end_ms_p90 / b.end_ms_p90:>10.2f}"
        f"{a.cpu_ms_per_request / b.cpu_ms_per_request:>10.2f}"
    )
    lines.append("(milliseconds; cpu/req is this client process's user+system CPU)")
    lines.append("")
    lines.append(f"{'chunked decode':<42}{'pure':>12}{'cython':>12}{'ratio':>8}")
    for d in decoder:
        cy = f"{d.cython_s * 1e6:.1f} us" if d.cython_s is not None else "not built"
        ratio = f"{d.ratio:.1f}x" if d.ratio is not None else "-"
        lines.append(f"{d.case:<42}{d.pure_s * 1e6:>9.1f} us{cy:>12}{ratio:>8}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.upstream_bench", description=__doc__)
    parser.add_argument("--requests", type=int, default=300, help="per client per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7, help="decoder timing repeats")
    parser.add_argument("--quick", action="store_true", help="100 requests x 2 rounds")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle pause before each request (default none)"
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.repeats = 100, 2, 5
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    gap_s = args.gap_ms / 1000.0
    proc, port = start_stub()
    try:
        if args.loop == "uvloop":
            import uvloop

            clients = uvloop.run(measure_clients(port, args.requests, args.rounds, gap_s))
        else:
            clients = asyncio.run(measure_clients(port, args.requests, args.rounds, gap_s))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    decoder = measure_decoder(args.repeats)
    print(format_report(clients, decoder, args.gap_ms))
    if args.json:
        doc = {
            "environment": {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "loop": args.loop,
                "gap_ms": args.gap_ms,
            },
            "clients": [asdict(c) for c in clients],
            "decoder": [asdict(d) for d in decoder],
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
