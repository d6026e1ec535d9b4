"""The fault campaign's clients (loadtest/chaos.py): an open-loop stream of streamed
completions, each classified by what its client saw, and the misbehaving clients
(slowloris, requests at and over every limit) on raw sockets.

Classes of a request (`Outcome.kind`):
- completed: HTTP 200 and the stream reached `data: [DONE]` with no error event.
- failed: a clear error: an HTTP error status, an SSE error event, or no connection at all
  (refused, or closed before any response: the client knows nothing was served).
- broken: the connection broke mid-body (reset, or a chunked body without its last chunk):
  the HTTP client raises, so the failure is visible, but meshd sent no error event.
- lost: neither: a body that ended cleanly without [DONE] or an error event, or no end
  before the client's deadline. Must be 0.
- abandoned: the client itself left mid-stream (the disconnect scenario).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import orjson

from loadtest.bench.stream import StreamMeter
from loadtest.chaos_rig import MODEL

Kind = Literal["completed", "failed", "broken", "lost", "abandoned"]
_WORDS = tuple(f"w{i}" for i in range(512))


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request: sent `sent_at` s after the load began, ended `ended_at` s after it."""

    sent_at: float
    ended_at: float
    kind: Kind
    status: int | None
    detail: str
    tokens: int
    retry_after: bool = False


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """An open-loop Poisson stream: `rate_rps` for `duration_s`, completions of
    `max_tokens` tokens (ignore_eos), each with `deadline_s` (also sent as
    x-meshd-deadline-ms; the client gives meshd `grace_s` more to say it missed it);
    `abandon_share` of them leave after `abandon_after` tokens."""

    rate_rps: float
    duration_s: float
    max_tokens: int = 200
    prompt_words: int = 32
    deadline_s: float = 25.0
    grace_s: float = 2.0
    abandon_share: float = 0.0
    abandon_after: int = 20
    seed: int = 0


def completion_body(rng: random.Random, spec: LoadSpec, stream: bool = True) -> bytes:
    prompt = " ".join(rng.choice(_WORDS) for _ in range(spec.prompt_words))
    doc = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    return orjson.dumps(doc)


def _error_code(body: bytes) -> str:
    """The OpenAI-style error body's code (meshd's, or an engine's), else ''."""
    try:
        err = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    return str(err.get("code") or "") if isinstance(err, dict) else ""


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    spec: LoadSpec,
    t0: float,
    abandon_after: int | None = None,
) -> Outcome:
    sent = time.monotonic() - t0
    headers = {
        "content-type": "application/json",
        "x-meshd-deadline-ms": str(int(spec.deadline_s * 1000)),
    }
    meter = StreamMeter()
    status: int | None = None
    retry_after = False

    def out(kind: Kind, detail: str) -> Outcome:
        s = meter.summary()
        return Outcome(
            sent, time.monotonic() - t0, kind, status, detail, s.token_events, retry_after
        )

    try:
        async with asyncio.timeout(spec.deadline_s + spec.grace_s):
            async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
                status = r.status
                retry_after = "retry-after" in r.headers
                if r.status != 200:
                    return out("failed", f"HTTP {r.status} {_error_code(await r.read())}".strip())
                async for chunk in r.content.iter_any():
                    meter.feed(chunk, time.monotonic())
                    if abandon_after is not None and meter.summary().token_events >= abandon_after:
                        r.close()
                        return out("abandoned", "client left")
    except TimeoutError:
        waited = spec.deadline_s + spec.grace_s
        return out("lost", f"no end within the deadline + {spec.grace_s:g} s ({waited:g} s)")
    except aiohttp.ClientConnectorError as exc:
        return out("failed", f"connect: {exc.os_error.strerror or exc}")
    except (
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
    ) as e:
        if status is None:
            return out("failed", f"connection closed before a response ({type(e).__name__})")
        return out("broken", f"connection broke mid-body ({type(e).__name__})")
    s = meter.summary()
    if s.error is not None:
        return out("failed", f"SSE error: {s.error[:80]}")
    if s.done:
        return out("completed", "")
    return out("lost", "the body ended without [DONE] or an error event")


