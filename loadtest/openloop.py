"""Open-loop (Poisson arrivals) and closed-loop (saturation) HTTP load generator.

Measures, per request, time to first body byte and to last byte of a streamed answer.
Lean on purpose: raw asyncio protocols over keep-alive HTTP/1.1 connections, no HTTP
client library, so the generator costs less CPU than the proxy it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast
from urllib.parse import urlsplit

from loadtest.procstats import self_cpu_seconds

# A response head larger than this is treated as a protocol error, not buffered forever.
MAX_HEAD_BYTES = 64 * 1024
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_TOKENS = 200
_SSE_DONE = b"data: [DONE]"
# Bytes of the body's end kept to check that a stream really finished with [DONE].
_TAIL_BYTES = 64
# A chunked body ends with the CRLF of its last data chunk, then the zero-size chunk.
_LAST_CHUNK = b"\r\n0\r\n\r\n"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where requests go: a host and port speaking HTTP/1.1."""

    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """`http://host:port` (any path is ignored) or a bare `host:port`."""
        parts = urlsplit(url if "//" in url else f"http://{url}")
        if parts.scheme != "http" or parts.hostname is None or parts.port is None:
            raise ValueError(f"expected http://HOST:PORT, got {url!r}")
        return cls(parts.hostname, parts.port)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class RequestTemplate:
    """One request, encoded once per endpoint and replayed."""

    path: str
    body: bytes
    expect_sse: bool = True

    def encode(self, endpoint: Endpoint) -> bytes:
        head = (
            f"POST {self.path} HTTP/1.1\r\n"
            f"Host: {endpoint}\r\n"
            "Content-Type: application/json\r\n"
            "Accept: text/event-stream\r\n"
            f"Content-Length: {len(self.body)}\r\n\r\n"
        )
        return head.encode("ascii") + self.body


