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
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import msgspec

from filters.disagg import aggregated_body, decide_split, decode_body, prefill_body, transfer_params
from meshd.context import Plane, RequestContext
from meshd.upstream import UpstreamError

if TYPE_CHECKING:
    from filters.pool_router import Route
    from meshd.attempts import Attempts

_encoder = msgspec.json.Encoder()
# An answer to the prefill step larger than this is not one (it is one token).
_MAX_PREFILL_ANSWER = 1 << 20


class Disaggregator:
    def __init__(self, plane: Plane, attempts: Attempts) -> None:
        self.plane = plane
        self.attempts = attempts
        self.pools = {
            p.name: p.disaggregation for p in plane.config.pools if p.disaggregation is not None
        }

    def applies(self, ctx: RequestContext) -> bool:
        return ctx.pool in self.pools and ctx.inference is not None and ctx.pd is None

    async def prefill(self, ctx: RequestContext) -> None:
        """Decide, and when the request splits run its prefill step; on success the
        request's body becomes the decode step's."""
        cfg = self.pools[ctx.pool]
        assert cfg is not None and ctx.pick is not None and ctx.inference is not None
        doc = ctx.inference.doc
        if doc is None:
            return
        plane = self.plane
        source = cfg.prefill_pool
        now = time.monotonic()
        routes = plane.routers[source].order(ctx.pick, now)
        screened = self.attempts.screen(ctx, routes, pool=source).routes
        split = decide_split(
            ctx.pick.prompt_tokens,
            screened[0].cached_tokens if screened else None,
            min_prefill_tokens=cfg.min_prefill_tokens,
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            kv_link_gb_per_s=cfg.kv_link_gb_per_s,
            prefill_available=bool(screened),
        )
        ctx.pd = split
        if not split.split:
            plane.metrics.pd_requests.labels(ctx.pool, "whole", split.reason).inc()
            ctx.trace.pd = f"whole:{split.reason}"
            return
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
                return
        plane.metrics.pd_requests.labels(ctx.pool, "whole", "prefill-failed").inc()
        ctx.trace.pd = "whole:prefill-failed"

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
                chunks = []
                size = 0
                while chunk := await up.read():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > _MAX_PREFILL_ANSWER:
                        up.close()
                        raise UpstreamError(route.url, "the prefill answer is too large")
                up.release()
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
            answer = json.loads(b"".join(chunks))
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
    (a fresh prefill where it decodes). The simulator says so exactly (410, error type
    KVTransferError); a real vLLM ends such a request with an internal error, so a 5xx
    from a decode step counts too. Other 4xx are the client's to see."""
    if status == 410 or status >= 500:
        return True
    return status >= 400 and b'"kvtransfererror"' in body[:4096].lower()


def whole_body(ctx: RequestContext) -> bytes:
    """The request as the client sent it, without transfer params."""
    assert ctx.inference is not None and ctx.inference.doc is not None
    return _encoder.encode(aggregated_body(ctx.inference.doc))