async def open_loop(
    url: str,
    spec: LoadSpec,
    on_done: Callable[[Outcome], None] | None = None,
    t0: float | None = None,
) -> list[Outcome]:
    """Send `spec`'s requests at Poisson arrival times, each on its own task whatever the
    earlier ones are doing (open loop); returns every outcome once all have ended."""
    rng = random.Random(spec.seed)
    start = time.monotonic() if t0 is None else t0
    tasks: list[asyncio.Task[Outcome]] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        at = rng.expovariate(spec.rate_rps)
        while at < spec.duration_s:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            leave = spec.abandon_after if rng.random() < spec.abandon_share else None
            task = asyncio.create_task(
                one_request(session, url, completion_body(rng, spec), spec, start, leave)
            )
            if on_done is not None:
                task.add_done_callback(lambda t: on_done(t.result()) if not t.cancelled() else None)
            tasks.append(task)
            at += rng.expovariate(spec.rate_rps)
        return list(await asyncio.gather(*tasks))


# ---- raw-socket clients -----------------------------------------------------------------


def _hostport(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def _status_of(reader: asyncio.StreamReader, timeout_s: float) -> int | None:
    """The status of the response on `reader`, or None when the connection closed first."""
    async with asyncio.timeout(timeout_s):
        line = await reader.readline()
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def slowloris(url: str, byte_interval_s: float, give_up_s: float) -> tuple[int | None, float]:
    """A client that sends its request head one byte every `byte_interval_s`: the status
    meshd answered (None: closed without one) and after how many seconds."""
    host, port = _hostport(url)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    status: int | None = None
    try:
        reply = asyncio.create_task(_status_of(reader, give_up_s))
        for b in head:
            if reply.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(bytes([b]))
                await writer.drain()
            await asyncio.wait({reply}, timeout=byte_interval_s)
        with contextlib.suppress(TimeoutError, ConnectionError, ValueError):
            status = await reply
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return status, time.monotonic() - t0


def raw_request(body: bytes, extra_headers: list[tuple[str, str]]) -> bytes:
    base = [
        ("Host", "x"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
    ]
    lines = "".join(f"{k}: {v}\r\n" for k, v in base + extra_headers)
    return f"POST /v1/completions HTTP/1.1\r\n{lines}Connection: close\r\n\r\n".encode() + body


def limit_probes(max_body: int, max_headers: int, max_header_bytes: int) -> list[dict[str, Any]]:
    """Requests exactly at and one past each of the listener's limits, with the status
    class each must get: `ok` (anything but the limit's refusal) or the refusal."""
    small = orjson.dumps({"model": MODEL, "prompt": "w1 w2", "max_tokens": 1})

    def padded(size: int) -> bytes:
        return small + b" " * (size - len(small))  # JSON allows trailing whitespace

    fixed = [("Content-Type", "application/json"), ("Host", "x"), ("Connection", "close")]
    n_fixed = len(fixed) + 1  # + Content-Length
    pads = [(f"x-pad-{i}", "v") for i in range(max_headers - n_fixed)]
    named = sum(len(k) + len(v) for k, v in fixed) + len("Content-Length") + len(str(len(small)))
    fill = max_header_bytes - named - len("x-fill")
    return [
        {"name": "body at limit", "raw": raw_request(padded(max_body), []), "want": "ok"},
        {"name": "body over", "raw": raw_request(padded(max_body + 1), []), "want": 413},
        {"name": "headers at count", "raw": raw_request(small, pads), "want": "ok"},
        {
            "name": "headers over count",
            "raw": raw_request(small, [*pads, ("x-one", "v")]),
            "want": 431,
        },
        {
            "name": "header bytes at",
            "raw": raw_request(small, [("x-fill", "a" * fill)]),
            "want": "ok",
        },
        {
            "name": "header bytes over",
            "raw": raw_request(small, [("x-fill", "a" * (fill + 1))]),
            "want": 431,
        },
    ]


async def send_raw(url: str, raw: bytes, timeout_s: float = 20.0) -> int | None:
    host, port = _hostport(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return await _status_of(reader, timeout_s)
    except (TimeoutError, ConnectionError):
        return None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
