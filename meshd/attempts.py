"""The routing and attempts layer: the router orders the pool's endpoints for a request,
the guard screens them (breaker, in-flight limits), and the request is tried on them in
turn: a refusal before the first byte (no connection, 429/502/503/504) moves on to the next,
within the pool's retry budget and with backoff, until one answers. The answer goes to the
relay layer. Every attempt is settled once: the router, the guard and the trace are told
how it ended."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from filters.chars_per_token import CharsPerToken, utf8_length
from filters.deadline import late_refusal
from filters.guard import OVERLOAD_STATUSES, Screened
from filters.picker import PickRequest
from filters.pool_router import Route
from filters.retry_budget import parse_retry_after
from filters.stream_start import ANSWER, StartFailure, StreamStart, Verdict
from meshd.accounting import Accounting
from meshd.admission_gate import AdmissionGate
from meshd.context import Attempt, Plane, RequestContext
from meshd.deadlines import Deadlines, Timeout
from meshd.disagg import Disaggregator, PrefillLeg, PrefillLegFailed, kv_fetch_failed, whole_body
from meshd.fallback import move_before_trying
from meshd.http_message import HttpRequest, Reply
from meshd.upstream import (
    UpstreamClosedError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
)

if TYPE_CHECKING:
    from meshd.relay import Relay

# meshd_upstream_attempts_total's result for an attempt's outcome, where they differ.
_ATTEMPT_RESULTS = {"upstream_error": "error"}

# What one try tells the loop of tries to do next.
_NEXT = object()  # try the next endpoint
_STOP = object()  # no more tries: say what failed


@dataclass(slots=True)
class _Tries:
    routes: list[Route]
    made: int = 0
    reason: str = ""  # why the next attempt is made (the last one's failure)
    failures: list[str] = field(default_factory=list)


class Attempts:
    def __init__(
        self,
        plane: Plane,
        accounting: Accounting,
        gate: AdmissionGate,
        chars_per_token: CharsPerToken | None,
    ) -> None:
        self.plane = plane
        self.acct = accounting
        self.gate = gate
        self.chars_per_token = chars_per_token
        self.relay: Relay  # set by the Relay that answers for these attempts
        # Each attempt's first-byte deadline, on one loop timer (meshd/deadlines.py).
        self.deadlines = Deadlines()
        self.pd = (
            Disaggregator(plane, self)
            if any(p.disaggregation for p in plane.config.pools)
            else None
        )

    async def run(self, req: HttpRequest, ctx: RequestContext) -> Reply | None:
        """Try the request until an endpoint answers; the relayed answer (None: streamed)
        or the refusal."""
        plane = self.plane
        assert plane.upstream is not None and ctx.pick is not None
        now = time.monotonic()
        if self.pd is not None and self.pd.applies(ctx):
            routes_or_refusal = await self._split(ctx, now)
            if isinstance(routes_or_refusal, Reply):
                return routes_or_refusal
            routes = routes_or_refusal
        else:
            routes = self._order(ctx, now, asyncio.get_running_loop().time())
            if (refused := self._before_trying(ctx, routes, now, whole=True)) is not None:
                return refused
        tries = _Tries(routes)
        while tries.made < plane.settings.max_attempts:
            route = await self._next_route(ctx, tries)
            if route is _NEXT:
                continue  # requeued until a slot freed: ask again
            if route is _STOP:
                break
            if isinstance(route, Reply):
                return route
            assert isinstance(route, Route)
            tries.made += 1
            result = await self._try(req, ctx, route, tries)
            if result is _NEXT:
                continue
            if result is _STOP:
                break
            assert result is None or isinstance(result, Reply)
            return result
        detail = "; ".join(tries.failures) or "no endpoint available"
        made = tries.made
        return self.acct.refuse(
            ctx,
            502 if made else 503,
            f"no endpoint of pool {ctx.pool!r} accepted the request: {detail}",
            "upstream_unavailable" if made else "no_healthy_upstream",
            **({} if made else {"retry_after_s": 1}),
        )

    async def _split(self, ctx: RequestContext, now: float) -> list[Route] | Reply:
        """A request for a decode pool (meshd/disagg.py): the decider, then the decode pool's
        order, each pool ordered once. Split, the prefill pool's order serves the decider
        and the prefill step (or the pairs' legs) and the decode pool is ordered for the
        decode leg (its KV comes by transfer: KV headroom, decode load and ITL decide,
        PoolRouter.order_decode) once the prefill step is done, so the engine is chosen on
        its load as the leg starts; served whole, the decode pool is ordered as any pool.
        A request that has a fallback pool moves on before any step when the prefill pool's
        best predicts its deadline missed or its cost over its cap (fallback.py)."""
        assert self.pd is not None and ctx.pick is not None
        pd = self.pd
        plan = pd.decide(ctx)
        if isinstance(plan, Reply):
            return plan
        if plan is not None:
            if (refused := self._before_trying(ctx, plan.routes, now)) is not None:
                return refused
            if ctx.pd_pair is None:
                await pd.prefill(ctx, plan)  # vLLM's protocol: the prefill step runs first
        loop_now = asyncio.get_running_loop().time()
        if ctx.pd_params is None and ctx.pd_pair is None:  # whole, or every prefill failed
            routes = self._order(ctx, time.monotonic(), loop_now)
            if (
                plan is None
                and (refused := self._before_trying(ctx, routes, now, whole=True)) is not None
            ):
                return refused
            return routes
        routes = pd.order_decode(ctx, time.monotonic())
        ttft = pd.predicted_ttft_s(ctx, routes[0] if routes else None)
        shown = [routes[0]._replace(predicted_ttft_s=ttft), *routes[1:]]
        ctx.trace.picked(shown if routes else routes, loop_now)
        return routes

    def _order(self, ctx: RequestContext, now: float, loop_now: float) -> list[Route]:
        """The request's pool ordered for it; its affinity departure counted, the pick
        traced."""
        assert ctx.pick is not None
        routes = self.plane.routers[ctx.pool].order(ctx.pick, now)
        if routes and routes[0].departure is not None:
            self.plane.metrics.affinity_departures.labels(ctx.pool, routes[0].departure).inc()
        ctx.trace.picked(routes, loop_now)
        return routes

    def _before_trying(
        self, ctx: RequestContext, routes: list[Route], now: float, *, whole: bool = False
    ) -> Reply | None:
        """Before the first try: a request with a fallback pool moves on when the best
        route predicts its deadline missed or its cost over its cap (fallback.py); a
        request served `whole` (not split into prefill and decode legs) whose best route
        is predicted to finish after its deadline is refused (filters/deadline.py);
        otherwise it counts toward the pool's retry budget."""
        if ctx.hold_refusal and routes and (move := move_before_trying(ctx, routes[0])):
            return self.acct.refuse(ctx, 503, move[1], move[0], retry_after_s=1)
        if whole and routes and (late := self._late(ctx, routes[0])) is not None:
            self.plane.metrics.admission_rejections.labels(ctx.pool, "deadline").inc()
            self.gate.shed(ctx)
            return self.acct.refuse(ctx, 429, late, "deadline_unmeetable", retry_after_s=1)
        self.plane.retry_budgets[ctx.pool].deposit(now)
        return None

    def _late(self, ctx: RequestContext, best: Route) -> str | None:
        """Why the request is refused as late (reliability.admission.refuse_predicted_late):
        a new task's request (not a step of one under way, whose earlier steps would be
        lost) whose best route's predicted end is after its deadline; None: try it."""
        pick = ctx.pick
        if pick is None or not self.plane.settings.refuse_predicted_late:
            return None
        router = self.plane.routers[ctx.pool]
        now = time.monotonic()
        return late_refusal(router, best, pick, now, ctx.pool, started=ctx.continues_task)

    async def _next_route(self, ctx: RequestContext, tries: _Tries) -> Route | Reply | object:
        """The next endpoint to try, a refusal, _NEXT (ask again) or _STOP."""
        candidates = [r for r in tries.routes if r.url not in ctx.tried]
        if not candidates:
            return _STOP
        if ctx.inference is None:
            return candidates[0]
        screened = self.screen(ctx, candidates, limit=1)
        if screened.full and self.plane.guards[ctx.pool].admission is None:
            return self.acct.refuse(
                ctx,
                503,
                f"every endpoint of pool {ctx.pool!r} is at its in-flight limits "
                "(reliability.breaker); retry shortly",
                "overloaded",
                retry_after_s=1,
            )
        if screened.full and ctx.item_id is not None:
            # Every endpoint is at its in-flight limits: back into the queue until a slot
            # frees, then ask again.
            refused = await self.gate.requeue(ctx)
            return _NEXT if refused is None else refused
        if not screened.routes:
            tries.failures += [f"{url}: {why}" for url, why in screened.skipped]
            return _STOP
        return screened.routes[0]

    async def _try(
        self, req: HttpRequest, ctx: RequestContext, route: Route, tries: _Tries
    ) -> Reply | object | None:
        """One attempt on `route`: the relayed answer, a refusal, _NEXT or _STOP."""
        plane = self.plane
        assert plane.upstream is not None
        settings = plane.settings
        url = route.url
        loop = asyncio.get_running_loop()
        leg: PrefillLeg | None = None
        if ctx.pd_pair is not None and self.pd is not None and ctx.inference is not None:
            # SGLang's protocol: this try is a pair, its prefill leg the first attempt.
            opened = await self.pd.open_leg(ctx, ctx.inference.doc or {})
            if isinstance(opened, str):
                tries.failures.append(opened)
                return _STOP
            leg = opened
        # The attempt is counted (router, guard) and its first-byte timer armed once its
        # bytes are on their way (UpstreamPool.request's `sent`): nothing there decides
        # where this request goes, so it waits until after the send (issue #22).
        paired = leg is not None and self.pd is not None
        attempt = self.start(ctx, route, tries.reason, overlap=leg is not None, count=paired)
        try:
            # (min() of two without the builtin call: ~750 instructions each)
            by = ctx.head_by if ctx.head_by < ctx.deadline else ctx.deadline
            left = by - loop.time()
            first_byte_s = settings.first_byte_timeout_s
            try:
                with self.deadlines.timeout(
                    loop.time() + (left if left < first_byte_s else first_byte_s), armed=paired
                ) as timer:
                    if leg is not None and self.pd is not None:
                        upstream = await self.pd.send_pair(ctx, leg, attempt, url)
                    else:
                        try:
                            upstream = await plane.upstream.request(
                                url,
                                ctx.method,
                                ctx.target,
                                attempt.trace.inject_headers(ctx.upstream_headers),
                                ctx.body,
                                functools.partial(self._sent, ctx, attempt, timer),
                            )
                        finally:
                            if not attempt.counted:  # failed before its bytes left
                                self.count(ctx, attempt)
            except PrefillLegFailed as exc:
                # The pair's prefill leg failed first: the decode engine is not to blame.
                # Both legs again, another prefill engine, within the retry budget.
                attempt.cancelled = True
                self.settle(attempt, "prefill_failed", str(exc))
                ctx.tried.discard(url)
                tries.failures.append(f"prefill leg: {exc}")
                tries.reason = "prefill_failed"
                delay = self.retry_delay(
                    ctx, tries.made, len(tries.routes) + 1, None, "prefill_failed"
                )
                if delay is None:
                    return _STOP
                await asyncio.sleep(delay)
                return _NEXT
            except (UpstreamConnectError, UpstreamClosedError) as exc:
                # No connection, or the engine closed it before answering (the pool has
                # already retried a stale keep-alive one): try the next endpoint.
                tries.reason = str(exc)
                attempt.local_failure = True
                self.settle(attempt, "connect_error", tries.reason)
                tries.failures.append(f"{url}: {tries.reason}")
                delay = self.retry_delay(ctx, tries.made, len(tries.routes), None, "connect_error")
                if delay is None:
                    return _STOP
                await asyncio.sleep(delay)
                return _NEXT
            except TimeoutError:
                attempt.local_failure = True
                self.settle(attempt, "timeout")
                per_try = settings.first_byte_timeout_s <= left
                if per_try:
                    # The engine took the request and never answered (hung, stopped): like
                    # Envoy's per-try timeout, another endpoint may serve it, within the
                    # retry budget and the request's own deadline.
                    tries.reason = "timeout"
                    tries.failures.append(f"{url}: no response headers")
                    delay = self.retry_delay(ctx, tries.made, len(tries.routes), None, "timeout")
                    if delay is not None:
                        await asyncio.sleep(delay)
                        return _NEXT
                if per_try:
                    limit = f"upstream.first_byte_timeout_s ({settings.first_byte_timeout_s:g} s)"
                elif ctx.head_by < ctx.deadline:
                    limit = "the client's deadline (x-meshd-deadline-ms)"
                else:
                    limit = (
                        f"the rest of upstream.request_timeout_s ({settings.request_timeout_s:g} s)"
                    )
                return self.acct.refuse(
                    ctx, 504, f"{url} sent no response headers within {limit}", "upstream_timeout"
                )
            except UpstreamError as exc:  # a protocol error; the message names the url
                attempt.local_failure = True
                self.settle(attempt, "upstream_error", str(exc))
                return self.acct.refuse(ctx, 502, f"upstream failed: {exc}", "upstream_error")
            status = attempt.status = upstream.status
            split = ctx.pd_params is not None or ctx.pd_pair is not None
            started: StartFailure | None = None
            if split and status == 200 and upstream.content_type == "text/event-stream":
                # A decode step's stream: its head waits for its first event, as real vLLM
                # fails a KV load after the 200 (an error event): a refusal all the same.
                started = await self._stream_start(ctx, upstream)
                if started is not None:
                    status = attempt.status = started.status
            if (
                split
                and status != 200
                and (
                    kv_fetch_failed(status, started.body())
                    if started is not None
                    else await self._kv_lost(ctx, upstream)
                )
            ):
                # The decode step could not fetch its KV: the retry is the whole request
                # (SGLang's: a new pair, with a fresh room and a new prefill leg).
                upstream.release()  # its connection back (or closed, if unfinished)
                attempt.local_failure = True
                why = "the decode step could not fetch its KV"
                if started is not None:
                    why += f": {started.detail}"
                self.settle(attempt, started.outcome if started else f"http_{status}", why)
                tries.failures.append(
                    f"{url}: {started.detail if started else f'HTTP {status}'} (KV not fetched)"
                )
                tries.reason = "kv_fetch_failed"
                if ctx.pd_pair is None:
                    ctx.body, ctx.pd_params = whole_body(ctx), None
                    # Served whole from here on, as x-meshd-pd says (meshd/disagg.py served).
                    ctx.trace.pd = "whole:kv-fetch-failed"
                ctx.tried.discard(url)  # it can serve the request again
                delay = self.retry_delay(ctx, tries.made, len(tries.routes) + 1, None, "kv_fetch")
                if delay is None:
                    return _STOP
                await asyncio.sleep(delay)
                return _NEXT
            attempt.ok = status < 500
            if plane.retry_budgets[ctx.pool].retryable(status, False, False):
                # Refused before the first byte (429/502/503/504): another endpoint may
                # serve it, within the retry budget; otherwise the answer goes through.
                after = attempt.retry_after_s = parse_retry_after(
                    upstream.header("retry-after") or ""
                )
                if status in OVERLOAD_STATUSES and self._all_held(ctx, tries):
                    # Every other endpoint refused as overloaded moments ago (each held,
                    # EndpointState.refused): a retry would only add an attempt to the storm.
                    delay = None
                else:
                    delay = self.retry_delay(ctx, tries.made, len(tries.routes), after, str(status))
                if delay is not None or ctx.hold_refusal:
                    attempt.ok = False
                    upstream.close()
                    self.settle(attempt, f"http_{status}")
                    tries.failures.append(f"{url}: HTTP {status}")
                    tries.reason = f"http_{status}"
                    if delay is None:  # the pool is shedding it: its fallback may not
                        return _STOP
                    await asyncio.sleep(delay)
                    return _NEXT
            if started is not None:  # not retried: the stream goes out as it came
                attempt.status, attempt.ok = upstream.status, True
            return await self.relay.relay(req, ctx, attempt, upstream)
        except asyncio.CancelledError:
            attempt.cancelled = True
            self.settle(attempt, "client_disconnect")
            raise
        finally:
            if not attempt.settled:
                self.settle(attempt, attempt.outcome or "ok")

    def _all_held(self, ctx: RequestContext, tries: _Tries) -> bool:
        """Whether every endpoint left to try is held by a recent overload refusal."""
        router = self.plane.routers[ctx.pool]
        now = time.monotonic()
        left = [r.url for r in tries.routes if r.url not in ctx.tried]
        return bool(left) and all(router.held_s(url, now) > 0.0 for url in left)

    async def _stream_start(
        self, ctx: RequestContext, upstream: UpstreamResponse
    ) -> StartFailure | None:
        """Read a stream's start until it is an answer (None) or a failure before its first
        token (filters/stream_start.py). The bytes are put back for whoever relays it. An
        engine silent for upstream.idle_timeout_s has failed; at the client's deadline for
        its head (or the request's) the stream goes out as it is."""
        loop = asyncio.get_running_loop()
        idle_s = self.plane.config.upstream.idle_timeout_s
        start = StreamStart()
        data: list[bytes] = []
        verdict: Verdict | None = None
        idle_at = loop.time() + idle_s
        by = min(ctx.deadline, ctx.head_by)
        try:
            async with asyncio.timeout_at(min(idle_at, by)) as timer:
                while verdict is None:
                    chunk = await upstream.read()
                    if not chunk:
                        verdict = start.end()
                        break
                    data.append(chunk)
                    verdict = start.feed(chunk)
                    idle_at = loop.time() + idle_s
                    timer.reschedule(min(idle_at, by))
        except (UpstreamError, ConnectionError):
            verdict = start.end()
        except TimeoutError:
            verdict = start.end(silent_s=idle_s) if idle_at <= by else ANSWER
        except asyncio.CancelledError:
            upstream.close()  # the client left: the engine stops generating
            raise
        upstream.unread(b"".join(data))
        return verdict if isinstance(verdict, StartFailure) else None

    async def _kv_lost(self, ctx: RequestContext, upstream: Any) -> bool:
        """Read a refused decode step's (small) body: does it say the KV was not fetched?
        The bytes are put back for whoever relays the answer."""
        data = b""
        with contextlib.suppress(UpstreamError, ConnectionError):
            while len(data) < 65536 and (chunk := await upstream.read()):
                data += chunk
        upstream.unread(data)
        return kv_fetch_failed(upstream.status, data)

    def start(
        self,
        ctx: RequestContext,
        route: Route,
        reason: str,
        *,
        pool: str | None = None,
        overlap: bool = False,
        pick: PickRequest | None = None,
        count: bool = True,
    ) -> Attempt:
        """An attempt begins: the router and the guard count it in flight. `pool`: the
        pool the route is of, when not the request's (a prefill step). `overlap`: it runs
        beside the attempt before it (a pair's decode leg beside its prefill leg). `pick`:
        what the router was asked for, when not ctx.pick (a prefill step's: one token).
        `count=False`: the caller counts it later (`count`), once its bytes are sent."""
        plane = self.plane
        assert ctx.pick is not None
        pick = pick or ctx.pick
        pool = pool or ctx.pool
        router = plane.routers[pool]
        guard = plane.guards[pool] if ctx.inference is not None else None
        now = asyncio.get_running_loop().time()
        trace = ctx.trace.attempt(route.url, None, now, reason=reason, overlap=overlap)
        attempt = Attempt(router, route, next(plane.ids), pool, pick, guard, trace)
        if ctx.pd is not None and reason != "prefill" and self._leg_transfers(ctx, reason):
            trace.kv_transfer(ctx.pd_transfers.get(route.url, ctx.pd.transfer_s))
        if reason != "resume":  # a continuation's prompt is not the text the pick estimated
            attempt.inference = ctx.inference
        ctx.tried.add(route.url)
        if count:
            self.count(ctx, attempt)
        else:
            attempt.counted = False
        return attempt

    def _sent(self, ctx: RequestContext, attempt: Attempt, timer: Timeout) -> None:
        timer.arm()
        self.count(ctx, attempt)

    def count(self, ctx: RequestContext, attempt: Attempt) -> None:
        """The router and the guard count the attempt in flight (once)."""
        attempt.counted = True
        now = time.monotonic()
        attempt.router.started(attempt.route, attempt.rid, attempt.pick, now)
        guard = attempt.guard
        if guard is not None:
            assert ctx.pick is not None
            guard.started(attempt.route.url, attempt.rid, ctx.tokens, now, model=ctx.pick.model)
            if ctx.item_id is not None and (ev := guard.routed(ctx.item_id, now)) is not None:
                self.gate.apply(ctx.pool, ev)  # the next held new task may be judged

    @staticmethod
    def _leg_transfers(ctx: RequestContext, reason: str) -> bool:
        """Whether a decode pool attempt of a split request fetches the prompt's KV: a
        pair's decode leg (SGLang's), or the decode step with transfer params (vLLM's; its
        continuation after a broken stream is served whole)."""
        return ctx.pd_pair is not None or (ctx.pd_params is not None and reason != "resume")

    def settle(self, attempt: Attempt, outcome: str, error: str | None = None) -> None:
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
            if attempt.status in OVERLOAD_STATUSES and not attempt.local_failure:
                attempt.router.refused(route, now, attempt.retry_after_s)
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
        # Counted as it ended, not as its head came: a 200 whose stream broke is a
        # stream_broken, and a resumed stream's continuation is an attempt too.
        if outcome == "ok" or outcome.startswith("http_"):
            result = str(attempt.status or outcome)
        else:
            result = _ATTEMPT_RESULTS.get(outcome, outcome)
        self.acct.count_attempt(attempt.pool, route.url, result)
        attempt.trace.end(
            outcome,
            attempt.status,
            attempt.cached_tokens,
            attempt.prompt_tokens,
            attempt.completion_tokens,
            asyncio.get_running_loop().time(),
            error=error,
        )

    def screen(
        self,
        ctx: RequestContext,
        routes: list[Route],
        *,
        continuation: bool = False,
        pool: str | None = None,
        limit: int | None = None,
    ) -> Screened[Route]:
        """The routes the guard lets through now (`continuation`: a resumed stream, which
        in-flight limits do not hold back; `pool`: another pool's routes, a prefill step's;
        `limit`: no more than this many, the rest not asked about); the skipped ones are
        counted."""
        pool = pool or ctx.pool
        guard = self.plane.guards[pool]
        assert ctx.pick is not None
        screened = guard.screen(
            routes,
            ctx.tokens,
            ctx.pick.priority,
            time.monotonic(),
            continuation=continuation,
            limit=limit,
        )
        for _, why in screened.skipped:
            self.plane.metrics.breaker_rejections.labels(pool, why).inc()
        return screened

    def retry_delay(
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
        plane = self.plane
        if attempts_made >= min(routes, plane.config.upstream.max_attempts):
            return None
        retry = plane.retry_budgets[ctx.pool]
        delay = retry.backoff(attempts_made, plane.rng, retry_after_s)
        by = min(ctx.deadline, ctx.head_by)
        if delay == math.inf or asyncio.get_running_loop().time() + delay >= by:
            return None
        if not retry.withdraw(time.monotonic(), attempts_made):
            plane.metrics.retry_budget_exhausted.labels(ctx.pool).inc()
            return None
        plane.metrics.retries.labels(ctx.pool, reason).inc()
        return delay
