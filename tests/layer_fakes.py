"""Fakes for testing the sidecar's layers one at a time (docs/architecture.md): the layers
built as meshd/sidecar.py's `Sidecar.__init__` builds them, with no sockets, plus stand-ins
for the neighbours a test swaps in (the upstream pool and its responses, the client's
request and response stream, the router and guard, recording what they are told)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from filters.guard import PoolGuard
from filters.hotpath import parse_routing_headers
from filters.picker import PickRequest
from filters.pool_router import PoolRouter, Route
from filters.request import PATH_KINDS, parse_inference_request
from meshd.accounting import Accounting
from meshd.admission_gate import AdmissionGate
from meshd.attempts import Attempts
from meshd.config import Config
from meshd.context import Plane, RequestContext
from meshd.http_message import BodyError
from meshd.intake import Intake
from meshd.metrics import DataPlaneMetrics
from meshd.observe import RequestObserver
from meshd.pools import build_routers, guard_config, guards, retry_budgets
from meshd.relay import Relay
from meshd.upstream import UpstreamClosedError

POOL = "default"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HANG = object()  # an answer, or a body part, that never comes


@dataclass
class Layers:
    """One sidecar's layers, wired as Sidecar.__init__ wires them."""

    plane: Plane
    acct: Accounting
    gate: AdmissionGate
    attempts: Attempts
    relay: Relay
    intake: Intake

    def metric(self, name: str, **labels: str) -> float:
        return self.plane.metrics.registry.get_sample_value(name, labels) or 0.0


def build_layers(config: Config) -> Layers:
    metrics = DataPlaneMetrics()
    routers = build_routers(config)
    plane = Plane(
        config,
        metrics,
        routers,
        guards(config, routers),
        retry_budgets(config),
        RequestObserver.from_config(config, metrics),
    )
    acct = Accounting(metrics)
    gate = AdmissionGate(plane, acct)
    attempts = Attempts(plane, acct, gate, None)
    relay = Relay(plane, acct, attempts)
    relay.yield_cpu = None
    intake = Intake(
        plane,
        acct,
        gate,
        attempts,
        precise={},
        chars_per_token=None,
        intercepted_pool=lambda req: None,
    )
    return Layers(plane, acct, gate, attempts, relay, intake)


# -- what the request layer hands on -------------------------------------------------------


def request_context(
    layers: Layers,
    doc: dict[str, Any],
    *,
    path: str = CHAT,
    headers: Iterable[tuple[str, str]] = (),
    trusted: bool = True,
) -> RequestContext:
    """A RequestContext as meshd/intake.py builds it for an admitted request (the request
    layer's contract with the layers after it)."""
    plane = layers.plane
    kind = PATH_KINDS[path]
    body = json.dumps(doc).encode()
    inference = parse_inference_request(kind, body)
    routing, kept = parse_routing_headers(list(headers), trusted)
    started = asyncio.get_running_loop().time()
    ctx = RequestContext(kind, POOL, started, trusted, "POST", path, inference, routing)
    ctx.request_id = "req-1"
    ctx.upstream_headers = [*kept, ("x-request-id", ctx.request_id), ("via", "1.1 meshd")]
    ctx.obs = plane.observer.begin(kind, POOL, inference, routing, ctx.request_id, started)
    ctx.body = body
    ctx.deadline = started + plane.config.upstream.request_timeout_s
    if routing is not None and routing.deadline_ms is not None:
        ctx.head_by = started + routing.deadline_ms / 1000.0
    ctx.pick = PickRequest.build(inference, routing, time.monotonic(), block_hashes=[])
    ctx.tokens = plane.guards[POOL].expected_tokens(
        inference.model, ctx.pick.prompt_tokens, inference.max_tokens
    )
    return ctx


# -- the upstream side -----------------------------------------------------------------------


class FakeUpstream:
    """An UpstreamResponse: its head is here, its body comes from `parts` (bytes, an
    exception to raise, or HANG) and then b""."""

    def __init__(
        self,
        status: int = 200,
        parts: Iterable[Any] = (),
        *,
        content_type: str = "application/json",
        headers: Iterable[tuple[str, str]] = (),
        endpoint: str = "http://fake:1",
    ) -> None:
        self.status = status
        self.content_type = content_type
        self.headers = [("Content-Type", content_type), *headers]
        self.endpoint = endpoint
        self._parts = list(parts)
        self.buffered = 0
        self.released = False
        self.closed = False
        self.broken = False  # the body broke (or never ended): not at its end
        self.reading = asyncio.Event()  # set once a read waits on HANG

    def header(self, name: str) -> str | None:
        return next((v for n, v in self.headers if n.lower() == name.lower()), None)

    async def read(self) -> bytes:
        if self.closed:
            raise UpstreamClosedError(self.endpoint, "the response was closed before its end")
        if not self._parts:
            return b""
        part = self._parts.pop(0)
        if part is HANG:
            self.broken = True
            self.reading.set()
            await asyncio.Event().wait()
        if isinstance(part, BaseException):
            self.broken = True
            raise part
        assert isinstance(part, bytes)
        return part

    def at_eof(self) -> bool:
        return not self._parts and not self.closed and not self.broken

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


