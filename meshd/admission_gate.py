"""The admission layer: a request with a prompt is throttled, admitted, queued (deadline-
aware) or refused before any endpoint is chosen, and released when its last attempt ends.
The decisions are the pool's `filters.guard.PoolGuard`; this layer holds the waiters and
publishes what the guard reports (breaker, ejection, slow start) to the metrics and the
router."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Hashable, Mapping

from filters.admission import AdmissionItem, Admit, Reject
from filters.guard import GuardEvents, PoolGuard, Throttled
from filters.pool_router import admission_item
from meshd.accounting import Accounting
from meshd.context import Plane, RequestContext
from meshd.http_message import Reply
from meshd.metrics import BREAKER_CLOSED, BREAKER_HALF_OPEN, BREAKER_OPEN

log = logging.getLogger("meshd.sidecar")

_BREAKER_CODES = {"closed": BREAKER_CLOSED, "half-open": BREAKER_HALF_OPEN, "open": BREAKER_OPEN}
# The tick hands the guard only the KV capacities that changed, and every one this often,
# in case the guard forgot an endpoint (its breaker drops idle ones past max_endpoints).
KV_RESYNC_S = 10.0


class AdmissionGate:
    def __init__(self, plane: Plane, accounting: Accounting) -> None:
        self.plane = plane
        self.acct = accounting
        self._waiters: dict[Hashable, asyncio.Future[Reject | None]] = {}
        self._kv_given: dict[str, Mapping[str, int]] = {}  # pool -> the capacities it was given
        self._kv_resync_at = -math.inf

    async def admit(self, ctx: RequestContext, guard: PoolGuard) -> Reply | None:
        """Throttle, then admit or queue: None when the request may go upstream now."""
        plane = self.plane
        pick, routing = ctx.pick, ctx.routing
        assert pick is not None and routing is not None
        ctx.item_id = next(plane.ids)
        now = time.monotonic()
        router = plane.routers[ctx.pool] if guard.admission is not None else None
        item = admission_item(ctx.item_id, router, pick, routing.step, ctx.tokens, now)
        ctx.continues_task = item.started
        decision = guard.gate(item, now, plane.rng)
        if isinstance(decision, Admit):
            return None
        ctx_item, ctx.item_id = ctx.item_id, None  # not admitted: nothing to release
        if isinstance(decision, Throttled):
            plane.metrics.throttled_requests.labels(ctx.pool).inc()
            self.shed(ctx)
            return self.acct.refuse(ctx, 503, decision.message, decision.code, retry_after_s=1)
        if isinstance(decision, Reject):
            return self.refuse(ctx, decision)
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        ctx.item_id = ctx_item
        refusal = await self.wait_turn(ctx, guard, item)
        plane.metrics.admission_queue_wait.labels(ctx.pool).observe(loop.time() - queued_at)
        if refusal is None:
            ctx.trace.admitted(queued_at, loop.time())
            return None
        ctx.item_id = None
        ctx.trace.admitted(queued_at, loop.time(), outcome=refusal.code)
        return self.refuse(ctx, refusal)

    def release(self, ctx: RequestContext) -> None:
        """The request's attempts are over: its admission slot goes to the next in line."""
        if ctx.item_id is not None:
            guard = self.plane.guards[ctx.pool]
            now = time.monotonic()
            guard.release(ctx.item_id, now)
            self.apply(ctx.pool, guard.pump(now))

    def refuse(self, ctx: RequestContext, r: Reject) -> Reply:
        self.plane.metrics.admission_rejections.labels(ctx.pool, r.reason).inc()
        self.shed(ctx)
        return self.acct.refuse(
            ctx, 429, r.message, r.code, retry_after_s=max(1, math.ceil(r.retry_after_s))
        )

    def shed(self, ctx: RequestContext) -> None:
        """A request turned away for want of capacity: unmet demand for the autoscaler."""
        ctx.shed = True
        demand = self.plane.observer.demand
        if demand is not None:
            prompt = ctx.inference.estimated_prompt_tokens if ctx.inference is not None else 0
            demand.shed(ctx.pool, time.monotonic(), prompt_tokens=prompt)

    async def wait_turn(
        self, ctx: RequestContext, guard: PoolGuard, item: AdmissionItem
    ) -> Reject | None:
        """Wait in the admission queue: None once dispatched, else the refusal."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Reject | None] = loop.create_future()
        self._waiters[item.id] = fut
        metrics = self.plane.metrics
        metrics.admission_queue_depth.labels(ctx.pool).set(guard.queued)
        cfg = self.plane.config.reliability.admission
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
            metrics.admission_queue_depth.labels(ctx.pool).set(guard.queued)

    async def requeue(self, ctx: RequestContext) -> Reply | None:
        """Every endpoint is at its in-flight limits: back into the queue until a slot
        frees (None), or the refusal."""
        assert ctx.item_id is not None and ctx.pick is not None
        guard = self.plane.guards[ctx.pool]
        guard.requeue(ctx.item_id, time.monotonic())
        item_id, ctx.item_id = ctx.item_id, None
        pick = ctx.pick
        item = AdmissionItem(
            item_id, tenant=pick.tenant, priority=pick.priority, deadline=pick.deadline_s
        )
        refusal = await self.wait_turn(ctx, guard, item)
        if refusal is not None:
            return self.refuse(ctx, refusal)
        ctx.item_id = item_id
        return None

    def apply(self, pool: str, ev: GuardEvents) -> None:
        """Wake dispatched waiters, answer refused ones, publish breaker and ejection state
        (to the metrics, and to the router, so it chooses around them)."""
        guard = self.plane.guards[pool]
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
            self._publish(pool, ev)
            if not released:
                break
            ev = guard.pump(time.monotonic())
        series = self.acct.series(pool)
        series.set_queue_depth(guard.queued)
        series.set_tokens_in_flight(guard.tokens_in_flight())

    def _publish(self, pool: str, ev: GuardEvents) -> None:
        m = self.plane.metrics
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

    def engine_restarted(self, pool: str, url: str, now: float) -> None:
        """The engine restarted (a new epoch, from the control plane or its /metrics): its
        cache is cold, so it ramps back in."""
        guard = self.plane.guards[pool]
        guard.restarted(url, now)
        self.apply(pool, guard.pump(now))

    def tick(self, now: float) -> None:
        """The reaper's period: breaker timers, ejections ending, slow-start ramps, and
        the breaker's token limits following each engine's KV capacity as learnt: only
        those that changed since the last tick (each costs the breaker a dataclass
        replace; all 1,000 endpoints' every tick were ~1% of a core), all every
        KV_RESYNC_S."""
        resync = now >= self._kv_resync_at
        if resync:
            self._kv_resync_at = now + KV_RESYNC_S
        given = self._kv_given
        for pool, guard in self.plane.guards.items():
            self.apply(pool, guard.tick(now))
            caps = self.plane.routers[pool].kv_capacities(now)
            before = given.get(pool)
            if before is None or resync:
                changed = caps
            elif caps is before or caps == before:  # the router's same answer: no change
                continue
            else:
                changed = {url: cap for url, cap in caps.items() if before.get(url) != cap}
            for url, cap in changed.items():
                guard.kv_capacity(url, cap)
            given[pool] = caps

    def _set_router_flags(self, pool: str, ev: GuardEvents) -> None:
        """Breaker open, ejection and slow-start ramp, as the guard sees them, to the router
        (the guard reports a ramp on every reaper tick until it ends)."""
        router = self.plane.routers[pool]
        now = time.monotonic()
        for f in ev.flags:
            router.set_flags(
                f.url,
                breaker_open=f.breaker_open,
                ejected_until=f.ejected_until,
                ramp=f.ramp,
                now=now,
            )