def completion_request(
    max_tokens: int = DEFAULT_TOKENS,
    *,
    prompt: str = "Benchmark prompt: tell me about the quick brown fox.",
    model: str = "stub-model",
    stream: bool = True,
    path: str = "/v1/completions",
) -> RequestTemplate:
    """An OpenAI completions request (`path` may be /v1/chat/completions: messages are sent)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if path.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return RequestTemplate(path=path, body=json.dumps(body).encode(), expect_sse=stream)


@dataclass(frozen=True, slots=True)
class Sample:
    """One request's outcome. Times are seconds; `start` is time.perf_counter()."""

    start: float
    lag: float  # start minus the arrival time the schedule asked for (open loop only)
    ttfb: float  # to the first body byte; nan if none came
    ttlb: float  # to the last body byte (or the failure)
    status: int  # 0 when no status line arrived
    nbytes: int  # body bytes on the wire, chunk framing included
    error: str = ""  # empty when the request succeeded

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Latency figures in milliseconds."""

    p50: float
    p90: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, values_s: Sequence[float]) -> Percentiles:
        values = sorted(v * 1000.0 for v in values_s if not math.isnan(v))
        if not values:
            nan = math.nan
            return cls(nan, nan, nan, nan, nan)
        return cls(
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            mean=sum(values) / len(values),
            max=values[-1],
        )


@dataclass(frozen=True, slots=True)
class Summary:
    """What a run achieved. `offered_rate`: requests started per second of the sending window;
    `throughput`: successful requests per second from the first start to the last end."""

    mode: str
    requests: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    duration_s: float
    offered_rate: float
    throughput: float
    ttfb_ms: Percentiles
    ttlb_ms: Percentiles
    lag_p99_ms: float
    bytes_total: int
    connections: int
    target_rate: float | None = None
    concurrency: int | None = None
    generator_cpu_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile `q` (0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def poisson_arrivals(
    rate: float, duration_s: float, *, max_requests: int | None = None, seed: int = 0
) -> list[float]:
    """Arrival offsets (s from start) of a Poisson process at `rate`/s, within `duration_s`."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s and (max_requests is None or len(out) < max_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class ProtocolError(Exception):
    """The server's response could not be framed."""


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self.reusable = True
        self._fut: asyncio.Future[Sample] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reset(0.0, 0.0, False)

    def _reset(self, start: float, lag: float, expect_sse: bool) -> None:
        self._start = start
        self._lag = lag
        self._expect_sse = expect_sse
        self._head = bytearray()
        self._in_body = False
        self._status = 0
        self._chunked = False
        self._until_close = False
        self._remaining = 0
        self._ttfb = -1.0
        self._nbytes = 0
        self._tail = b""

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Nagle plus delayed ACK would stall the small request write.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        if self._fut is None:
            return
        if self._in_body and self._until_close:
            self._finish(time.perf_counter(), "")
        else:
            self._finish(time.perf_counter(), "closed" if exc is None else type(exc).__name__)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._fut is None:
            self.reusable = False  # bytes nobody asked for: this connection is out of step
            return
        if not self._in_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_HEAD_BYTES:
                    self._fail(now, "head_too_large")
                return
            try:
                self._parse_head(bytes(self._head[:end]))
            except (ProtocolError, ValueError, IndexError):
                self._fail(now, "bad_head")
                return
            data = bytes(self._head[end + 4 :])
            self._in_body = True
            if self._remaining == 0 and not self._chunked and not self._until_close:
                self._ttfb = now
                self._finish(now, "")
                return
            if not data:
                return
        if self._ttfb < 0:
            self._ttfb = now
        self._nbytes += len(data)
        tail = data[-_TAIL_BYTES:] if len(data) >= _TAIL_BYTES else (self._tail + data)
        self._tail = tail[-_TAIL_BYTES:]
        if self._chunked:
            # The end of a chunked body is found from its last bytes, not by parsing each
            # chunk: parsing cost the generator 40% of its CPU. Sound for SSE bodies, whose
            # events never hold a bare "0" line between CRLFs (JSON escapes CR and LF).
            done = tail.endswith(_LAST_CHUNK) or tail == _LAST_CHUNK[2:]
        elif self._until_close:
            return
        else:
            self._remaining -= len(data)
            done = self._remaining <= 0
        if done:
            self._finish(now, "")

    # -- one exchange ------------------------------------------------------------------
    def send(
        self, payload: bytes, start: float, lag: float, expect_sse: bool
    ) -> asyncio.Future[Sample]:
        assert self.transport is not None
        self._fut = self._loop.create_future()
        self._reset(start, lag, expect_sse)
        self._timer = self._loop.call_later(self._timeout_s, self._on_timeout)
        self.transport.write(payload)
        return self._fut

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if not status_line[0].startswith(b"HTTP/1."):
            raise ProtocolError("not HTTP/1.x")
        self._status = int(status_line[1])
        length: int | None = None
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif name == b"connection" and b"close" in value.lower():
                self.reusable = False
        if self._chunked:
            return
        if length is None:
            self._until_close = True
            self.reusable = False
        else:
            self._remaining = length

    def _on_timeout(self) -> None:
        self._timer = None
        self._fail(time.perf_counter(), "timeout")

    def _fail(self, now: float, error: str) -> None:
        self.reusable = False
        self._finish(now, error)
        if self.transport is not None:
            self.transport.abort()

    def _finish(self, now: float, error: str) -> None:
        fut = self._fut
        if fut is None:
            return
        self._fut = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not error and self._status != 200:
            error = f"http_{self._status}"
        if not error and self._expect_sse and _SSE_DONE not in self._tail:
            error = "no_done"
        start = self._start
        ttfb = self._ttfb - start if self._ttfb >= 0 else math.nan
        sample = Sample(start, self._lag, ttfb, now - start, self._status, self._nbytes, error)
        if not fut.done():
            fut.set_result(sample)


