"""`meshd sidecar`: the outbound data plane. aiohttp on uvloop; relays OpenAI-
compatible requests to a pool's engines, SSE chunk by chunk, and answers every
failure with a well-formed OpenAI-style error instead of a hang.

Decisions (parse, hash, choose an endpoint) are `filters/` objects; this module
only moves bytes and reports what happened to them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from aiohttp.http_writer import StreamWriter
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from filters.admission import AdmissionConfig, AdmissionItem, Admit, Reject, TenantPolicy
from filters.chars_per_token import CharsPerToken, pick_inputs, utf8_length
from filters.failover import (
    FailoverUnsupported,
    StreamKind,
    StreamRecorder,
    StreamSplicer,
    continuation_body,
    remaining_tokens,
)
from filters.guard import GuardConfig, GuardEvents, PoolGuard, Screened, Throttled
from filters.hotpath import (
    IMPLEMENTATION,
    RoutingHeaders,
    SSEScanner,
    block_hashes,
    parse_routing_headers,
)
from filters.outlier import OutlierConfig
from filters.picker import PickerConfig, PickRequest
from filters.pool_router import (
    EndpointSpec,
    PickerRouter,
    PoolRouter,
    Route,
    admission_item,
    make_router,
)
from filters.request import (
    CHARS_PER_TOKEN,
    PATH_KINDS,
    InferenceRequest,
    RequestError,
    parse_inference_request,
)
from filters.retry_budget import RetryBudget, RetryBudgetConfig, parse_retry_after
from filters.slow_start import SlowStartConfig
from filters.throttle import AdaptiveThrottleConfig
from filters.token_breaker import Limits, TokenBreakerConfig
from meshd import __version__
from meshd.config import ADMISSION_SLOTS_PER_ENDPOINT, Config, ConfigError, load_config
from meshd.errors import error_response, sse_error_event
from meshd.metrics import BREAKER_CLOSED, BREAKER_HALF_OPEN, BREAKER_OPEN, DataPlaneMetrics
from meshd.observe import AttemptTrace, RequestObserver, RequestTrace

if TYPE_CHECKING:
    from meshd.control_feed import ControlFeed
    from meshd.kv_events import PrecisePrefix
from meshd.upstream import (
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)

log = logging.getLogger("meshd.sidecar")

# RFC 9110 section 7.6.1: connection-specific fields a proxy must not forward.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by the side that writes the body.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "content-encoding"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
VIA = "1.1 meshd"

# The reaper's period bounds how late an idle or overall timeout fires; a
# single periodic sweep is cheaper than arming a timer per relayed chunk.
_REAPER_PERIOD_S = 0.25


@dataclass(slots=True, eq=False)
class _Watch:
    """A response being relayed, watched by the reaper for silence and deadline."""

    upstream: UpstreamResponse
    last_activity: float
    deadline: float
    expired: str | None = None


# Entries kept in each per-peer / per-model answer cache before it starts over.
_CACHE_LIMIT = 4096

# A whole (non-streamed) response is parsed for its usage only below this size.
_MAX_USAGE_PARSE_BYTES = 1 << 20


# Bytes a relayed stream may leave in the client transport's buffer before the relay waits
# for it to drain (aiohttp's StreamWriter.write waits at the same size).
_DRAIN_AT = 0x10000


class _ChunkOut:
    """The body of a prepared, chunked `web.StreamResponse`, written straight to its
    transport once aiohttp has sent the head: one `transport.write` of the framed chunk per
    relayed read, where `StreamResponse.write` runs three coroutine layers to make the same
    bytes (1.9 us vs 0.4 us a chunk with aiohttp 3.14, timed on a stub transport; a
    200-event stream from the zero-delay stub is relayed in ~16 reads). Anything else
    (compression, a fixed length, HTTP/1.0's unframed body) keeps to `resp.write`; `check()`
    looks again after each such write, so the first chunk always goes through aiohttp, which
    sends the head with it. The writer's private fields are those of aiohttp 3.10 to 3.14;
    where one is missing the fast path stays off."""

    __slots__ = ("_resp", "_writer", "fast", "transport")

    def __init__(self, resp: web.StreamResponse) -> None:
        self._resp = resp
        self._writer: Any = None
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.fast = False

    def check(self) -> None:
        """After a `resp.write`: may the next chunks go straight to the transport?"""
        w = getattr(self._resp, "_payload_writer", None)
        if not isinstance(w, StreamWriter) or not all(
            hasattr(w, a) for a in ("_compress", "_headers_buf", "output_size")
        ):
            return
        transport = w.transport
        self.fast = (
            w.chunked
            and w.length is None
            and w._compress is None
            and w._headers_buf is None
            and transport is not None
        )
        if self.fast:
            self._writer = w
            self.transport = transport  # type: ignore[assignment]

    def write(self, chunk: bytes) -> None:
        """The chunk, framed (RFC 9112 7.1), as aiohttp would write it; raises
        ConnectionResetError once the client's connection is closing."""
        transport = self._writer.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        data = b"%x\r\n%b\r\n" % (len(chunk), chunk)
        self._writer.output_size += len(data)
        transport.write(data)

    async def drain(self) -> None:
        await self._writer.drain()


@dataclass(slots=True, eq=False)
class _Attempt:
    """One try of a request on one endpoint, and what the router, the guard and the trace
    are told about it (once, by Sidecar._settle)."""

    router: PoolRouter
    route: Route
    rid: int
    pick: PickRequest
    guard: PoolGuard | None
    trace: AttemptTrace
    ok: bool = False
    status: int = 0
    local_failure: bool = False  # no connection, reset, timeout, broken stream
    cancelled: bool = False  # the client left: no verdict on the endpoint
    outcome: str = ""
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    settled: bool = False
    inference: InferenceRequest | None = None  # the prompt usage.prompt_tokens counts


@dataclass(slots=True)
class RequestContext:
    kind: str
    pool: str
    started: float
    trusted: bool
    inference: InferenceRequest | None = None
    routing: RoutingHeaders | None = None
    block_hashes: list[int] = field(default_factory=list)
    tokens_per_block: int | None = None  # engine token blocks (precise path), else text
    request_id: str = ""
    obs: RequestTrace | None = None
    body: bytes = b""
    upstream_headers: list[tuple[str, str]] = field(default_factory=list)
    deadline: float = math.inf  # loop clock: the whole request, all tries
    pick: PickRequest | None = None
    tokens: int = 0  # expected prompt + output tokens (the token breaker's unit)
    item_id: int | None = None  # admission item while admitted
    tried: set[str] = field(default_factory=set)

    @property
    def trace(self) -> RequestTrace:
        assert self.obs is not None, "the request has not begun"
        return self.obs


class _PoolSeries:
    """The metric children one pool's every request touches: `labels()` looks a child up
    under a lock (~2.5 us each), four times on a request's happy path. Each is made on its
    first use, as `labels()` would make it, so /metrics lists the same series as before."""

    __slots__ = ("_m", "_pool", "_stream_tokens", "queue_depth", "tokens_in_flight")

    def __init__(self, m: DataPlaneMetrics, pool: str) -> None:
        self._m, self._pool = m, pool
        self.queue_depth = m.admission_queue_depth.labels(pool)
        self.tokens_in_flight = m.tokens_in_flight.labels(pool)
        self._stream_tokens: Any = None

    @property
    def stream_tokens(self) -> Any:
        if self._stream_tokens is None:
            self._stream_tokens = self._m.stream_tokens.labels(self._pool)
        return self._stream_tokens


_BREAKER_CODES = {"closed": BREAKER_CLOSED, "half-open": BREAKER_HALF_OPEN, "open": BREAKER_OPEN}
# A stream longer than this is relayed without keeping a copy, so it cannot be resumed.
_MAX_RESUME_BYTES = 4 << 20


class Sidecar:
    """One sidecar: its listeners, its upstream client pool and its state."""

    def __init__(self, config: Config, *, original_destination_fn: Any = None) -> None:
        self.config = config
        # Tests without iptables inject where a transparent connection was headed.
        self._original_destination_fn = original_destination_fn
        self.metrics = DataPlaneMetrics()
        self.routers: dict[str, PoolRouter] = build_routers(config)
        # Pool -> its precise prefix path (routing.tokenizers; policy meshd only).
        self.precise: dict[str, PrecisePrefix] = _precise_prefixes(config, self.routers)
        # Model -> learnt characters per prompt token (routing.learn_chars_per_token).
        self.chars_per_token: CharsPerToken | None = (
            CharsPerToken() if config.routing.learn_chars_per_token else None
        )
        self._attempt_ids = itertools.count()
        rc = config.reliability.retry
        self.retry_budgets = {
            pool.name: RetryBudget(
                RetryBudgetConfig(
                    window_s=rc.window_s,
                    retry_ratio=rc.ratio,
                    min_retries_per_s=rc.min_retries_per_s,
                    max_attempts=config.upstream.max_attempts,
                    backoff_base_s=rc.backoff_base_s,
                    backoff_max_s=rc.backoff_max_s,
                )
            )
            for pool in config.pools
        }
        self.guards = {
            pool.name: PoolGuard(
                guard_config(config, len(pool.endpoints)),
                [ep.url for ep in pool.endpoints],
                pool_wait=self.routers[pool.name].pool_wait,
            )
            for pool in config.pools
        }
        self._waiters: dict[Hashable, asyncio.Future[Reject | None]] = {}
        self.observer = RequestObserver.from_config(config, self.metrics)
        self._rng = random.Random()
        self._trusted_nets = config.trust.networks()
        # Per-request answers that depend only on the peer address or the model name, kept
        # (bounded) so the request path does not parse an address or match globs each time.
        self._trust_cache: dict[str, bool] = {}
        self._pool_cache: dict[str | None, str | None] = {}
        self._pool_series: dict[str, _PoolSeries] = {}
        # (pool, endpoint, status) -> its meshd_upstream_attempts child (bounded as above).
        self._attempt_series: dict[tuple[str, str, int], Any] = {}
        # listeners.yield_after_first_byte: sched_yield once a response's first bytes are
        # out (where the platform has it). Counted, so a test can see it happen.
        self._yield_cpu: Callable[[], None] | None = (
            getattr(os, "sched_yield", None) if config.listeners.yield_after_first_byte else None
        )
        self.first_byte_yields = 0
        self._active = 0
        self._draining = False
        self._watches: set[_Watch] = set()
        self._session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamPool | None = None
        self._runner: web.ServerRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._transparent: Any = None
        self._feed: Any = None  # meshd.control_feed.ControlFeed when control_plane is set
        # meshd.engine_probe.EngineProbes: each endpoint's /metrics, without a control plane.
        self.probes: Any = None
        self.addresses: dict[str, str] = {}

    @property
    def active(self) -> int:
        return self._active

    @property
    def control_feed(self) -> ControlFeed | None:
        """The control-plane subscription (None: control_plane.addresses is empty)."""
        feed: ControlFeed | None = self._feed
        return feed

    # -- lifecycle -------------------------------------------------------------

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        """The outbound listener's one handler (aiohttp's low-level `web.Server`): POST to an
        inference path, GET or HEAD /v1/models, and anything else to the pool unchanged.
        Matching here instead of in an Application's router and middleware chain saves
        ~15 K of the ~1.1 M instructions a request costs (1.3%;
        `python -m loadtest.sidecar_instructions --tokens 1`)."""
        if request.headers.get("Expect"):
            await _expect(request)
        method = request.method
        if method == "POST" and request.path in PATH_KINDS:
            return await self._inference(request)
        if request.path == "/v1/models" and method in ("GET", "HEAD"):
            return await self._models(request)
        return await self._passthrough(request)

    def build_admin_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/config", self._config)
        app.router.add_get("/endpoints", self._endpoints)
        return app

    async def start(self) -> None:
        cfg = self.config
        limits = cfg.limits
        # Built before anything binds: a bad control_plane.tls file fails the start.
        if cfg.control_plane.addresses and self._feed is None:
            from meshd.control_feed import ControlFeed

            self._feed = ControlFeed(
                cfg, self.routers, self.metrics, on_restart=self._engine_restarted
            )
        for precise in self.precise.values():
            await precise.start()
        self._upstream = UpstreamPool(
            connect_timeout_s=cfg.upstream.connect_timeout_s,
            keepalive_timeout_s=cfg.upstream.keepalive_timeout_s,
            max_connections_per_endpoint=cfg.upstream.max_connections_per_endpoint,
        )
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,
                limit_per_host=cfg.upstream.max_connections_per_endpoint,
                keepalive_timeout=cfg.upstream.keepalive_timeout_s,
                enable_cleanup_closed=False,
            ),
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=cfg.upstream.connect_timeout_s,
                sock_connect=cfg.upstream.connect_timeout_s,
                sock_read=None,
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            # Upstream responses are bounded by our own checks, not the parser's.
            max_field_size=64 * 1024,
            max_line_size=64 * 1024,
        )
        self._runner = web.ServerRunner(
            web.Server(
                self._dispatch,
                access_log=None,
                handler_cancellation=True,
                keepalive_timeout=limits.keepalive_timeout_s,
                # The parser's own bounds sit above ours so that our check answers 431
                # with a clear body; these only stop a request that is absurd.
                max_headers=limits.max_header_count * 2,
                max_field_size=limits.max_header_bytes,
                max_line_size=limits.max_header_bytes,
            ),
            handle_signals=False,
            shutdown_timeout=cfg.drain.grace_period_s,
        )
        await self._runner.setup()
        out = cfg.listeners.outbound
        site = web.TCPSite(self._runner, out.host, out.port, backlog=1024)
        await site.start()
        self.addresses["outbound"] = _bound(site)
        if cfg.listeners.transparent.enabled:
            from meshd.transparent import start_transparent_listener

            tl = cfg.listeners.transparent
            extra = {}
            if self._original_destination_fn is not None:
                extra["original_destination_fn"] = self._original_destination_fn
            self._transparent = await start_transparent_listener(
                tl.host,
                tl.port,
                {svc.key(): svc.pool for svc in cfg.transparent.services},
                self._runner.server,  # type: ignore[arg-type]
                connect_timeout_s=cfg.transparent.passthrough_connect_timeout_s,
                **extra,
            )
            self.addresses["transparent"] = f"{tl.host}:{self._transparent.port}"
        self._admin_runner = web.AppRunner(self.build_admin_app(), access_log=None)
        await self._admin_runner.setup()
        adm = cfg.listeners.admin
        admin_site = web.TCPSite(self._admin_runner, adm.host, adm.port)
        await admin_site.start()
        self.addresses["admin"] = _bound(admin_site)
        self._reaper = asyncio.create_task(self._reap())
        if self._feed is not None:
            await self._feed.start()
        elif cfg.routing.engine_metrics.enabled and cfg.routing.policy == "meshd":
            from meshd.engine_probe import EngineProbes

            self.probes = EngineProbes(cfg, self.routers, on_restart=self._engine_restarted)
            await self.probes.start()

    async def drain_and_stop(self, on_closed: Callable[[], None] | None = None) -> None:
        """Stop accepting, let requests finish up to the grace period, then close.
        `on_closed` runs once the listeners are closed, before the wait."""
        self._draining = True
        if self._transparent is not None:
            self._transparent.close()
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
        if on_closed is not None:
            on_closed()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._transparent is not None:
            await self._transparent.wait_closed()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._feed is not None:
            await self._feed.close()
        if self.probes is not None:
            await self.probes.close()
        for precise in self.precise.values():
            await precise.close()
        if self._session is not None:
            await self._session.close()
        if self._upstream is not None:
            await self._upstream.close()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
        await self.observer.aclose()

    async def _reap(self) -> None:
        loop = asyncio.get_running_loop()
        idle = self.config.upstream.idle_timeout_s
        while True:
            await asyncio.sleep(_REAPER_PERIOD_S)
            now = loop.time()
            for w in list(self._watches):
                if w.expired is None and now - w.last_activity > idle:
                    w.expired = "idle"
                elif w.expired is None and now > w.deadline:
                    w.expired = "deadline"
                else:
                    continue
                w.upstream.close()
            mono = time.monotonic()
            for pool, guard in self.guards.items():
                self._apply_guard(pool, guard.tick(mono))
            self.observer.tick(now)

    # -- client requests -------------------------------------------------------

    def _is_trusted(self, request: web.BaseRequest) -> bool:
        remote = request.remote
        if not remote:
            return False
        cache = self._trust_cache
        trusted = cache.get(remote)
        if trusted is None:
            try:
                addr = ipaddress.ip_address(remote)
            except ValueError:
                trusted = False
            else:
                trusted = any(addr in net for net in self._trusted_nets)
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            cache[remote] = trusted
        return trusted

    def _check_header_limits(self, request: web.BaseRequest) -> web.Response | None:
        limits = self.config.limits
        headers = request.raw_headers
        if len(headers) > limits.max_header_count:
            return self._reject(
                431,
                f"too many request headers: {len(headers)} > limits.max_header_count "
                f"({limits.max_header_count})",
                "header_count_exceeded",
            )
        size = sum(len(k) + len(v) for k, v in headers)
        if size > limits.max_header_bytes:
            return self._reject(
                431,
                f"request headers too large: {size} bytes > limits.max_header_bytes "
                f"({limits.max_header_bytes})",
                "header_size_exceeded",
            )
        return None

    def _reject(self, status: int, message: str, code: str, **kw: Any) -> web.Response:
        self.metrics.rejected.labels(code).inc()
        return error_response(status, message, code, **kw)

    async def _read_body(self, request: web.BaseRequest) -> bytes | web.Response:
        limits = self.config.limits
        declared = request.content_length
        if declared is not None and declared > limits.max_body_bytes:
            return self._reject(
                413,
                f"request body of {declared} bytes exceeds limits.max_body_bytes "
                f"({limits.max_body_bytes})",
                "body_too_large",
                close=True,
            )
        content = request.content
        if content.is_eof() and content.exception() is None:
            # The whole body came with the head (the usual small JSON request): take it
            # without arming the body timer or going round the loop.
            body = content.read_nowait()
            if len(body) > limits.max_body_bytes:
                return self._reject(
                    413,
                    f"request body exceeds limits.max_body_bytes ({limits.max_body_bytes})",
                    "body_too_large",
                    close=True,
                )
            return body
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(limits.client_body_timeout_s):
                async for chunk in request.content.iter_any():
                    size += len(chunk)
                    if size > limits.max_body_bytes:
                        return self._reject(
                            413,
                            f"request body exceeds limits.max_body_bytes ({limits.max_body_bytes})",
                            "body_too_large",
                            close=True,
                        )
                    chunks.append(chunk)
        except TimeoutError:
            return self._reject(
                408,
                f"the request body did not arrive within limits.client_body_timeout_s "
                f"({limits.client_body_timeout_s:g} s)",
                "body_timeout",
                close=True,
            )
        except aiohttp.ClientPayloadError as exc:
            return self._reject(400, f"malformed request body: {exc}", "bad_body", close=True)
        return b"".join(chunks)

    def _intercepted_pool(self, request: web.BaseRequest) -> str | None:
        if self._transparent is None:
            return None
        pool: str | None = self._transparent.pool_for(request.transport)
        return pool

    def _loop_detected(self, request: web.BaseRequest) -> web.Response | None:
        """A request meshd already relayed, intercepted again by our own rules: the
        sidecar's UID is not excluded from the REDIRECT. Refuse instead of looping."""
        if self._intercepted_pool(request) is None:
            return None
        if not any(VIA in v for v in request.headers.getall("via", ())):
            return None
        return self._reject(
            508,
            "meshd intercepted its own upstream request: exclude the sidecar's UID from "
            "the iptables REDIRECT (meshd iptables --proxy-uid)",
            "loop_detected",
        )

    def _pool_for(self, request: web.BaseRequest, model: str | None) -> str | None:
        pool = self._intercepted_pool(request)
        if pool is not None:
            return pool
        cache = self._pool_cache
        if model in cache:
            return cache[model]
        if model is None:
            pool = self.config.pools[0].name
        else:
            pool = next((p.name for p in self.config.pools if p.serves(model)), None)
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[model] = pool
        return pool

    async def _inference(self, request: web.BaseRequest) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        started = loop.time()
        kind = PATH_KINDS[request.path]
        rejected = self._check_header_limits(request) or self._loop_detected(request)
        if rejected is not None:
            return rejected
        if self._active >= self.config.limits.max_concurrent_streams:
            return self._reject(
                503,
                f"meshd is serving limits.max_concurrent_streams "
                f"({self.config.limits.max_concurrent_streams}) requests; retry shortly",
                "overloaded",
                retry_after_s=1,
            )
        self._active += 1
        self.metrics.active_streams.inc()
        try:
            body = await self._read_body(request)
            if isinstance(body, web.Response):
                return body
            try:
                inference = parse_inference_request(kind, body)
            except RequestError as exc:
                return self._reject(400, exc.message, exc.code, param=exc.param)
            trusted = self._is_trusted(request)
            routing, headers = parse_routing_headers(request.headers.items(), trusted)
            if routing.stripped:
                self.metrics.stripped_headers.inc(len(routing.stripped))
            if routing.errors:
                return self._reject(400, "; ".join(routing.errors), "bad_routing_header")
            pool = self._pool_for(request, inference.model)
            if pool is None:
                return self._reject(
                    404,
                    f"The model `{inference.model}` does not exist: no pool serves it",
                    "model_not_found",
                    param="model",
                )
            routing_cfg = self.config.routing
            ctx = RequestContext(
                kind=kind,
                pool=pool,
                started=started,
                trusted=trusted,
                inference=inference,
                routing=routing,
            )
            if routing_cfg.policy in ("meshd", "cache-aware"):  # the prefix-aware policies
                precise = self.precise.get(pool)
                engine_hashes = (
                    None
                    if precise is None or inference.doc is None
                    else precise.block_hashes(inference.model, kind, inference.doc)
                )
                if engine_hashes is not None and precise is not None:
                    # The engine's own block hashes: what its KV events name.
                    ctx.block_hashes = engine_hashes
                    ctx.tokens_per_block = precise.block_size(inference.model)
                else:
                    ctx.block_hashes = block_hashes(
                        inference.prompt_text,
                        inference.model,
                        routing_cfg.cache_salt,
                        routing_cfg.block_size_bytes,
                    )
            return await self._forward(request, ctx, headers, body)
        finally:
            self._active -= 1
            self.metrics.active_streams.dec()

    async def _passthrough(self, request: web.BaseRequest) -> web.StreamResponse:
        """Any other path goes to the chosen pool unchanged (e.g. /tokenize)."""
        loop = asyncio.get_running_loop()
        rejected = self._check_header_limits(request) or self._loop_detected(request)
        if rejected is not None:
            return rejected
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        trusted = self._is_trusted(request)
        routing, headers = parse_routing_headers(request.headers.items(), trusted)
        if routing.errors:
            return self._reject(400, "; ".join(routing.errors), "bad_routing_header")
        pool = self._pool_for(request, None)
        assert pool is not None
        ctx = RequestContext(kind="other", pool=pool, started=loop.time(), trusted=trusted)
        return await self._forward(request, ctx, headers, body)

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        """`/v1/models` merged across every pool's endpoints, first answer wins per id."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=min(10.0, self.config.upstream.first_byte_timeout_s))

        async def fetch(url: str) -> list[dict[str, Any]]:
            assert self._session is not None
            async with self._session.get(
                url + "/v1/models", timeout=timeout, headers={"via": VIA}
            ) as resp:
                if resp.status != 200:
                    return []
                doc = await resp.json(content_type=None)
                data = doc.get("data") if isinstance(doc, dict) else None
                return [m for m in data or [] if isinstance(m, dict) and "id" in m]

        urls = [ep.url for pool in self.config.pools for ep in pool.endpoints]
        results = await asyncio.gather(*(fetch(u) for u in urls), return_exceptions=True)
        merged: dict[str, dict[str, Any]] = {}
        for result in results:
            if isinstance(result, BaseException):
                continue
            for m in result:
                merged.setdefault(str(m["id"]), m)
        if not merged and all(isinstance(r, BaseException) for r in results):
            return self._reject(502, "no endpoint answered /v1/models", "upstream_unavailable")
        return web.json_response({"object": "list", "data": list(merged.values())})

    # -- upstream ----------------------------------------------------------------

    def _upstream_headers(
        self, headers: Iterable[tuple[str, str]], ctx: RequestContext
    ) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        connection_tokens: set[str] = set()
        for name, value in headers:
            lname = name.lower()
            if lname == "connection":
                connection_tokens.update(t.strip().lower() for t in value.split(","))
            elif lname == "x-request-id":
                ctx.request_id = value
        for name, value in headers:
            lname = name.lower()
            if lname in _REQUEST_DROP or lname in connection_tokens or lname == "via":
                continue
            out.append((name, value))
        if not ctx.request_id:
            ctx.request_id = _request_id()
            out.append(("x-request-id", ctx.request_id))
        out.append(("via", VIA))
        return out

    async def _forward(
        self,
        request: web.BaseRequest,
        ctx: RequestContext,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> web.StreamResponse:
        upstream_headers = self._upstream_headers(headers, ctx)
        rh = ctx.routing
        ctx.obs = self.observer.begin(
            ctx.kind,
            ctx.pool,
            ctx.inference,
            rh,
            ctx.request_id,
            ctx.started,
            step=None if rh is None else rh.step,
            steps_in_task=None if rh is None else rh.steps_in_task,
            final=None if rh is None else rh.final,
        )
        ctx.body = body
        ctx.upstream_headers = upstream_headers
        ctx.deadline = ctx.started + self.config.upstream.request_timeout_s
        now = time.monotonic()
        guard = self.guards[ctx.pool]
        if ctx.inference is not None and ctx.routing is not None:
            cpt, tpb = pick_inputs(
                self.chars_per_token,
                ctx.inference.model,
                self.config.routing.block_size_bytes,
                ctx.tokens_per_block,
            )
            ctx.pick = PickRequest.build(
                ctx.inference,
                ctx.routing,
                now,
                block_hashes=ctx.block_hashes,
                tokens_per_block=tpb,
                chars_per_token=cpt,
            )
            ctx.tokens = guard.expected_tokens(
                ctx.inference.model, ctx.pick.prompt_tokens, ctx.inference.max_tokens
            )
            refused = await self._admit(ctx, guard)
            if refused is not None:
                return refused
        else:
            ctx.pick = PickRequest(model="")
        try:
            return await self._attempts(request, ctx)
        finally:
            if ctx.item_id is not None:
                now = time.monotonic()
                guard.release(ctx.item_id, now)
                self._apply_guard(ctx.pool, guard.pump(now))

    # -- admission -----------------------------------------------------------------------

    async def _admit(self, ctx: RequestContext, guard: PoolGuard) -> web.Response | None:
        """Throttle, then admit or queue: None when the request may go upstream now."""
        pick, routing = ctx.pick, ctx.routing
        assert pick is not None and routing is not None
        ctx.item_id = next(self._attempt_ids)
        now = time.monotonic()
        router = self.routers[ctx.pool] if guard.admission is not None else None
        item = admission_item(ctx.item_id, router, pick, routing.step, ctx.tokens, now)
        decision = guard.gate(item, now, self._rng)
        if isinstance(decision, Admit):
            return None
        ctx_item, ctx.item_id = ctx.item_id, None  # not admitted: nothing to release
        if isinstance(decision, Throttled):
            self.metrics.throttled_requests.labels(ctx.pool).inc()
            return self._refuse(ctx, 503, decision.message, decision.code, retry_after_s=1)
        if isinstance(decision, Reject):
            return self._refuse_admission(ctx, decision)
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        ctx.item_id = ctx_item
        refusal = await self._wait_turn(ctx, guard, item)
        self.metrics.admission_queue_wait.labels(ctx.pool).observe(loop.time() - queued_at)
        if refusal is None:
            ctx.trace.admitted(queued_at, loop.time())
            return None
        ctx.item_id = None
        ctx.trace.admitted(queued_at, loop.time(), outcome=refusal.code)
        return self._refuse_admission(ctx, refusal)

    def _refuse_admission(self, ctx: RequestContext, r: Reject) -> web.Response:
        self.metrics.admission_rejections.labels(ctx.pool, r.reason).inc()
        return self._refuse(
            ctx, 429, r.message, r.code, retry_after_s=max(1, math.ceil(r.retry_after_s))
        )

    async def _wait_turn(
        self, ctx: RequestContext, guard: PoolGuard, item: AdmissionItem
    ) -> Reject | None:
        """Wait in the admission queue: None once dispatched, else the refusal."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reject | None] = loop.create_future()
        self._waiters[item.id] = fut
        self.metrics.admission_queue_depth.labels(ctx.pool).set(guard.queued)
        cfg = self.config.reliability.admission
        limit = min(cfg.queue_timeout_s, ctx.deadline - loop.time())
        if item.deadline is not None:
            limit = min(limit, item.deadline - time.monotonic())
        try:
            async with asyncio.timeout(max(0.0, limit)):
                return await fut
        except TimeoutError:
            # Still queued: drop it. Otherwise the pump dispatched it to a waiter that had
            # just gone (and released the slot) or refused it; either way we stop here.
            guard.cancel(item.id)
            late = item.deadline is not None and time.monotonic() >= item.deadline
            return Reject(
                item,
                "deadline" if late else "overload",
                "the deadline passed while the request was queued"
                if late
                else f"the request waited reliability.admission.queue_timeout_s "
                f"({cfg.queue_timeout_s:g} s) for a free slot in pool {ctx.pool!r}",
                1.0,
            )
        except asyncio.CancelledError:
            # Dispatched just as the client left: give the slot back.
            if (
                not guard.cancel(item.id)
                and fut.done()
                and not fut.cancelled()
                and fut.result() is None
            ):
                guard.release(item.id, time.monotonic())
            raise
        finally:
            self._waiters.pop(item.id, None)
            self.metrics.admission_queue_depth.labels(ctx.pool).set(guard.queued)

    def _apply_guard(self, pool: str, ev: GuardEvents) -> None:
        """Wake dispatched waiters, answer refused ones, publish breaker and ejection state
        (to the metrics, and to the router, so it chooses around them)."""
        guard = self.guards[pool]
        while True:
            if ev.flags:
                self._set_router_flags(pool, ev)
            released = False
            for item in ev.dispatch:
                fut = self._waiters.get(item.id)
                if fut is None or fut.done():
                    guard.release(item.id, time.monotonic())  # its waiter is gone
                    released = True
                else:
                    fut.set_result(None)
            for r in ev.rejected:
                fut = self._waiters.get(r.item.id)
                if fut is not None and not fut.done():
                    fut.set_result(r)
            m = self.metrics
            for tr in ev.breaker:
                m.breaker_state.labels(pool, tr.endpoint).set(_BREAKER_CODES[tr.new])
                m.breaker_transitions.labels(pool, tr.endpoint, tr.new).inc()
                log.info("breaker %s -> %s for %s (%s)", tr.old, tr.new, tr.endpoint, tr.reason)
            for oe in ev.outlier:
                ejected = oe.action == "eject"
                m.outlier_ejected.labels(pool, oe.endpoint).set(1 if ejected else 0)
                if ejected:
                    m.outlier_ejections.labels(pool, oe.endpoint, oe.reason).inc()
                    log.warning("ejected %s from pool %s (%s)", oe.endpoint, pool, oe.reason)
            if not released:
                break
            ev = guard.pump(time.monotonic())
        series = self._series(pool)
        series.queue_depth.set(guard.queued)
        series.tokens_in_flight.set(guard.tokens_in_flight())

    def _engine_restarted(self, pool: str, url: str, now: float) -> None:
        """The control plane says the engine restarted (new epoch): its cache is cold, so
        it ramps back in."""
        guard = self.guards[pool]
        guard.restarted(url, now)
        self._apply_guard(pool, guard.pump(now))

    def _set_router_flags(self, pool: str, ev: GuardEvents) -> None:
        """Breaker open, ejection and slow-start ramp, as the guard sees them, to the router
        (the guard reports a ramp on every reaper tick until it ends)."""
        router = self.routers[pool]
        now = time.monotonic()
        for f in ev.flags:
            router.set_flags(
                f.url,
                breaker_open=f.breaker_open,
                ejected_until=f.ejected_until,
                ramp=f.ramp,
                now=now,
            )

    # -- attempts ------------------------------------------------------------------------

    def _start_attempt(self, ctx: RequestContext, route: Route, reason: str) -> _Attempt:
        assert ctx.pick is not None
        router = self.routers[ctx.pool]
        guard = self.guards[ctx.pool] if ctx.inference is not None else None
        trace = ctx.trace.attempt(route.url, None, asyncio.get_running_loop().time(), reason=reason)
        attempt = _Attempt(router, route, next(self._attempt_ids), ctx.pick, guard, trace)
        if reason != "resume":  # a continuation's prompt is not the text the pick estimated
            attempt.inference = ctx.inference
        now = time.monotonic()
        router.started(route, attempt.rid, ctx.pick, now)
        if guard is not None:
            guard.started(route.url, attempt.rid, ctx.tokens, now, model=ctx.pick.model)
            if ctx.item_id is not None and (ev := guard.routed(ctx.item_id, now)) is not None:
                self._apply_guard(ctx.pool, ev)  # the next held new task may be judged
        ctx.tried.add(route.url)
        return attempt

    def _settle(self, attempt: _Attempt, outcome: str, error: str | None = None) -> None:
        """Tell the router, the guard and the trace how an attempt ended (once)."""
        if attempt.settled:
            return
        attempt.settled = True
        now = time.monotonic()
        route = attempt.route
        if outcome == "connect_error":
            attempt.router.connect_failed(route, attempt.rid, now, error or outcome)
        else:
            attempt.router.finished(
                route,
                attempt.rid,
                attempt.pick,
                now,
                ok=attempt.ok,
                cached_tokens=attempt.cached_tokens,
                completion_tokens=attempt.completion_tokens,
            )
        if (
            attempt.ok
            and attempt.prompt_tokens
            and attempt.inference is not None
            and self.chars_per_token is not None
        ):
            text = attempt.inference.prompt_text
            self.chars_per_token.observe(
                attempt.inference.model, len(text), utf8_length(text), attempt.prompt_tokens
            )
        if attempt.guard is not None:
            if attempt.ok and attempt.pick.context_key is not None:
                attempt.guard.step_succeeded(attempt.pick.context_key)
            attempt.guard.finished(
                route.url,
                attempt.rid,
                now,
                status=attempt.status or None,
                local_failure=attempt.local_failure,
                cancelled=attempt.cancelled,
                completion_tokens=attempt.completion_tokens if attempt.ok else None,
            )
        attempt.trace.end(
            outcome,
            attempt.status,
            attempt.cached_tokens,
            attempt.prompt_tokens,
            attempt.completion_tokens,
            asyncio.get_running_loop().time(),
            error=error,
        )

    def _screen(
        self, ctx: RequestContext, routes: list[Route], *, continuation: bool = False
    ) -> Screened[Route]:
        """`continuation`: a resumed stream (in-flight limits do not hold it back)."""
        guard = self.guards[ctx.pool]
        assert ctx.pick is not None
        screened = guard.screen(
            routes, ctx.tokens, ctx.pick.priority, time.monotonic(), continuation=continuation
        )
        for _, why in screened.skipped:
            self.metrics.breaker_rejections.labels(ctx.pool, why).inc()
        return screened

    async def _attempts(self, request: web.BaseRequest, ctx: RequestContext) -> web.StreamResponse:
        assert self._upstream is not None and ctx.pick is not None
        loop = asyncio.get_running_loop()
        up_cfg = self.config.upstream
        pick = ctx.pick
        now = time.monotonic()
        routes = self.routers[ctx.pool].order(pick, now)
        if routes and routes[0].departure is not None:
            self.metrics.affinity_departures.labels(ctx.pool, routes[0].departure).inc()
        ctx.trace.picked(routes, loop.time())
        retry = self.retry_budgets[ctx.pool]
        retry.deposit(now)
        failures: list[str] = []
        reason = ""
        made = 0
        while made < up_cfg.max_attempts:
            candidates = [r for r in routes if r.url not in ctx.tried]
            if not candidates:
                break
            if ctx.inference is not None:
                screened = self._screen(ctx, candidates)
                if screened.full and self.guards[ctx.pool].admission is None:
                    return self._refuse(
                        ctx,
                        503,
                        f"every endpoint of pool {ctx.pool!r} is at its in-flight limits "
                        "(reliability.breaker); retry shortly",
                        "overloaded",
                        retry_after_s=1,
                    )
                if screened.full and ctx.item_id is not None:
                    # Every endpoint is at its in-flight limits: back into the queue until
                    # a slot frees, then ask again.
                    guard = self.guards[ctx.pool]
                    guard.requeue(ctx.item_id, time.monotonic())
                    item_id, ctx.item_id = ctx.item_id, None
                    assert ctx.routing is not None
                    refusal = await self._wait_turn(
                        ctx,
                        guard,
                        AdmissionItem(
                            item_id,
                            tenant=pick.tenant,
                            priority=pick.priority,
                            deadline=pick.deadline_s,
                        ),
                    )
                    if refusal is not None:
                        return self._refuse_admission(ctx, refusal)
                    ctx.item_id = item_id
                    continue
                if not screened.routes:
                    failures += [f"{url}: {why}" for url, why in screened.skipped]
                    break
                route = screened.routes[0]
            else:
                route = candidates[0]
            made += 1
            url = route.url
            attempt = self._start_attempt(ctx, route, reason)
            try:
                budget = min(up_cfg.first_byte_timeout_s, ctx.deadline - loop.time())
                try:
                    async with asyncio.timeout(budget):
                        upstream = await self._upstream.request(
                            url,
                            request.method,
                            request.rel_url.raw_path_qs,
                            attempt.trace.inject_headers(ctx.upstream_headers),
                            ctx.body,
                        )
                except (UpstreamConnectError, UpstreamClosedError) as exc:
                    # No connection, or the engine closed it before answering (the pool has
                    # already retried a stale keep-alive one): try the next endpoint.
                    reason = str(exc)
                    attempt.local_failure = True
                    self._settle(attempt, "connect_error", reason)
                    self.metrics.upstream_attempts.labels(ctx.pool, url, "connect_error").inc()
                    failures.append(f"{url}: {reason}")
                    delay = self._retry_delay(ctx, made, len(routes), None, "connect_error")
                    if delay is None:
                        break
                    await asyncio.sleep(delay)
                    continue
                except TimeoutError:
                    attempt.local_failure = True
                    self._settle(attempt, "timeout")
                    self.metrics.upstream_attempts.labels(ctx.pool, url, "timeout").inc()
                    return self._refuse(
                        ctx,
                        504,
                        f"{url} sent no response headers within "
                        f"upstream.first_byte_timeout_s ({up_cfg.first_byte_timeout_s:g} s)",
                        "upstream_timeout",
                    )
                except UpstreamError as exc:  # a protocol error; the message names the url
                    attempt.local_failure = True
                    self._settle(attempt, "upstream_error", str(exc))
                    self.metrics.upstream_attempts.labels(ctx.pool, url, "error").inc()
                    return self._refuse(ctx, 502, f"upstream failed: {exc}", "upstream_error")
                status = upstream.status
                attempt.status = status
                self._count_attempt(ctx.pool, url, status)
                attempt.ok = status < 500
                if retry.retryable(status, False, False):
                    # Refused before the first byte (429/502/503/504): another endpoint may
                    # serve it, within the retry budget; otherwise the answer goes through.
                    after = parse_retry_after(upstream.header("retry-after") or "")
                    delay = self._retry_delay(ctx, made, len(routes), after, str(status))
                    if delay is not None:
                        attempt.ok = False
                        upstream.close()
                        self._settle(attempt, f"http_{status}")
                        failures.append(f"{url}: HTTP {status}")
                        reason = f"http_{status}"
                        await asyncio.sleep(delay)
                        continue
                return await self._relay(request, ctx, attempt, upstream)
            except asyncio.CancelledError:
                attempt.cancelled = True
                self._settle(attempt, "client_disconnect")
                raise
            finally:
                if not attempt.settled:
                    self._settle(attempt, attempt.outcome or "ok")
        detail = "; ".join(failures) or "no endpoint available"
        return self._refuse(
            ctx,
            502 if made else 503,
            f"no endpoint of pool {ctx.pool!r} accepted the request: {detail}",
            "upstream_unavailable" if made else "no_healthy_upstream",
            **({} if made else {"retry_after_s": 1}),
        )

    def _series(self, pool: str) -> _PoolSeries:
        series = self._pool_series.get(pool)
        if series is None:
            series = self._pool_series[pool] = _PoolSeries(self.metrics, pool)
        return series

    def _count_attempt(self, pool: str, url: str, status: int) -> None:
        """meshd_upstream_attempts_total{pool, endpoint, outcome=status}, its child cached."""
        key = (pool, url, status)
        child = self._attempt_series.get(key)
        if child is None:
            if len(self._attempt_series) >= _CACHE_LIMIT:
                self._attempt_series.clear()
            child = self._attempt_series[key] = self.metrics.upstream_attempts.labels(
                pool, url, str(status)
            )
        child.inc()

    def _retry_delay(
        self,
        ctx: RequestContext,
        attempts_made: int,
        routes: int,
        retry_after_s: float | None,
        reason: str,
    ) -> float | None:
        """Seconds to wait before the next attempt, or None when there is none: no other
        endpoint, the attempt cap, a Retry-After beyond the deadline, or the retry budget
        (retries stay under a ratio of recent requests, so failures never become a storm)."""
        if attempts_made >= min(routes, self.config.upstream.max_attempts):
            return None
        retry = self.retry_budgets[ctx.pool]
        delay = retry.backoff(attempts_made, self._rng, retry_after_s)
        if delay == math.inf or asyncio.get_running_loop().time() + delay >= ctx.deadline:
            return None
        if not retry.withdraw(time.monotonic(), attempts_made):
            self.metrics.retry_budget_exhausted.labels(ctx.pool).inc()
            return None
        self.metrics.retries.labels(ctx.pool, reason).inc()
        return delay

    def _response_headers(
        self, upstream: UpstreamResponse, ctx: RequestContext, url: str
    ) -> list[tuple[str, str]]:
        out = []
        connection = upstream.header("connection") or ""
        tokens = {t.strip().lower() for t in connection.split(",") if t}
        for name, value in upstream.headers:
            lname = name.lower()
            if lname in _RESPONSE_DROP or lname in tokens:
                continue
            out.append((name, value))
        if ctx.trusted:
            out.append(("x-meshd-endpoint", url))
        return out

    async def _relay(
        self,
        request: web.BaseRequest,
        ctx: RequestContext,
        attempt: _Attempt,
        upstream: UpstreamResponse,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        watch = _Watch(upstream, loop.time(), ctx.deadline)
        self._watches.add(watch)
        headers = self._response_headers(upstream, ctx, attempt.route.url)
        is_sse = upstream.content_type == "text/event-stream"
        try:
            if not is_sse:
                return await self._relay_whole(ctx, attempt, upstream, headers, watch)
            return await self._relay_stream(request, ctx, attempt, upstream, headers, watch)
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels the handler): drop the
            # upstream connection now so the engine stops generating.
            attempt.ok = False
            attempt.cancelled = True
            self._settle(attempt, "client_disconnect")
            self.metrics.client_disconnects.labels(ctx.pool).inc()
            self._finish(ctx, "client_disconnect")
            raise
        finally:
            self._watches.discard(watch)
            if upstream.at_eof() and watch.expired is None:
                upstream.release()  # back to the keep-alive pool
            else:
                upstream.close()  # unfinished: the connection can't be reused

    async def _relay_whole(
        self,
        ctx: RequestContext,
        attempt: _Attempt,
        upstream: UpstreamResponse,
        headers: list[tuple[str, str]],
        watch: _Watch,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        chunks = []
        try:
            while chunk := await upstream.read():
                watch.last_activity = loop.time()
                chunks.append(chunk)
        except (UpstreamError, ConnectionError) as exc:
            attempt.ok = False
            attempt.local_failure = True
            if watch.expired:
                self._settle(attempt, "timeout")
                return self._refuse(
                    ctx, 504, _expired_message(watch, self.config), "upstream_timeout"
                )
            self._settle(attempt, "stream_broken", _describe(exc))
            return self._refuse(
                ctx,
                502,
                f"the upstream failed while sending its response: {_describe(exc)}",
                "upstream_error",
            )
        body = b"".join(chunks)
        status = upstream.status
        usage = None
        if ctx.inference is not None and status == 200:
            usage = _usage_of(body)
            _take_usage(attempt, usage)
        self._settle(attempt, "ok" if status < 400 else f"http_{status}")
        self._finish(ctx, "ok" if status < 500 else "upstream_5xx", status, usage)
        return web.Response(body=body, status=status, headers=headers)

    async def _relay_stream(
        self,
        request: web.BaseRequest,
        ctx: RequestContext,
        attempt: _Attempt,
        upstream: UpstreamResponse,
        headers: list[tuple[str, str]],
        watch: _Watch,
    ) -> web.StreamResponse:
        """Relay SSE chunk by chunk. When failover may resume the stream, only whole events
        reach the client (a partial one is held until its end arrives) and what was sent
        is kept, so a continuation can be built from it if the engine dies."""
        loop = asyncio.get_running_loop()
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        if upstream.buffered:
            # The body's first bytes came with the head: the response head leaves with them
            # in one write (one syscall less before the first byte). Otherwise (an engine
            # still prefilling) it leaves now, as a proxy's should.
            resp._send_headers_immediately = False  # aiohttp >= 3.11's buffering switch
        await resp.prepare(request)
        inference = ctx.inference
        scan = ctx.kind in ("completion", "chat") and upstream.header("content-encoding") is None
        scanner = SSEScanner() if scan else None
        fo = self.config.reliability.failover
        resumable = (
            fo.enabled
            and fo.max_resumes > 0
            and scanner is not None
            and inference is not None
            and inference.n == 1
            and upstream.status == 200
        )
        sent: list[bytes] | None = [] if resumable else None
        out = _ChunkOut(resp)
        sent_bytes = 0
        held = b""
        splicer: StreamSplicer | None = None
        resumes = 0
        cur, cur_up, cur_watch = attempt, upstream, watch
        extra: list[tuple[_Attempt, UpstreamResponse, _Watch]] = []
        tokens_before = 0
        yielded = False
        failure: tuple[int, str, str] | None = None
        usage: dict[str, Any] | None = None
        try:
            while True:
                failure = None
                try:
                    while chunk := await cur_up.read():
                        cur_watch.last_activity = loop.time()
                        if splicer is not None:
                            chunk = splicer.feed(chunk)
                        elif sent is not None:
                            if held:
                                chunk, held = held + chunk, b""
                            cut = _event_end(chunk)
                            if cut < len(chunk):
                                chunk, held = chunk[:cut], chunk[cut:]
                        if not chunk:
                            continue
                        if sent is not None:
                            sent.append(chunk)
                            sent_bytes += len(chunk)
                            if sent_bytes > _MAX_RESUME_BYTES:
                                sent = None  # too long to resume: relay as it comes
                                chunk, held = chunk + held, b""
                        try:
                            # Out first, then accounted: the scan and the first-token
                            # bookkeeping below are not on the client's time to first byte.
                            if out.fast:
                                out.write(chunk)
                                if out.transport.get_write_buffer_size() > _DRAIN_AT:
                                    await out.drain()
                            else:
                                await resp.write(chunk)
                                out.check()
                        except ConnectionError:
                            # The client went away between two chunks.
                            cur.ok = False
                            cur.cancelled = True
                            self._settle(cur, "client_disconnect")
                            self.metrics.client_disconnects.labels(ctx.pool).inc()
                            self._finish(ctx, "client_disconnect")
                            return resp
                        if not yielded:
                            yielded = True
                            if self._yield_cpu is not None:
                                # The client may share this CPU and is now runnable: let it
                                # read its first token before meshd relays the rest.
                                self._yield_cpu()
                                self.first_byte_yields += 1
                        if scanner is not None:
                            try:
                                if scanner.feed(chunk) and cur.first_token_at is None:
                                    self._first_token(cur)
                            except ValueError as exc:
                                log.warning(
                                    "stopped scanning a stream from %s: %s", cur.route.url, exc
                                )
                                scanner = None
                                sent = None
                except (UpstreamError, ConnectionError) as exc:
                    if cur_watch.expired:
                        failure = (
                            504,
                            _expired_message(cur_watch, self.config),
                            "upstream_timeout",
                        )
                    else:
                        failure = (
                            502,
                            f"the upstream stream broke: {_describe(exc)}",
                            "upstream_stream_broken",
                        )
                if failure is None:
                    tail = held + (splicer.close() if splicer is not None else b"")
                    held = b""
                    if tail:
                        if scanner is not None:
                            with contextlib.suppress(ValueError):
                                scanner.feed(tail)
                        with contextlib.suppress(ConnectionError):
                            await resp.write(tail)
                    if scanner is not None and not scanner.done and scanner.error is None:
                        failure = (
                            502,
                            "the upstream closed the stream before [DONE]",
                            "upstream_stream_truncated",
                        )
                if scanner is not None:
                    cur.completion_tokens = scanner.tokens - tokens_before
                if failure is None:
                    break
                cur.ok = False
                cur.local_failure = True
                self._settle(
                    cur,
                    {
                        "upstream_timeout": "timeout",
                        "upstream_stream_truncated": "stream_truncated",
                    }.get(failure[2], "stream_broken"),
                    failure[1],
                )
                if sent is None or resumes >= fo.max_resumes:
                    break
                held = b""  # the partial event never reached the client
                resumed = await self._resume(ctx, request, sent)
                if isinstance(resumed, str):
                    outcome = "refused" if not resumed.startswith("no ") else "failed"
                    self.metrics.stream_resumes.labels(ctx.pool, outcome).inc()
                    ctx.trace.resumed(outcome, loop.time(), reason=resumed)
                    log.info("could not resume a stream from %s: %s", cur.route.url, resumed)
                    break
                if isinstance(resumed, bytes):  # nothing left to generate: end it here
                    self.metrics.stream_resumes.labels(ctx.pool, "resumed").inc()
                    ctx.trace.resumed("resumed", loop.time(), reason="nothing left to generate")
                    if scanner is not None:
                        with contextlib.suppress(ValueError):
                            scanner.feed(resumed)
                    with contextlib.suppress(ConnectionError):
                        await resp.write(resumed)
                    failure = None
                    break
                resumes += 1
                self.metrics.stream_resumes.labels(ctx.pool, "resumed").inc()
                cur, cur_up, splicer = resumed
                ctx.trace.resumed("resumed", loop.time(), tokens_sent=splicer.tokens_sent)
                cur_watch = _Watch(cur_up, loop.time(), ctx.deadline)
                self._watches.add(cur_watch)
                extra.append((cur, cur_up, cur_watch))
                tokens_before = scanner.tokens if scanner is not None else 0
            if scanner is not None:
                self._series(ctx.pool).stream_tokens.inc(scanner.tokens)
                found = splicer.usage if splicer is not None and splicer.usage else scanner.usage
                if isinstance(found, dict):
                    usage = found
                    _take_usage(cur, usage)
                    if splicer is not None:  # this attempt made only the continuation
                        cur.completion_tokens = scanner.tokens - tokens_before
            if failure is None:
                cur.ok = True
                self._settle(cur, "ok")
        finally:
            for a, up, w in extra:
                self._watches.discard(w)
                if up.at_eof() and w.expired is None:
                    up.release()
                else:
                    up.close()
                if not a.settled:  # the client left mid-continuation
                    a.ok = False
                    a.cancelled = True
                    self._settle(a, "client_disconnect")
        try:
            if failure is not None:
                await resp.write(sse_error_event(*failure))
            await resp.write_eof()
        except ConnectionError:
            self.metrics.client_disconnects.labels(ctx.pool).inc()
            self._finish(ctx, "client_disconnect")
            return resp
        self._finish(ctx, "ok" if failure is None else failure[2], 200, usage)
        return resp

    def _first_token(self, attempt: _Attempt) -> None:
        now = time.monotonic()
        attempt.first_token_at = now
        attempt.router.first_token(attempt.route, attempt.rid, now)
        if attempt.guard is not None:
            attempt.guard.first_token(
                attempt.rid, now, predicted_ttft_s=attempt.route.predicted_ttft_s
            )
        attempt.trace.first_token(asyncio.get_running_loop().time())

    async def _resume(
        self, ctx: RequestContext, request: web.BaseRequest, sent: list[bytes]
    ) -> tuple[_Attempt, UpstreamResponse, StreamSplicer] | bytes | str:
        """Continue a broken stream on another endpoint: the attempt, its upstream and the
        splicer for its events; or bytes that end the stream (nothing left to generate);
        or why it cannot be resumed (a refusal, or "no ..." when no endpoint took it)."""
        assert self._upstream is not None and ctx.inference is not None and ctx.pick is not None
        kind: StreamKind = "chat" if ctx.kind == "chat" else "completion"
        try:
            doc = json.loads(ctx.body)
        except ValueError:
            return "the request body is not JSON"
        recorder = StreamRecorder(kind)
        recorder.feed(b"".join(sent))
        if recorder.refusal is not None:
            return recorder.refusal
        if recorder.finished:
            return "the stream had already finished"
        usage = recorder.usage or {}
        prompt_tokens = usage.get("prompt_tokens")
        splicer = StreamSplicer.after(
            recorder,
            include_usage=ctx.inference.include_usage,
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
        )
        try:
            body = continuation_body(kind, doc, recorder.text, recorder.tokens)
        except FailoverUnsupported as exc:
            if (
                remaining_tokens(kind, doc, recorder.tokens) is not None
                and (remaining_tokens(kind, doc, recorder.tokens) or 0) <= 0
            ):
                return splicer.synthesize_end()
            return str(exc)
        now = time.monotonic()
        if not self.retry_budgets[ctx.pool].withdraw(now, 1):
            self.metrics.retry_budget_exhausted.labels(ctx.pool).inc()
            return "no retry budget left to resume the stream"
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        routes = [r for r in self.routers[ctx.pool].order(ctx.pick, now) if r.url not in ctx.tried]
        loop = asyncio.get_running_loop()
        for route in self._screen(ctx, routes, continuation=True).routes[:2]:
            attempt = self._start_attempt(ctx, route, "resume")
            try:
                async with asyncio.timeout(
                    min(self.config.upstream.first_byte_timeout_s, ctx.deadline - loop.time())
                ):
                    up = await self._upstream.request(
                        route.url,
                        "POST",
                        request.rel_url.raw_path_qs,
                        attempt.trace.inject_headers(ctx.upstream_headers),
                        data,
                    )
            except asyncio.CancelledError:
                attempt.cancelled = True
                self._settle(attempt, "client_disconnect")
                raise
            except (UpstreamError, TimeoutError) as exc:
                attempt.local_failure = True
                outcome = (
                    "connect_error" if isinstance(exc, UpstreamConnectError) else "upstream_error"
                )
                self._settle(attempt, outcome, _describe(exc))
                continue
            attempt.status = up.status
            if up.status != 200 or up.content_type != "text/event-stream":
                up.close()
                self._settle(attempt, f"http_{up.status}")
                continue
            attempt.ok = True
            return attempt, up, splicer
        return "no other endpoint accepted the continuation"

    def _refuse(
        self, ctx: RequestContext, status: int, message: str, code: str, **kw: Any
    ) -> web.Response:
        self._finish(ctx, code, status)
        return self._reject(status, message, code, **kw)

    def _finish(
        self,
        ctx: RequestContext,
        outcome: str,
        status: int = 0,
        usage: dict[str, Any] | None = None,
    ) -> None:
        if ctx.obs is not None:
            ctx.obs.finish(outcome, usage, asyncio.get_running_loop().time(), status=status)

    # -- admin -------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        pools = {
            name: sum(1 for ep in b.snapshot(now) if ep["healthy"])
            for name, b in self.routers.items()
        }
        problems = [f"pool {n!r} has no healthy endpoint" for n, c in pools.items() if c == 0]
        if self._draining:
            problems.insert(0, "draining")
        status = 503 if problems else 200
        body: dict[str, Any] = {
            "ready": not problems,
            "problems": problems,
            "healthy_endpoints": pools,
        }
        if self._feed is not None:
            # Said, not counted: a stale control plane leaves the sidecar routing on its
            # own observations (static stability), so it does not make it unready.
            body["control_plane"] = self._feed.health()
        return web.json_response(body, status=status)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _config(self, request: web.Request) -> web.Response:
        return web.json_response(self.config.model_dump(mode="json"))

    async def _endpoints(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        return web.json_response(
            {
                "hot_path": IMPLEMENTATION,
                "active_requests": self._active,
                "policy": self.config.routing.policy,
                "pools": {name: b.snapshot(now) for name, b in self.routers.items()},
                "kv_events": {name: p.snapshot() for name, p in self.precise.items()},
                "chars_per_token": (
                    None if self.chars_per_token is None else self.chars_per_token.snapshot()
                ),
            }
        )


def build_routers(
    config: Config, picker_overrides: Mapping[str, Any] | None = None
) -> dict[str, PoolRouter]:
    """Pool name -> its router, as `routing` says (the sidecar's, and the virtual-clock
    bench's, so both route with the same objects). `picker_overrides`: PickerConfig fields
    the config does not expose, replaced (the matrix's ablations switch mechanisms off)."""
    routing = config.routing
    picker_config = PickerConfig(
        lambda_usd_per_s=routing.picker.lambda_usd_per_s,
        lambda_knee_s=routing.picker.lambda_knee_s,
        epsilon=routing.picker.epsilon,
        load_metric=routing.picker.load_metric,
        decode_pricing=routing.picker.decode_pricing,
        decode_weight=routing.picker.decode_weight,
        prefill_delay_weight=routing.picker.prefill_delay_weight,
        elastic=routing.picker.elastic,
        tokens_per_block=routing.block_size_bytes / CHARS_PER_TOKEN,
        prefix_ttl_s=routing.picker.prefix_ttl_s,
        affinity_min_fraction=routing.picker.affinity_min_fraction,
        affinity_imbalance=routing.picker.affinity_imbalance,
        affinity_margin_s=routing.picker.affinity_margin_s,
        affinity_redo_weight=routing.picker.affinity_redo_weight,
    )
    if picker_overrides:
        picker_config = dataclasses.replace(picker_config, **picker_overrides)
    return {
        pool.name: make_router(
            routing.policy,
            [
                EndpointSpec(ep.url, ep.weight, ep.gpu, ep.kv_capacity_tokens)
                for ep in pool.endpoints
            ],
            unhealthy_after=routing.unhealthy_after_failures,
            cooldown_s=routing.unhealthy_cooldown_s,
            picker=picker_config,
        )
        for pool in config.pools
    }


def _precise_prefixes(
    config: Config, routers: Mapping[str, PoolRouter]
) -> dict[str, PrecisePrefix]:
    """One PrecisePrefix per pool that serves a model of routing.tokenizers, over that
    pool's picker index, following the KV events of its endpoints that set `kv_events`.
    A tokenizer that cannot be loaded is a config error naming its key."""
    routing = config.routing
    if routing.policy != "meshd" or not routing.tokenizers:
        return {}
    from meshd.kv_events import EngineModel, PrecisePrefix, TokenizerError

    models: dict[str, EngineModel] = {}
    for name, t in routing.tokenizers.items():
        try:
            models[name] = EngineModel.load(
                t.path,
                hash_algo=t.hash_algo,
                block_size=t.block_size,
                hash_seed=t.hash_seed,
                content_format=t.content_format,
                max_blocks=t.max_blocks,
            )
        except (TokenizerError, OSError, ValueError) as exc:
            raise ConfigError([f"routing.tokenizers.{name}.path: {exc}"]) from None
    out: dict[str, PrecisePrefix] = {}
    for pool in config.pools:
        served = [m for m in models if pool.serves(m)]
        router = routers.get(pool.name)
        if not served or not isinstance(router, PickerRouter):
            continue
        precise = PrecisePrefix(router.picker.index)
        for m in served:
            precise.add_model(m, models[m])
        for ep in pool.endpoints:
            if ep.kv_events is not None:
                kv = ep.kv_events
                precise.add_engine(
                    ep.url, served[0], kv.endpoint, replay=kv.replay, topic=kv.topic, bind=kv.bind
                )
        out[pool.name] = precise
    return out


def guard_config(config: Config, endpoints: int = 1) -> GuardConfig:
    """The guard of a pool of `endpoints` (admission's slots scale with it unless set)."""
    rel = config.reliability
    b, o, a, t = rel.breaker, rel.outlier, rel.admission, rel.throttle
    ss = rel.slow_start
    return GuardConfig(
        throttle=AdaptiveThrottleConfig(k=t.k, window_s=t.window_s) if t.enabled else None,
        admission=AdmissionConfig(
            max_in_flight=a.max_in_flight or ADMISSION_SLOTS_PER_ENDPOINT * max(1, endpoints),
            max_queued=a.max_queued,
            max_queued_per_tenant=a.max_queued_per_tenant,
            knee_wait_s=a.knee_wait_s,
            knee_max_wait_s=a.knee_max_wait_s,
            tenants={
                name: TenantPolicy(
                    weight=tp.weight,
                    max_priority=tp.max_priority,
                    max_queued=tp.max_queued,
                    max_in_flight=tp.max_in_flight,
                )
                for name, tp in a.tenants.items()
            },
        )
        if a.enabled
        else None,
        breaker=TokenBreakerConfig(
            endpoint_limits=Limits(
                max_tokens=b.max_tokens_per_endpoint,
                max_requests=b.max_requests_per_endpoint,
                max_pending=b.max_pending_per_endpoint,
            ),
            consecutive_failures=b.consecutive_failures,
            error_rate=b.error_rate,
            error_window_s=b.error_window_s,
            error_min_requests=b.error_min_requests,
            open_base_s=b.open_base_s,
            open_max_s=b.open_max_s,
            half_open_successes=b.half_open_successes,
            ttft_outlier_factor=b.ttft_outlier_factor,
            ttft_outlier_min_s=b.ttft_outlier_min_s,
        )
        if b.enabled
        else None,
        outlier=OutlierConfig(
            consecutive_5xx=o.consecutive_5xx,
            interval_s=o.interval_s,
            base_ejection_time_s=o.base_ejection_time_s,
            max_ejection_time_s=o.max_ejection_time_s,
            max_ejection_percent=o.max_ejection_percent,
            always_eject_one_host=o.always_eject_one_host,
        )
        if o.enabled
        else None,
        slow_start=SlowStartConfig(
            window_s=ss.window_s,
            aggression=ss.aggression,
            min_weight_percent=ss.min_weight_percent,
        )
        if ss.enabled
        else None,
        slow_abandon_factor=rel.slow_abandon_factor,
    )


def _request_id() -> str:
    """A random UUID version 4 as 32 hex digits, the same as `uuid.uuid4().hex` without
    building a UUID object (~1.5 us less a request)."""
    n = int.from_bytes(os.urandom(16), "big")
    return "%032x" % ((n & _UUID4_CLEAR) | _UUID4_SET)


# RFC 9562 5.4: the version nibble (4) and the variant bits (0b10), as uuid.UUID sets them.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


async def _expect(request: web.BaseRequest) -> None:
    """`Expect: 100-continue` answered as an aiohttp Application's router would (its default
    expect handler): HTTP/1.1 gets "100 Continue" before the body is read; another
    expectation is refused with 417."""
    expect = request.headers.get("Expect", "")
    if request.version == aiohttp.HttpVersion11:
        if expect.lower() != "100-continue":
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # The interim response is not the body.
        request.writer.output_size = 0
        await request.writer.drain()


def _event_end(chunk: bytes) -> int:
    """Where the last complete SSE event in `chunk` ends (0: none is complete). An event
    ends at a blank line: LF LF, CR CR, or CRLF CRLF (whose tail is LF CR LF)."""
    if chunk.endswith(b"\n\n"):
        return len(chunk)
    end = 0
    for sep in (b"\n\n", b"\r\r", b"\n\r\n"):
        i = chunk.rfind(sep)
        if i >= 0:
            end = max(end, i + len(sep))
    return end


def _usage_of(body: bytes) -> dict[str, Any] | None:
    """The `usage` object of a whole JSON response, if small enough to parse."""
    if len(body) > _MAX_USAGE_PARSE_BYTES:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


def _take_usage(attempt: _Attempt, usage: dict[str, Any] | None) -> None:
    if usage is None:
        return
    attempt.cached_tokens = _usage_cached_tokens(usage)
    for name in ("prompt_tokens", "completion_tokens"):
        v = usage.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(attempt, name, v)


def _usage_cached_tokens(usage: Any) -> int | None:
    """usage.prompt_tokens_details.cached_tokens (vLLM with --enable-prompt-tokens-details)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _bound(site: web.TCPSite) -> str:
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    host, port = sockets[0].getsockname()[:2]
    return f"{host}:{port}"


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def _expired_message(watch: _Watch, cfg: Config) -> str:
    if watch.expired == "idle":
        return (
            f"the upstream sent nothing for upstream.idle_timeout_s "
            f"({cfg.upstream.idle_timeout_s:g} s)"
        )
    return f"the request ran past upstream.request_timeout_s ({cfg.upstream.request_timeout_s:g} s)"


# -- command line ----------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sidecar",
        help="run the outbound sidecar proxy",
        description="Run the meshd sidecar: an OpenAI-compatible proxy that relays "
        "/v1/completions, /v1/chat/completions, /v1/embeddings and /v1/models to a pool of "
        "engines (vLLM, SGLang), streaming SSE chunk by chunk. Prints one JSON line "
        '{"event": "ready", ...} with the bound addresses once it listens. SIGTERM drains: '
        "no new connections, running streams get drain.grace_period_s to finish.",
        epilog="Example: meshd sidecar --upstream http://127.0.0.1:8000 --listen 127.0.0.1:15001",
    )
    p.add_argument(
        "--config", "-c", metavar="FILE", help="YAML config file (see `meshd config example`)"
    )
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="an engine URL for the default pool (repeatable); replaces the config's pools",
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="outbound listener address")
    p.add_argument(
        "--admin", metavar="HOST:PORT", help="admin listener address (loopback by default)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one config key, e.g. --set limits.max_body_bytes=1048576",
    )
    p.set_defaults(func=run)


def _split_hostport(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError([f"{flag}: expected HOST:PORT, got {value!r}"], "command line")
    return host.strip("[]") or "127.0.0.1", int(port)


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = list(args.set)
    if args.upstream:
        # Applied after the file, so --upstream replaces the file's pools.
        pools = [{"name": "default", "endpoints": list(args.upstream)}]
        overrides.insert(0, "pools=" + json.dumps(pools))
    for flag, key in (("--listen", "outbound"), ("--admin", "admin")):
        value = getattr(args, flag.lstrip("-"))
        if value:
            host, port = _split_hostport(value, flag)
            overrides += [f"listeners.{key}.host={host}", f"listeners.{key}.port={port}"]
    return load_config(args.config, overrides=overrides)


async def serve(config: Config, ready: asyncio.Event | None = None) -> int:
    sidecar = Sidecar(config)
    await sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        json.dumps(
            {
                "event": "ready",
                "version": __version__,
                "hot_path": IMPLEMENTATION,
                **sidecar.addresses,
            }
        ),
        flush=True,
    )
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("draining (grace period %.1f s)", config.drain.grace_period_s)
    await sidecar.drain_and_stop(
        lambda: print(json.dumps({"event": "draining", "active": sidecar.active}), flush=True)
    )
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvloop

    return uvloop.run(serve(config))
