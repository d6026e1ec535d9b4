"""The response cache at the sidecar's edge (the rules are filters/response_cache.py): a
request that may be replayed is looked up before admission (a hit never takes an engine's
slot, a queue place or a retry token); identical whole (non-streamed) requests in flight
wait for the one that went to the engine (coalescing, at most `max_waiters` per key, each
until its own deadline; a streamed one does not wait, its first token would come with the
other's last); an answer that qualifies is stored when its last byte is out. The store is this
sidecar's memory or a Redis every sidecar shares; Redis unreachable or slow means the
cache is bypassed for `retry_after_s`, never a failed request.

What a replay is counted as: the request ends `ok` with no attempt (so the cost ledger
charges it nothing), its access-log record and span say `response_cache: hit` (or
`coalesced`) and the GPU-seconds and dollars the stored answer cost, which
meshd_response_cache_*_avoided_total add up per pool (what asking the engine again would
have cost: the prompt from its prefix cache, the answer decoded again). Clients see RFC 9211's
`Cache-Status` (`meshd; hit`, `meshd; fwd=miss; stored`, ...) and RFC 9111's `Age` on a
replay."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from filters.response_cache import (
    CachedAnswer,
    CacheDecision,
    MemoryStore,
    answer_from_stream,
    answer_from_whole,
    cache_key,
    decide,
    decode_answer,
    encode_answer,
    parse_cache_control,
    render,
)
from meshd.http_message import HttpRequest, Reply

if TYPE_CHECKING:
    from meshd.accounting import Accounting
    from meshd.config_schema import Config, ResponseCacheRedis
    from meshd.context import RequestContext
    from meshd.observe import RequestTrace

log = logging.getLogger("meshd.response_cache")

# At most this many Redis writes in flight; more answers are not stored (counted).
_MAX_PENDING_WRITES = 256


class ResponseCacheMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.lookups = Counter(
            "meshd_response_cache_requests",
            "Cacheable requests by what the response cache did: hit (a stored answer), "
            "coalesced (an identical request's answer), miss, refresh (no-cache), "
            "bypass (coalescing full or store down)",
            ["pool", "result"],
            registry=r,
        )
        self.uncacheable = Counter(
            "meshd_response_cache_uncacheable_requests",
            "Requests the cache left alone, by reason (not deterministic, no-store, ...)",
            ["pool", "reason"],
            registry=r,
        )
        self.stored = Counter(
            "meshd_response_cache_stored",
            "Answers stored, by form (whole or stream)",
            ["pool", "form"],
            registry=r,
        )
        self.not_stored = Counter(
            "meshd_response_cache_not_stored",
            "Answers of cacheable requests not stored, by reason",
            ["pool", "reason"],
            registry=r,
        )
        self.bytes_served = Counter(
            "meshd_response_cache_served_bytes",
            "Body bytes answered from the cache",
            ["pool"],
            registry=r,
        )
        self.tokens_avoided = Counter(
            "meshd_response_cache_tokens_avoided",
            "Tokens engines did not process because the cache answered (prompt, completion)",
            ["pool", "phase"],
            registry=r,
        )
        self.gpu_seconds_avoided = Counter(
            "meshd_response_cache_gpu_seconds_avoided",
            "GPU-seconds engines would have spent answering the replayed requests again",
            ["pool"],
            registry=r,
        )
        self.usd_avoided = Counter(
            "meshd_response_cache_usd_avoided",
            "Dollars engines would have spent answering the replayed requests again",
            ["pool"],
            registry=r,
        )
        self.store_errors = Counter(
            "meshd_response_cache_store_errors",
            "Shared-store (Redis) commands that failed or timed out; the cache was bypassed",
            ["op"],
            registry=r,
        )
        self.entries = Gauge(
            "meshd_response_cache_entries", "Answers in the memory store", registry=r
        )
        self.bytes = Gauge(
            "meshd_response_cache_bytes", "Bytes the memory store holds (estimate)", registry=r
        )
        self.evictions = Counter(
            "meshd_response_cache_evictions",
            "Answers the memory store dropped for room (lru) or age (ttl)",
            ["reason"],
            registry=r,
        )


class RedisStore:
    """Answers in Redis (msgpack records, each with its TTL), shared by every sidecar.
    A failed or slow command turns the store off for `retry_after_s`."""

    def __init__(self, cfg: ResponseCacheRedis, ttl_s: float, metrics: ResponseCacheMetrics):
        import redis.asyncio as aioredis  # the `redis` extra

        self.cfg = cfg
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.metrics = metrics
        self.client = aioredis.Redis.from_url(
            cfg.url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s
        )
        self.down_until = 0.0
        self.writes: set[asyncio.Task[None]] = set()

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def _failed(self, op: str, exc: BaseException) -> None:
        if self.up:
            log.warning(
                "response cache: Redis %s failed (%s); bypassing it for %g s",
                op,
                exc.__class__.__name__,
                self.cfg.retry_after_s,
            )
        self.down_until = time.monotonic() + self.cfg.retry_after_s
        self.metrics.store_errors.labels(op).inc()

    async def get(self, key: str) -> CachedAnswer | None:
        if not self.up:
            return None
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                data = await self.client.get(self.cfg.key_prefix + key)
        except Exception as exc:  # any failure of the store is a bypass
            self._failed("get", exc)
            return None
        return decode_answer(data) if isinstance(data, bytes) else None

    def put(self, key: str, answer: CachedAnswer) -> bool:
        """Stored in the background; False when the store is down or too many are pending."""
        if not self.up or len(self.writes) >= _MAX_PENDING_WRITES:
            return False
        task = asyncio.get_running_loop().create_task(self._set(key, encode_answer(answer)))
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)
        return True

    async def _set(self, key: str, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await self.client.set(self.cfg.key_prefix + key, data, px=self.ttl_ms)
        except Exception as exc:
            self._failed("set", exc)

    async def aclose(self) -> None:
        if self.writes:
            await asyncio.gather(*self.writes, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.client.aclose()


@dataclass(eq=False)
class _Flight:
    """A cacheable request on its way to the engine; identical ones wait for its answer."""

    done: asyncio.Future[tuple[CachedAnswer, RequestTrace] | None]
    waiting: int = 0


@dataclass(eq=False)
class CachePlan:
    """One cacheable request: its key and rule, and (when it went to the engine for the
    others) its flight."""

    key: str
    decision: CacheDecision
    flight: _Flight | None = None
    result: str = "miss"


MISS = object()


class ResponseCache:
    """The cache of one sidecar (built when `response_cache.enabled`)."""

    def __init__(self, config: Config, accounting: Accounting, registry: CollectorRegistry):
        cfg = config.response_cache
        self.cfg = cfg
        self.acct = accounting
        self.metrics = ResponseCacheMetrics(registry)
        self.modes = {p.name: p.response_cache for p in config.pools}
        self.partition = tuple(h.lower() for h in cfg.partition_headers)
        self.memory: MemoryStore | None = None
        self.redis: RedisStore | None = None
        if cfg.store == "redis":
            assert cfg.redis is not None
            self.redis = RedisStore(cfg.redis, cfg.ttl_s, self.metrics)
        else:
            self.memory = MemoryStore(cfg.max_bytes, cfg.ttl_s)
        self._flights: dict[str, _Flight] = {}
        self._evicted = (0, 0)

    # -- before the engine -----------------------------------------------------------------

    def plan(self, req: HttpRequest, ctx: RequestContext) -> CachePlan | None:
        """The request's key and rule, or None when the cache leaves it alone."""
        inference = ctx.inference
        if inference is None or inference.doc is None or ctx.kind not in ("chat", "completion"):
            return None
        decision = decide(
            inference.doc,
            self.modes.get(ctx.pool, "off"),
            parse_cache_control(req.header_all("cache-control")),
        )
        if not decision.cacheable:
            self.metrics.uncacheable.labels(ctx.pool, decision.reason).inc()
            return None
        tenant = ctx.routing.tenant if ctx.routing is not None else None
        partition = [",".join(req.header_all(h)) for h in self.partition]
        plan = CachePlan(cache_key(ctx.kind, tenant, partition, inference.doc), decision)
        if not decision.lookup:
            plan.result = "refresh"
        return plan

    async def lookup(self, req: HttpRequest, ctx: RequestContext, plan: CachePlan) -> Any:
        """Answer from the cache (a Reply, or None once streamed), or MISS: the request goes
        to the engine (as the flight others wait for, when it is the first)."""
        if not plan.decision.lookup:
            ctx.trace.response_cache = plan.result
            return MISS
        found = await self._get(plan)
        if found is not None:
            served = self.serve(req, ctx, plan, found, None, "hit")
            if served is not MISS:
                return served
        if self.cfg.coalesce:
            served = await self._coalesce(req, ctx, plan)
            if served is not MISS:
                return served
        if plan.decision.only_if_cached:
            self.metrics.lookups.labels(ctx.pool, "miss").inc()
            ctx.trace.response_cache = "miss"
            return self.acct.refuse(
                ctx,
                504,
                "Cache-Control: only-if-cached and no stored answer for this request",
                "not_cached",
            )
        self.metrics.lookups.labels(ctx.pool, plan.result).inc()
        ctx.trace.response_cache = plan.result
        return MISS

    async def _get(self, plan: CachePlan) -> CachedAnswer | None:
        max_age = plan.decision.max_age_s
        if self.memory is not None:
            found = self.memory.get(plan.key, time.time(), max_age)
            self._count_evictions()
            return found
        assert self.redis is not None
        found = await self.redis.get(plan.key)
        if found is None or found.age_s(time.time()) >= self.cfg.ttl_s:
            return None
        if max_age is not None and found.age_s(time.time()) > max_age:
            return None
        return found

    async def _coalesce(self, req: HttpRequest, ctx: RequestContext, plan: CachePlan) -> Any:
        """Wait for an identical request in flight, or become the one others wait for. Only
        a whole (non-streamed) request waits: its client waits for the whole answer anyway,
        while a streamed one would get its first token only when the other request's last
        came (its prompt is in that engine's prefix cache by then: asking it is cheap)."""
        loop = asyncio.get_running_loop()
        assert ctx.inference is not None
        while True:
            flight = self._flights.get(plan.key)
            if flight is None:
                plan.flight = self._flights[plan.key] = _Flight(loop.create_future())
                return MISS
            if ctx.inference.stream:
                return MISS  # a miss that goes to the engine beside the one in flight
            if flight.waiting >= self.cfg.max_waiters:
                plan.result = "bypass"
                return MISS
            left = _deadline(ctx) - loop.time()
            if left <= 0:
                plan.result = "bypass"
                return MISS
            flight.waiting += 1
            try:
                async with asyncio.timeout(left):
                    got = await asyncio.shield(flight.done)
            except TimeoutError:
                plan.result = "bypass"
                return MISS
            finally:
                flight.waiting -= 1
            if got is not None:
                answer, leader = got
                served = self.serve(req, ctx, plan, answer, leader, "coalesced")
                if served is not MISS:
                    return served
                plan.result = "bypass"  # it asked for a form this answer cannot give
                return MISS
            # The one in flight got no answer to share: the next waiter to wake leads.

    def serve(
        self,
        req: HttpRequest,
        ctx: RequestContext,
        plan: CachePlan,
        answer: CachedAnswer,
        leader: RequestTrace | None,
        result: str,
    ) -> Any:
        """The stored answer in the form the client asked for (MISS when it cannot be)."""
        inference = ctx.inference
        assert inference is not None
        body = render(answer, stream=inference.stream, include_usage=inference.include_usage)
        if body is None:
            return MISS
        trace = ctx.trace
        trace.response_cache = result
        gpu_s, usd = answer.gpu_seconds, answer.cost_usd
        if leader is not None and leader.finished:
            gpu_s, usd = repeat_cost(leader)
        trace.avoided_gpu_seconds, trace.avoided_usd = gpu_s, usd
        m, pool = self.metrics, ctx.pool
        m.lookups.labels(pool, result).inc()
        m.bytes_served.labels(pool).inc(len(body))
        m.gpu_seconds_avoided.labels(pool).inc(gpu_s)
        m.usd_avoided.labels(pool).inc(usd)
        usage = answer.usage or {}
        for phase in ("prompt", "completion"):
            n = usage.get(f"{phase}_tokens")
            if isinstance(n, int) and n > 0:
                m.tokens_avoided.labels(pool, phase).inc(n)
        age = int(answer.age_s(time.time()))
        headers = [
            ("content-type", "text/event-stream" if inference.stream else "application/json"),
            ("cache-status", f"meshd; {result if result == 'hit' else 'hit; detail=coalesced'}"),
            ("age", str(age)),
            ("x-request-id", ctx.request_id),
        ]
        loop = asyncio.get_running_loop()
        trace.ttft_s = loop.time() - ctx.started
        if not inference.stream:
            self.acct.finish(ctx, "ok", 200, answer.usage)
            return Reply(200, headers, body)
        headers.append(("cache-control", "no-cache"))
        out = req.stream(200, headers, hold_head=True)
        try:
            out.write(body)
            out.end()
        except ConnectionError:
            self.acct.finish(ctx, "client_disconnect")
            return None
        self.acct.finish(ctx, "ok", 200, answer.usage)
        return None

    # -- after the engine ----------------------------------------------------------------

    def capture_for(self, ctx: RequestContext) -> list[bytes] | None:
        """A list the relay appends a stream's bytes to, when its answer may be stored."""
        plan = ctx.cache
        if plan is None or not plan.decision.store:
            return None
        return []

    def offer(self, ctx: RequestContext, stream: bool, body: bytes | None, why_not: str) -> None:
        """The answer's last byte is out (body: the whole answer, or the stream's bytes), or
        it cannot be stored (why_not). Identical requests waiting are given it now; it is
        stored once its cost is known (after the accounting flush)."""
        plan = ctx.cache
        if plan is None or not plan.decision.store:
            return
        answer = None
        if not why_not:
            if body is None:
                why_not = "incomplete"
            elif len(body) > self.cfg.max_entry_bytes:
                why_not = "too_large"
            else:
                make = answer_from_stream if stream else answer_from_whole
                answer = make(ctx.kind, body, time.time())
                if answer is None:
                    why_not = "not_an_answer"
        if answer is None:
            self.metrics.not_stored.labels(ctx.pool, why_not).inc()
            self._land(plan, None)
            return
        self._land(plan, (answer, ctx.trace))
        asyncio.get_running_loop().call_soon(self._store, ctx, plan, answer)

    def _store(self, ctx: RequestContext, plan: CachePlan, answer: CachedAnswer) -> None:
        gpu_s, usd = repeat_cost(ctx.trace)  # finished by now: the accounting flush ran first
        answer = msgspec.structs.replace(answer, gpu_seconds=gpu_s, cost_usd=usd)
        if self.memory is not None:
            ok = self.memory.put(plan.key, answer)
            self._count_evictions()
        else:
            assert self.redis is not None
            ok = self.redis.put(plan.key, answer)
        if ok:
            self.metrics.stored.labels(ctx.pool, "stream" if answer.stream else "whole").inc()
        else:
            self.metrics.not_stored.labels(ctx.pool, "store_full_or_down").inc()

    def release(self, plan: CachePlan) -> None:
        """The request's tries are over: waiters not yet given an answer go on their own."""
        self._land(plan, None)

    def _land(self, plan: CachePlan, result: tuple[CachedAnswer, RequestTrace] | None) -> None:
        flight = plan.flight
        if flight is None:
            return
        plan.flight = None
        if self._flights.get(plan.key) is flight:
            del self._flights[plan.key]
        if not flight.done.done():
            flight.done.set_result(result)

    def _count_evictions(self) -> None:
        mem = self.memory
        assert mem is not None
        lru, ttl = self._evicted
        if mem.evictions != lru:
            self.metrics.evictions.labels("lru").inc(mem.evictions - lru)
        if mem.expired != ttl:
            self.metrics.evictions.labels("ttl").inc(mem.expired - ttl)
        self._evicted = (mem.evictions, mem.expired)
        self.metrics.entries.set(len(mem))
        self.metrics.bytes.set(mem.bytes)

    async def aclose(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()


def repeat_cost(trace: RequestTrace) -> tuple[float, float]:
    """GPU-seconds and dollars the engine would spend answering this request again: its
    prompt served from the prefix cache (it was just computed there), its answer decoded
    again (the cost ledger's timing model on the GPU that served it). What a replay avoids:
    not the first answer's cost, whose prefill a repeat would mostly not pay."""
    ledger = trace.observer.ledger
    prompt = trace.prompt_tokens or 0
    seconds = ledger.timing.gpu_seconds(trace.gpu, prompt, prompt, trace.completion_tokens or 0)
    return seconds, seconds * ledger.prices.per_second(trace.gpu)


def _deadline(ctx: RequestContext) -> float:
    """The loop time a waiter stops waiting: the request's own deadline (x-meshd-deadline-ms
    from a trusted peer), else its timeout."""
    deadline = ctx.deadline
    rh = ctx.routing
    if rh is not None and rh.deadline_ms is not None:
        deadline = min(deadline, ctx.started + rh.deadline_ms / 1000.0)
    return deadline