class LoadGenerator:
    """Sends `request` to `endpoints` (round robin) over pooled keep-alive connections."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        request: RequestTemplate,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint")
        self._endpoints = tuple(endpoints)
        self._payloads = {ep: request.encode(ep) for ep in self._endpoints}
        self._expect_sse = request.expect_sse
        self._timeout_s = timeout_s
        self._idle: dict[Endpoint, list[_Connection]] = {ep: [] for ep in self._endpoints}
        self._next = 0
        self.connections_opened = 0
        self.completed = 0

    async def _connect(self, ep: Endpoint) -> _Connection:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(
            lambda: _Connection(loop, self._timeout_s), ep.host, ep.port
        )
        self.connections_opened += 1
        return proto

    async def prewarm(self, per_endpoint: int) -> None:
        """Open idle connections ahead of a run, so the run measures requests, not connects."""
        conns = await asyncio.gather(
            *(self._connect(ep) for ep in self._endpoints for _ in range(per_endpoint))
        )
        for conn, ep in zip(
            conns, [ep for ep in self._endpoints for _ in range(per_endpoint)], strict=True
        ):
            self._idle[ep].append(conn)

    async def one(self, scheduled: float | None = None) -> Sample:
        """One request; latency counts from now, so a connect (if no idle one) is included."""
        ep = self._endpoints[self._next]
        self._next = (self._next + 1) % len(self._endpoints)
        start = time.perf_counter()
        lag = 0.0 if scheduled is None else start - scheduled
        idle = self._idle[ep]
        conn: _Connection | None = None
        while idle:
            candidate = idle.pop()
            if candidate.reusable:
                conn = candidate
                break
        if conn is None:
            try:
                async with asyncio.timeout(self._timeout_s):
                    conn = await self._connect(ep)
            except (OSError, TimeoutError) as exc:
                now = time.perf_counter()
                self.completed += 1
                return Sample(
                    start, lag, math.nan, now - start, 0, 0, f"connect_{type(exc).__name__}"
                )
        sample = await conn.send(self._payloads[ep], start, lag, self._expect_sse)
        self.completed += 1
        if conn.reusable:
            idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()
        return sample

    async def open_loop(
        self,
        rate: float,
        duration_s: float,
        *,
        max_requests: int | None = None,
        seed: int = 0,
        progress: bool = False,
    ) -> list[Sample]:
        """Requests at Poisson arrival times, whatever the server's pace (no coordinated
        omission: a slow answer does not delay the next arrival)."""
        arrivals = poisson_arrivals(rate, duration_s, max_requests=max_requests, seed=seed)
        tasks: list[asyncio.Task[Sample]] = []
        with _progress(progress, len(arrivals), f"open {rate:g}/s", lambda: self.completed):
            base = time.perf_counter()
            for offset in arrivals:
                due = base + offset
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(self.one(due)))
            return list(await asyncio.gather(*tasks))

    async def closed_loop(
        self, concurrency: int, duration_s: float, *, progress: bool = False
    ) -> list[Sample]:
        """`concurrency` clients each sending back to back until `duration_s` is over."""
        deadline = time.perf_counter() + duration_s
        samples: list[Sample] = []

        async def client() -> None:
            while time.perf_counter() < deadline:
                samples.append(await self.one())

        with _progress(progress, None, f"saturate c={concurrency}", lambda: self.completed):
            await asyncio.gather(*(client() for _ in range(concurrency)))
        return samples

    async def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
            idle.clear()


@contextlib.contextmanager
def _progress(enabled: bool, total: int | None, desc: str, done: Callable[[], int]) -> Any:
    """A tqdm bar on stderr, refreshed by a timer rather than per request (cheaper)."""
    if not enabled:
        yield
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield
        return
    # disable=None: no bar when stderr is not a terminal (logs, CI).
    bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="req", leave=False, disable=None)
    first = done()
    loop = asyncio.get_running_loop()
    handle: asyncio.TimerHandle | None = None

    def tick() -> None:
        nonlocal handle
        bar.n = done() - first
        bar.refresh()
        handle = loop.call_later(0.5, tick)

    tick()
    try:
        yield
    finally:
        if handle is not None:
            handle.cancel()
        bar.n = done() - first
        bar.close()


def summarize(
    samples: Sequence[Sample],
    mode: str,
    *,
    target_rate: float | None = None,
    concurrency: int | None = None,
    connections: int = 0,
    generator_cpu_s: float = 0.0,
) -> Summary:
    """Percentiles over successful requests, rates over the whole run."""
    ok = [s for s in samples if s.ok]
    kinds: dict[str, int] = {}
    for s in samples:
        if s.error:
            kinds[s.error] = kinds.get(s.error, 0) + 1
    if samples:
        first = min(s.start for s in samples)
        last_start = max(s.start for s in samples)
        last_end = max(s.start + s.ttlb for s in samples)
        elapsed = max(last_end - first, 1e-9)
        window = last_start - first
        # n arrivals span n-1 gaps; scale so a steady stream reads as its true rate.
        offered = (len(samples) - 1) / window if window > 0 else math.nan
    else:
        elapsed = 0.0
        offered = math.nan
    lags = sorted(s.lag * 1000.0 for s in samples)
    return Summary(
        mode=mode,
        requests=len(samples),
        ok=len(ok),
        errors=len(samples) - len(ok),
        error_kinds=kinds,
        duration_s=elapsed,
        offered_rate=offered,
        throughput=len(ok) / elapsed if elapsed > 0 else math.nan,
        ttfb_ms=Percentiles.of([s.ttfb for s in ok]),
        ttlb_ms=Percentiles.of([s.ttlb for s in ok]),
        lag_p99_ms=percentile(lags, 99),
        bytes_total=sum(s.nbytes for s in samples),
        connections=connections,
        target_rate=target_rate,
        concurrency=concurrency,
        generator_cpu_s=generator_cpu_s,
    )


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One generator run, as the CLI (or another script) asks for it."""

    endpoints: tuple[Endpoint, ...]
    request: RequestTemplate
    rate: float | None = None  # open loop when set
    concurrency: int = 32  # closed loop otherwise
    duration_s: float = 10.0
    max_requests: int | None = None
    prewarm: int = 4
    seed: int = 0
    progress: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S