@dataclass
class Sent:
    url: str
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class FakePool:
    """The UpstreamPool: answers requests in order from `answers` (a FakeUpstream, an
    exception to raise, HANG, or a function of the url giving one), recording each."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.sent: list[Sent] = []
        self.waiting = asyncio.Event()  # set once a request waits on HANG

    async def request(
        self,
        url: str,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        sent: Callable[[], None] | None = None,
    ) -> Any:
        self.sent.append(Sent(url, method, target, list(headers), body))
        if sent is not None:
            sent()  # as the pool does before it waits for a connection or an answer
        assert self.answers, f"an unexpected request to {url}"
        answer = self.answers.pop(0)
        if callable(answer):
            answer = answer(url)
        if answer is HANG:
            self.waiting.set()
            await asyncio.Event().wait()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.sent]


# -- the client side -------------------------------------------------------------------------


class ClientStream:
    """A ResponseStream as the client receives it; after `writes_ok` writes the client has
    gone and writes raise ConnectionResetError."""

    def __init__(self, status: int, headers: list[tuple[str, str]], writes_ok: int | None):
        self.status = status
        self.headers = headers
        self.chunks: list[bytes] = []
        self.ended = False
        self.paused = False
        self._writes_ok = writes_ok

    def _check(self) -> None:
        if self._writes_ok is not None and len(self.chunks) >= self._writes_ok:
            raise ConnectionResetError("Cannot write to closing transport")

    def write(self, chunk: bytes) -> None:
        self._check()
        if chunk:
            self.chunks.append(chunk)

    async def drain(self) -> None:
        return None

    def end(self, tail: bytes = b"") -> None:
        self._check()
        if tail:
            self.chunks.append(tail)
        self.ended = True

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


@dataclass
class FakeRequest:
    """An HttpRequest: its head, its body (or the BodyError reading it raises), and the
    stream back to its client."""

    path: str = CHAT
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    remote: str | None = "10.9.8.7"
    method: str = "POST"
    body_error: BodyError | None = None
    writes_ok: int | None = None  # the client leaves after this many writes (None: never)
    transport: Any = None
    out: ClientStream | None = None
    drained: bool = False  # a drain cut it (HttpRequest.drained)

    @property
    def target(self) -> str:
        return self.path

    def ready_body(self) -> bytes | None:
        return self.body if self.body_error is None else None

    async def read_body(self) -> bytes:
        if self.body_error is not None:
            raise self.body_error
        return self.body

    def header(self, name: str) -> str | None:
        return next((v for n, v in self.headers if n.lower() == name.lower()), None)

    def header_all(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n.lower() == name.lower()]

    def stream(
        self, status: int, headers: list[tuple[str, str]], *, hold_head: bool = False
    ) -> ClientStream:
        assert self.out is None, "the response has begun"
        self.out = ClientStream(status, headers, self.writes_ok)
        return self.out


# -- the router and the guard, recording what they are told -----------------------------------


class RouterLog:
    """The pool's router (the real one inside), recording the attempts it is told about."""

    def __init__(self, inner: PoolRouter) -> None:
        self.inner = inner
        self.starts: dict[Any, str] = {}  # rid -> url
        self.ends: list[tuple[Any, str, bool]] = []  # (rid, finished|connect_failed, ok)
        self.first_tokens: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def started(self, route: Route, rid: Any, req: PickRequest, now: float) -> None:
        self.starts[rid] = route.url
        self.inner.started(route, rid, req, now)

    def finished(self, route: Route, rid: Any, req: PickRequest, now: float, **kw: Any) -> None:
        self.ends.append((rid, "finished", kw["ok"]))
        self.inner.finished(route, rid, req, now, **kw)

    def connect_failed(self, route: Route, rid: Any, now: float, reason: str) -> None:
        self.ends.append((rid, "connect_failed", False))
        self.inner.connect_failed(route, rid, now, reason)

    def first_token(self, route: Route, rid: Any, now: float) -> None:
        self.first_tokens.append(rid)
        self.inner.first_token(route, rid, now)


class GuardLog(PoolGuard):
    """The pool's guard (a real PoolGuard), recording the attempts it is told about."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.starts: dict[Any, str] = {}
        self.ends: list[dict[str, Any]] = []
        super().__init__(*a, **kw)

    def started(self, url: str, rid: Any, tokens: int, now: float, **kw: Any) -> None:
        self.starts[rid] = url
        super().started(url, rid, tokens, now, **kw)

    def finished(self, url: str, rid: Any, now: float, **kw: Any) -> None:
        self.ends.append({"rid": rid, "url": url, **kw})
        super().finished(url, rid, now, **kw)


def install_logs(layers: Layers) -> tuple[RouterLog, GuardLog]:
    """Swap the pool's router and guard for recording ones (same config, same behaviour)."""
    plane = layers.plane
    config = plane.config
    router = RouterLog(plane.routers[POOL])
    urls = [ep.url for ep in config.pool(POOL).endpoints]
    guard = GuardLog(guard_config(config, len(urls)), urls, pool_wait=router.inner.pool_wait)
    plane.routers[POOL] = router
    plane.guards[POOL] = guard
    return router, guard


def assert_settled_once(router: RouterLog, guard: GuardLog) -> None:
    """Every attempt begun was ended exactly once, to the router and to the guard."""
    router_ends = [rid for rid, _, _ in router.ends]
    assert sorted(router_ends) == sorted(router.starts), (router.starts, router.ends)
    guard_ends = [e["rid"] for e in guard.ends]
    assert sorted(guard_ends) == sorted(guard.starts), (guard.starts, guard.ends)
