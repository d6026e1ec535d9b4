"""Prefill/decode disaggregation at the sidecar's edge (issue #25; the protocol and the
decider are filters/disagg.py). A request for a pool of role `decode` first asks the
decider; when it splits, the prefill step runs on the pool's prefill pool (its own router:
the picker's prefix hit and TTFT/price, its guard and retry budget), and the request goes
on to the decode pool's attempts with the prefill's `kv_transfer_params` in its body. When
it does not split, or no prefill engine answers, the request is served whole on the decode
pool (its engines can prefill too: vLLM's kv_both).

Failures: a prefill step that fails is tried on the next prefill engine, within the prefill
pool's retry budget; then the request goes whole. A decode step refused before its first
byte is retried (attempts layer) and, when the refusal says the KV could not be fetched,
the retry is the whole request (a fresh prefill where it decodes). A decode that breaks
mid-stream is resumed like any stream (meshd's failover): the continuation carries no
transfer params. Both legs are attempts of the request: the trace, the access log and the
cost ledger see the prefill attempt (reason `prefill`) and the decode attempt, and the
prefill endpoint's guard counts its tokens in flight.

SGLang's protocol (`disaggregation.protocol: sglang`; the body is filters/disagg.py
`bootstrap_body`): every request is split (SGLang's decode engines serve nothing whole),
and no prefill step runs ahead: each try of the decode pool's attempts is a pair. Its
prefill leg (`open_leg`: the next prefill engine in the picker's order whose leg has not
failed for this request) and its decode leg get the same body, with a fresh room, at once
(`send_pair`); the decode engine's answer goes to the client once its head came and the
prefill leg ended well, as sgl-model-gateway drains the prefill answer before it forwards
the decode's; the prefill answer is read and dropped. A prefill leg that fails before
then fails the pair (PrefillLegFailed): the decode engine is not blamed, and the pair is
tried again, on another prefill engine, within the decode pool's retry budget (and the
prefill pool's, as a prefill retry). A decode leg refused before its first byte is a
failed try as any: the next try is a new pair, a new room and a new prefill leg (the old
leg is dropped, so the prefill engine frees the KV). A stream that breaks mid-way resumes
as a pair too: the continuation goes to a prefill and a decode engine with a fresh room.
Each leg is an attempt, the prefill leg first (reason `prefill`), so the trace, the
access log and the cost ledger see both, and the prefill engine's guard counts it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from filters.disagg import (
    SGLANG_BOOTSTRAP_PORT,
    aggregated_body,
    bootstrap_body,
    decide_split,
    decode_body,
    leg_answer,
    prefill_body,
    transfer_params,
)
from filters.guard import OVERLOAD_STATUSES
from meshd.context import Attempt, Plane, RequestContext
from meshd.http_message import Reply
from meshd.upstream import UpstreamConnectError, UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from filters.pool_router import Route
    from meshd.attempts import Attempts

_encoder = msgspec.json.Encoder()
# An answer to the prefill step larger than this is not one (it is one token).
_MAX_PREFILL_ANSWER = 1 << 20


async def _read_prefill_answer(up: Any, url: str, what: str) -> bytes:
    """A prefill step's whole answer (at most _MAX_PREFILL_ANSWER bytes); the connection
    goes back to the pool once read, and is closed on any failure, a cancel included."""
    chunks = []
    size = 0
    try:
        while chunk := await up.read():
            chunks.append(chunk)
            size += len(chunk)
            if size > _MAX_PREFILL_ANSWER:
                raise UpstreamError(url, f"{what} is too large")
    except BaseException:
        up.close()
        raise
    up.release()
    return b"".join(chunks)


# The span attribute that names a pair's bootstrap room (SGLang logs it as bootstrap_room).
ATTR_BOOTSTRAP_ROOM = "meshd.pd.bootstrap_room"


class PrefillLegFailed(Exception):
    """A pair's prefill leg failed before its decode leg's answer went out: try both again."""


@dataclass(slots=True, eq=False)
class PairPlan:
    """A request split under SGLang's protocol: the prefill pool's routes its pairs take
    (the picker's order, screened when it was split) and those whose leg failed."""

    source: str
    routes: list[Route]
    failed: set[str] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class PrefillLeg:
    """One pair's prefill leg: its engine, attempt, the body both legs carry, its room."""

    route: Route
    attempt: Attempt
    body: bytes
    room: Any  # int, or a list of them for a batch
    task: asyncio.Task[str | None] | None = None  # its result: None, or why it failed


class Disaggregator:
    def __init__(self, plane: Plane, attempts: Attempts) -> None:
        self.plane = plane
        self.attempts = attempts
        self.pools = {
            p.name: p.disaggregation for p in plane.config.pools if p.disaggregation is not None
        }
        # SGLang's protocol: (decode pool, prefill url) -> the prefill engine's bootstrap port.
        self.bootstrap_ports: dict[tuple[str, str], int] = {}
        for name, cfg in self.pools.items():
            if cfg.protocol != "sglang":
                continue
            for ep in plane.config.pool(cfg.prefill_pool).endpoints:
                port = ep.bootstrap_port or cfg.bootstrap_port or SGLANG_BOOTSTRAP_PORT
                self.bootstrap_ports[(name, ep.url)] = port

    def applies(self, ctx: RequestContext) -> bool:
        return ctx.pool in self.pools and ctx.inference is not None and ctx.pd is None

    async def prefill(self, ctx: RequestContext) -> Reply | None:
        """Decide, and when the request splits run its prefill step; on success the
        request's body becomes the decode step's. Under SGLang's protocol only decide: the
        request's tries are pairs (`ctx.pd_pair`), or it is refused (no prefill engine)."""
        cfg = self.pools[ctx.pool]
        assert cfg is not None and ctx.pick is not None and ctx.inference is not None
        doc = ctx.inference.doc
        if doc is None:
            return None
        plane = self.plane
        source = cfg.prefill_pool
        now = time.monotonic()
        routes = plane.routers[source].order(ctx.pick, now)
        screened = self.attempts.screen(ctx, routes, pool=source).routes
        sglang = cfg.protocol == "sglang"
        split = decide_split(
            ctx.pick.prompt_tokens,
            screened[0].cached_tokens if screened else None,
            min_prefill_tokens=cfg.min_prefill_tokens,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            kv_link_gb_per_s=cfg.kv_link_gb_per_s,
            prefill_available=bool(screened),
            whole_allowed=not sglang,
        )
        ctx.pd = split
        if sglang:
            return self._pair(ctx, source, screened)
        if not split.split:
            plane.metrics.pd_requests.labels(ctx.pool, "whole", split.reason).inc()
            ctx.trace.pd = f"whole:{split.reason}"
            return None
        body = _encoder.encode(prefill_body(doc))
        budget = plane.retry_budgets[source]
        budget.deposit(now)
        for made, route in enumerate(screened[: plane.config.upstream.max_attempts]):
            if made and not budget.withdraw(time.monotonic(), made):
                plane.metrics.retry_budget_exhausted.labels(source).inc()
                break
            params = await self._prefill_on(ctx, source, route, body)
            if params is not None:
                ctx.body = _encoder.encode(decode_body(doc, params))
                ctx.pd_params = params
                plane.metrics.pd_requests.labels(ctx.pool, "split", "split").inc()
                ctx.trace.pd = "split"
                return None
        plane.metrics.pd_requests.labels(ctx.pool, "whole", "prefill-failed").inc()
        ctx.trace.pd = "whole:prefill-failed"
        return None

    # ---- SGLang's protocol -----------------------------------------------------------

    def _pair(self, ctx: RequestContext, source: str, screened: list[Route]) -> Reply | None:
        """A request for an sglang decode pool: its tries will be pairs, or, with no prefill
        engine to take a leg, it is refused (SGLang's decode engines serve nothing whole;
        the pool's fallbacks may)."""
        plane = self.plane
        if not screened:
            plane.metrics.pd_requests.labels(ctx.pool, "refused", "no-prefill-engine").inc()
            ctx.trace.pd = "refused:no-prefill-engine"
            return self.attempts.acct.refuse(
                ctx,
                503,
                f"no engine of prefill pool {source!r} can take the prefill leg, and the "
                f"engines of pool {ctx.pool!r} (SGLang decode) serve nothing whole",
                "no_healthy_upstream",
                retry_after_s=1,
            )
        plane.retry_budgets[source].deposit(time.monotonic())
        ctx.pd_pair = PairPlan(source, list(screened))
        plane.metrics.pd_requests.labels(ctx.pool, "split", "split").inc()
        ctx.trace.pd = "split"
        return None

    def open_leg(self, ctx: RequestContext, doc: Mapping[str, Any]) -> PrefillLeg | str:
        """The prefill leg of the request's next pair, for the body `doc` (the request, or a
        resumed stream's continuation): its attempt begun, nothing sent yet. Or why there
        is none: no prefill engine left, or no retry budget for another leg."""
        plan = ctx.pd_pair
        assert plan is not None
        plane = self.plane
        candidates = [r for r in plan.routes if r.url not in plan.failed]
        if not candidates:
            return f"no engine of prefill pool {plan.source!r} is left for the prefill leg"
        if plan.failed and not plane.retry_budgets[plan.source].withdraw(
            time.monotonic(), len(plan.failed)
        ):
            plane.metrics.retry_budget_exhausted.labels(plan.source).inc()
            return f"no retry budget left in prefill pool {plan.source!r} for another leg"
        route = candidates[0]
        port = self.bootstrap_ports.get((ctx.pool, route.url))
        if port is None:  # an endpoint that came from discovery, not the config
            cfg = self.pools[ctx.pool]
            port = (cfg.bootstrap_port if cfg is not None else None) or SGLANG_BOOTSTRAP_PORT
        body = bootstrap_body(aggregated_body(doc), bootstrap_host(route.url), port, plane.rng)
        attempt = self.attempts.start(ctx, route, "prefill", pool=plan.source)
        ctx.tried.discard(route.url)  # the decode pool may hold the same engine
        assert ctx.inference is not None
        if doc is not ctx.inference.doc:
            attempt.inference = None  # a continuation's prompt is not the text the pick saw
        room = body["bootstrap_room"]
        _name_room(attempt, room)
        return PrefillLeg(route, attempt, _encoder.encode(body), room)

    async def send_pair(
        self, ctx: RequestContext, leg: PrefillLeg, attempt: Attempt, url: str
    ) -> UpstreamResponse:
        """Send `leg.body` to the prefill engine of `leg` and, as `attempt`, to the decode
        engine at `url`, at once. The decode engine's answer, once its head came and (a 200)
        the prefill leg ended well; a refusal comes back at once (the prefill leg is
        dropped). Raises PrefillLegFailed when the prefill leg failed first (the decode
        request is dropped), and what the decode request raised. Neither leg outlives the
        call."""
        plane = self.plane
        assert plane.upstream is not None
        _name_room(attempt, leg.room)
        headers = attempt.trace.inject_headers(ctx.upstream_headers)
        decode = asyncio.ensure_future(
            plane.upstream.request(url, ctx.method, ctx.target, headers, leg.body)
        )
        leg.task = task = asyncio.ensure_future(self._run_leg(ctx, leg))
        try:
            done, _ = await asyncio.wait({decode, task}, return_when=asyncio.FIRST_COMPLETED)
            if task in done and (why := task.result()) is not None and decode not in done:
                raise PrefillLegFailed(f"{leg.route.url}: {why}")
            up = await decode
            if up.status != 200:
                return up
            why = await task
            if why is not None:
                up.close()
                raise PrefillLegFailed(f"{leg.route.url}: {why}")
            return up
        finally:
            if not decode.done():
                decode.cancel()
            self.close_leg(leg)

    def close_leg(self, leg: PrefillLeg) -> None:
        """Drop a leg still running (its engine frees the KV when the connection goes)."""
        task = leg.task
        if task is not None and not task.done():
            task.cancel()
        if not leg.attempt.settled:
            leg.attempt.cancelled = True
            self.attempts.settle(leg.attempt, "cancelled")

    async def _run_leg(self, ctx: RequestContext, leg: PrefillLeg) -> str | None:
        """One prefill leg, its answer read whole and dropped: None, or why it failed
        (settled as such, and its engine is not asked again for this request)."""
        from meshd.relay import describe, take_usage

        plane = self.plane
        assert plane.upstream is not None and ctx.pd_pair is not None
        plan = ctx.pd_pair
        attempt = leg.attempt
        url = leg.route.url
        try:
            up = await plane.upstream.request(
                url,
                ctx.method,
                ctx.target,
                attempt.trace.inject_headers(ctx.upstream_headers),
                leg.body,
            )
            data = await _read_prefill_answer(up, url, "the prefill leg's answer")
        except asyncio.CancelledError:
            attempt.cancelled = True
            self.attempts.settle(attempt, "cancelled")
            raise
        except (UpstreamError, OSError, TimeoutError) as exc:
            attempt.local_failure = True
            connect = isinstance(exc, UpstreamConnectError)
            self.attempts.settle(
                attempt, "connect_error" if connect else "upstream_error", describe(exc)
            )
            plan.failed.add(url)
            return describe(exc)
        attempt.status = up.status
        if up.status != 200:
            self.attempts.settle(attempt, f"http_{up.status}")
            plan.failed.add(url)
            return f"HTTP {up.status}: {data[:200].decode('utf-8', 'replace')}"
        why, usage = leg_answer(data, sse=up.content_type == "text/event-stream")
        take_usage(attempt, usage)
        attempt.ok = why is None
        if why is not None:
            self.attempts.settle(attempt, "prefill_error", why)
            plan.failed.add(url)
            return why
        self.attempts.settle(attempt, "ok")
        return None

    async def _prefill_on(
        self, ctx: RequestContext, pool: str, route: Route, body: bytes
    ) -> dict[str, Any] | None:
        """One prefill step on `route`: the transfer params, or None (settled as failed)."""
        from meshd.relay import describe, take_usage

        plane = self.plane
        assert plane.upstream is not None
        attempt = self.attempts.start(ctx, route, "prefill", pool=pool)
        ctx.tried.discard(route.url)  # the decode pool may hold the same engine
        loop = asyncio.get_running_loop()
        try:
            timeout = min(
                plane.config.upstream.first_byte_timeout_s,
                min(ctx.deadline, ctx.head_by) - loop.time(),
            )
            async with asyncio.timeout(max(0.001, timeout)):
                up = await plane.upstream.request(
                    route.url,
                    "POST",
                    ctx.target,
                    attempt.trace.inject_headers(ctx.upstream_headers),
                    body,
                )
                data = await _read_prefill_answer(up, route.url, "the prefill answer")
        except asyncio.CancelledError:
            attempt.cancelled = True
            self.attempts.settle(attempt, "client_disconnect")
            raise
        except (UpstreamError, ConnectionError, TimeoutError) as exc:
            attempt.local_failure = True
            self.attempts.settle(
                attempt,
                "timeout" if isinstance(exc, TimeoutError) else "upstream_error",
                describe(exc),
            )
            return None
        attempt.status = up.status
        if up.status != 200:
            self.attempts.settle(attempt, f"http_{up.status}")
            return None
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        params = transfer_params(answer)
        attempt.ok = params is not None
        if isinstance(answer, dict) and isinstance(answer.get("usage"), dict):
            take_usage(attempt, answer["usage"])
        self.attempts.settle(attempt, "ok" if params is not None else "no_transfer_params")
        return params


def kv_fetch_failed(status: int, body: bytes) -> bool:
    """Did a decode step fail because its KV could not be fetched? Then it is retried whole
    (a fresh prefill where it decodes; under SGLang's protocol, a new pair). The simulator
    says so exactly (410, error type KVTransferError); a real vLLM ends such a request with
    an internal error (SGLang with a 500 "Decode transfer failed"), so a 5xx from a decode
    step counts too, but for 429 and 503: an engine that sheds load never took the request,
    and another decode engine may (the attempts layer's retry). Other 4xx are the
    client's to see."""
    if status in OVERLOAD_STATUSES:
        return False
    if status == 410 or status >= 500:
        return True
    return status >= 400 and b'"kvtransfererror"' in body[:4096].lower()


def whole_body(ctx: RequestContext) -> bytes:
    """The request as the client sent it, without transfer params."""
    assert ctx.inference is not None and ctx.inference.doc is not None
    return _encoder.encode(aggregated_body(ctx.inference.doc))


def bootstrap_host(url: str) -> str:
    """The bootstrap host of the prefill engine at `url`: its hostname, an IPv6 address in
    brackets (SGLang's maybe_wrap_ipv6_address, as mini_lb.py sends it)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def _name_room(attempt: Attempt, room: Any) -> None:
    span = attempt.trace.span
    if span is not None and span.is_recording():
        span.set_attribute(ATTR_BOOTSTRAP_ROOM, room if isinstance(room, int) else list(room))
