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
import ipaddress
import itertools
import json
import logging
import math
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from filters.hotpath import (
    IMPLEMENTATION,
    RoutingHeaders,
    SSEScanner,
    block_hashes,
    parse_routing_headers,
)
from filters.picker import PickerConfig, PickRequest
from filters.pool_router import EndpointSpec, PoolRouter, Route, make_router
from filters.request import (
    CHARS_PER_TOKEN,
    PATH_KINDS,
    InferenceRequest,
    RequestError,
    parse_inference_request,
)
from filters.retry_budget import RetryBudget, RetryBudgetConfig, parse_retry_after
from meshd import __version__
from meshd.config import Config, ConfigError, load_config
from meshd.errors import error_response, sse_error_event
from meshd.metrics import DataPlaneMetrics
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


# A whole (non-streamed) response is parsed for its usage only below this size.
_MAX_USAGE_PARSE_BYTES = 1 << 20


@dataclass(slots=True, eq=False)
class _Attempt:
    """One try of a request on one endpoint, and what the router is told about it."""

    router: PoolRouter
    route: Route
    rid: int
    pick: PickRequest
    ok: bool = False
    cached_tokens: int | None = None
    settled: bool = False


@dataclass(slots=True)
class RequestContext:
    kind: str
    pool: str
    started: float
    trusted: bool
    inference: InferenceRequest | None = None
    routing: RoutingHeaders | None = None
    block_hashes: list[int] = field(default_factory=list)
    request_id: str = ""