async def run(spec: RunSpec) -> tuple[Summary, list[Sample]]:
    """Carry out `spec` and summarise it (the generator's own CPU included)."""
    gen = LoadGenerator(spec.endpoints, spec.request, timeout_s=spec.timeout_s)
    try:
        await gen.prewarm(spec.prewarm)
        times0 = self_cpu_seconds()
        if spec.rate is not None:
            samples = await gen.open_loop(
                spec.rate,
                spec.duration_s,
                max_requests=spec.max_requests,
                seed=spec.seed,
                progress=spec.progress,
            )
            mode = "open"
        else:
            samples = await gen.closed_loop(
                spec.concurrency, spec.duration_s, progress=spec.progress
            )
            mode = "closed"
        cpu = self_cpu_seconds() - times0
    finally:
        await gen.close()
    summary = summarize(
        samples,
        mode,
        target_rate=spec.rate,
        concurrency=None if spec.rate is not None else spec.concurrency,
        connections=gen.connections_opened,
        generator_cpu_s=cpu,
    )
    return summary, samples


def format_summary(s: Summary) -> str:
    """A few human-readable lines."""
    what = (
        f"open loop at {s.target_rate:g}/s"
        if s.mode == "open"
        else f"closed loop c={s.concurrency}"
    )
    lines = [
        f"{what}: {s.requests} requests, {s.ok} ok, {s.errors} errors {s.error_kinds or ''}",
        f"  offered {s.offered_rate:.1f}/s  throughput {s.throughput:.1f}/s  "
        f"over {s.duration_s:.2f} s  connections {s.connections}  schedule lag p99 "
        f"{s.lag_p99_ms:.2f} ms",
        f"  TTFB ms p50 {s.ttfb_ms.p50:.3f}  p90 {s.ttfb_ms.p90:.3f}  p99 {s.ttfb_ms.p99:.3f}",
        f"  TTLB ms p50 {s.ttlb_ms.p50:.3f}  p90 {s.ttlb_ms.p90:.3f}  p99 {s.ttlb_ms.p99:.3f}",
        f"  generator CPU {s.generator_cpu_s:.2f} s "
        f"({1000.0 * s.generator_cpu_s / max(s.requests, 1):.2f} s per 1000 requests)",
    ]
    return "\n".join(lines)


def install_fast_loop() -> None:
    """uvloop when present: its transports cost the generator about half the CPU."""
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.openloop", description=__doc__)
    parser.add_argument("urls", nargs="+", help="http://HOST:PORT, requests go round robin")
    parser.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--concurrency", type=int, default=32, help="closed loop clients")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--max-requests", type=int)
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="max_tokens asked")
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--json", metavar="PATH", help="write the summary as JSON ('-': stdout)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    install_fast_loop()
    spec = RunSpec(
        endpoints=tuple(Endpoint.parse(u) for u in args.urls),
        request=completion_request(args.tokens, stream=not args.no_stream, path=args.path),
        rate=args.rate,
        concurrency=args.concurrency,
        duration_s=args.duration,
        max_requests=args.max_requests,
        seed=args.seed,
        progress=not args.no_progress and args.duration >= 3,
        timeout_s=args.timeout,
    )
    summary, _ = asyncio.run(run(spec))
    if args.json == "-":
        print(json.dumps(summary.to_dict()))
    else:
        print(format_summary(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary.to_dict(), f, indent=2)
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