class Sidecar:
    """One sidecar: its listeners, its upstream client pool and its state."""

    def __init__(self, config: Config, *, original_destination_fn: Any = None) -> None:
        self.config = config
        # Tests without iptables inject where a transparent connection was headed.
        self._original_destination_fn = original_destination_fn
        self.metrics = DataPlaneMetrics()
        routing = config.routing
        picker_config = PickerConfig(
            lambda_usd_per_s=routing.picker.lambda_usd_per_s,
            epsilon=routing.picker.epsilon,
            load_metric=routing.picker.load_metric,
            tokens_per_block=routing.block_size_bytes / CHARS_PER_TOKEN,
        )
        self.routers: dict[str, PoolRouter] = {
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
        self._rng = random.Random()
        self._trusted_nets = config.trust.networks()
        self._active = 0
        self._draining = False
        self._watches: set[_Watch] = set()
        self._session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamPool | None = None
        self._runner: web.AppRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._transparent: Any = None
        self._feed: Any = None  # meshd.control_feed.ControlFeed when control_plane is set
        self.addresses: dict[str, str] = {}

    @property
    def active(self) -> int:
        return self._active

    # -- lifecycle -------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_body_bytes)
        for path in PATH_KINDS:
            app.router.add_post(path, self._inference)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._passthrough)
        return app

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
        self._runner = web.AppRunner(
            self.build_app(),
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=cfg.drain.grace_period_s,
            keepalive_timeout=limits.keepalive_timeout_s,
            # The parser's own bounds sit above ours so that our check answers 431
            # with a clear body; these only stop a request that is absurd.
            max_headers=limits.max_header_count * 2,
            max_field_size=limits.max_header_bytes,
            max_line_size=limits.max_header_bytes,
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
        if cfg.control_plane.addresses:
            from meshd.control_feed import ControlFeed

            self._feed = ControlFeed(cfg, self.routers, self.metrics)
            await self._feed.start()

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
        if self._session is not None:
            await self._session.close()
        if self._upstream is not None:
            await self._upstream.close()
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()

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

    # -- client requests -------------------------------------------------------

    def _is_trusted(self, request: web.BaseRequest) -> bool:
        remote = request.remote
        if not remote:
            return False
        try:
            addr = ipaddress.ip_address(remote)
        except ValueError:
            return False
        return any(addr in net for net in self._trusted_nets)

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
        if model is None:
            return self.config.pools[0].name
        for p in self.config.pools:
            if p.serves(model):
                return p.name
        return None

    async def _inference(self, request: web.Request) -> web.StreamResponse:
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
            if routing_cfg.policy == "meshd":  # only the prefix-aware picker reads them
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

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
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

    async def _models(self, request: web.Request) -> web.StreamResponse:
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
            ctx.request_id = uuid.uuid4().hex
            out.append(("x-request-id", ctx.request_id))
        out.append(("via", VIA))
        return out

    async def _forward(
        self,
        request: web.Request,
        ctx: RequestContext,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> web.StreamResponse:
        assert self._upstream is not None
        loop = asyncio.get_running_loop()
        up_cfg = self.config.upstream
        router = self.routers[ctx.pool]
        upstream_headers = self._upstream_headers(headers, ctx)
        deadline = ctx.started + up_cfg.request_timeout_s
        now = time.monotonic()
        if ctx.inference is not None and ctx.routing is not None:
            pick = PickRequest.build(ctx.inference, ctx.routing, now, block_hashes=ctx.block_hashes)
        else:
            pick = PickRequest(model="")
        routes = router.order(pick, now)
        retry = self.retry_budgets[ctx.pool]
        retry.deposit(now)
        failures: list[str] = []
        for n, route in enumerate(routes, start=1):
            if n > up_cfg.max_attempts:
                break
            url = route.url
            attempt = _Attempt(router, route, next(self._attempt_ids), pick)
            router.started(route, attempt.rid, pick, time.monotonic())
            try:
                budget = min(up_cfg.first_byte_timeout_s, deadline - loop.time())
                try:
                    async with asyncio.timeout(budget):
                        upstream = await self._upstream.request(
                            url, request.method, request.rel_url.raw_path_qs, upstream_headers, body
                        )
                except (UpstreamConnectError, UpstreamClosedError) as exc:
                    # No connection, or the engine closed it before answering (the pool has
                    # already retried a stale keep-alive one): try the next endpoint.
                    reason = str(exc)
                    router.connect_failed(route, attempt.rid, time.monotonic(), reason)
                    attempt.settled = True
                    self.metrics.upstream_attempts.labels(ctx.pool, url, "connect_error").inc()
                    failures.append(f"{url}: {reason}")
                    delay = self._retry_delay(ctx, n, len(routes), None, deadline, "connect_error")
                    if delay is None:
                        break
                    await asyncio.sleep(delay)
                    continue
                except TimeoutError:
                    self.metrics.upstream_attempts.labels(ctx.pool, url, "timeout").inc()
                    self._finish(ctx, "timeout")
                    return self._reject(
                        504,
                        f"{url} sent no response headers within "
                        f"upstream.first_byte_timeout_s ({up_cfg.first_byte_timeout_s:g} s)",
                        "upstream_timeout",
                    )
                except UpstreamError as exc:  # a protocol error; the message names the url
                    self.metrics.upstream_attempts.labels(ctx.pool, url, "error").inc()
                    self._finish(ctx, "upstream_error")
                    return self._reject(502, f"upstream failed: {exc}", "upstream_error")
                status = upstream.status
                self.metrics.upstream_attempts.labels(ctx.pool, url, str(status)).inc()
                attempt.ok = status < 500
                if retry.retryable(status, False, False):
                    # Refused before the first byte (429/502/503/504): another endpoint may
                    # serve it, within the retry budget; otherwise the answer goes through.
                    after = parse_retry_after(upstream.header("retry-after") or "")
                    delay = self._retry_delay(ctx, n, len(routes), after, deadline, str(status))
                    if delay is not None:
                        attempt.ok = False
                        upstream.close()
                        failures.append(f"{url}: HTTP {status}")
                        await asyncio.sleep(delay)
                        continue
                return await self._relay(request, ctx, attempt, upstream, deadline)
            finally:
                if not attempt.settled:
                    router.finished(
                        route,
                        attempt.rid,
                        pick,
                        time.monotonic(),
                        ok=attempt.ok,
                        cached_tokens=attempt.cached_tokens,
                    )
        self._finish(ctx, "no_upstream")
        detail = "; ".join(failures) or "no endpoint available"
        return self._reject(
            502,
            f"no endpoint of pool {ctx.pool!r} accepted the request: {detail}",
            "upstream_unavailable",
        )

    def _retry_delay(
        self,
        ctx: RequestContext,
        attempts_made: int,
        routes: int,
        retry_after_s: float | None,
        deadline: float,
        reason: str,
    ) -> float | None:
        """Seconds to wait before the next attempt, or None when there is none: no other
        endpoint, the attempt cap, a Retry-After beyond the deadline, or the retry budget
        (retries stay under a ratio of recent requests, so failures never become a storm)."""
        if attempts_made >= min(routes, self.config.upstream.max_attempts):
            return None
        retry = self.retry_budgets[ctx.pool]
        delay = retry.backoff(attempts_made, self._rng, retry_after_s)
        if delay == math.inf or asyncio.get_running_loop().time() + delay >= deadline:
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
        request: web.Request,
        ctx: RequestContext,
        attempt: _Attempt,
        upstream: UpstreamResponse,
        deadline: float,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        watch = _Watch(upstream, loop.time(), deadline)
        self._watches.add(watch)
        headers = self._response_headers(upstream, ctx, attempt.route.url)
        is_sse = upstream.content_type == "text/event-stream"
        try:
            if not is_sse:
                return await self._relay_whole(ctx, attempt, upstream, headers, watch)
            return await self._relay_stream(request, ctx, attempt, upstream, headers, watch)
        except asyncio.CancelledError:
            attempt.ok = False
            # The client went away (aiohttp cancels the handler): drop the
            # upstream connection now so the engine stops generating.
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
            outcome = "timeout" if watch.expired else "upstream_failed"
            self._finish(ctx, outcome)
            if watch.expired:
                return self._reject(504, _expired_message(watch, self.config), "upstream_timeout")
            return self._reject(
                502,
                f"the upstream failed while sending its response: {_describe(exc)}",
                "upstream_error",
            )
        body = b"".join(chunks)
        if ctx.inference is not None and upstream.status == 200:
            attempt.cached_tokens = _cached_tokens_of(body)
        self._finish(ctx, "ok" if upstream.status < 500 else "upstream_5xx")
        return web.Response(body=body, status=upstream.status, headers=headers)

    async def _relay_stream(
        self,
        request: web.Request,
        ctx: RequestContext,
        attempt: _Attempt,
        upstream: UpstreamResponse,
        headers: list[tuple[str, str]],
        watch: _Watch,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        url = attempt.route.url
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        await resp.prepare(request)
        scan = ctx.kind in ("completion", "chat") and upstream.header("content-encoding") is None
        scanner = SSEScanner() if scan else None
        first_token_at: float | None = None
        failure: tuple[int, str, str] | None = None
        try:
            while chunk := await upstream.read():
                watch.last_activity = now = loop.time()
                if scanner is not None:
                    try:
                        if scanner.feed(chunk) and first_token_at is None:
                            first_token_at = now
                            attempt.router.first_token(attempt.route, attempt.rid, time.monotonic())
                    except ValueError as exc:
                        log.warning("stopped scanning a stream from %s: %s", url, exc)
                        scanner = None
                try:
                    await resp.write(chunk)
                except ConnectionError:
                    # The client went away between two chunks.
                    attempt.ok = False
                    self.metrics.client_disconnects.labels(ctx.pool).inc()
                    self._finish(ctx, "client_disconnect")
                    return resp
        except (UpstreamError, ConnectionError) as exc:
            if watch.expired:
                failure = (504, _expired_message(watch, self.config), "upstream_timeout")
            else:
                failure = (
                    502,
                    f"the upstream stream broke: {_describe(exc)}",
                    "upstream_stream_broken",
                )
        if failure is None and scanner is not None and not scanner.done and scanner.error is None:
            failure = (
                502,
                "the upstream closed the stream before [DONE]",
                "upstream_stream_truncated",
            )
        if failure is not None:
            attempt.ok = False
        if scanner is not None:
            self.metrics.stream_tokens.labels(ctx.pool).inc(scanner.tokens)
            attempt.cached_tokens = _usage_cached_tokens(scanner.usage)
        if first_token_at is not None:
            self.metrics.ttft.labels(ctx.pool, url).observe(first_token_at - ctx.started)
        try:
            if failure is not None:
                await resp.write(sse_error_event(*failure))
            await resp.write_eof()
        except ConnectionError:
            self.metrics.client_disconnects.labels(ctx.pool).inc()
            self._finish(ctx, "client_disconnect")
            return resp
        self._finish(ctx, "ok" if failure is None else failure[2])
        return resp

    def _finish(self, ctx: RequestContext, outcome: str) -> None:
        self.metrics.requests.labels(ctx.kind, ctx.pool, outcome).inc()
        self.metrics.request_duration.labels(ctx.kind, ctx.pool).observe(
            asyncio.get_running_loop().time() - ctx.started
        )

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
        return web.json_response(
            {"ready": not problems, "problems": problems, "healthy_endpoints": pools}, status=status
        )

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
            }
        )


def _usage_cached_tokens(usage: Any) -> int | None:
    """usage.prompt_tokens_details.cached_tokens (vLLM with --enable-prompt-tokens-details)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _cached_tokens_of(body: bytes) -> int | None:
    if len(body) > _MAX_USAGE_PARSE_BYTES:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return _usage_cached_tokens(doc.get("usage")) if isinstance(doc, dict) else None


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
