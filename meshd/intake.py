"""The request layer: a request's head and body become a `RequestContext`. Loop detection,
the concurrent-stream limit, the body (read whole, within limits.max_body_bytes and
client_body_timeout_s: meshd/listener.py), the OpenAI-shaped JSON (filters/request.py),
trust and the routing headers (`x-meshd-*` from an untrusted peer are stripped), the pool
for the model, and the prompt's block hashes when the policy uses them. Then the request is
admitted (meshd/admission_gate.py) and tried (meshd/attempts.py)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import aiohttp

from filters.chars_per_token import CharsPerToken, pick_inputs
from filters.hotpath import (
    block_hashes,
    parse_inference_request,
    parse_routing_headers,
    split_fields,
)
from filters.picker import PickRequest
from filters.request import PATH_KINDS, RequestError
from meshd.accounting import CACHE_LIMIT, Accounting
from meshd.admission_gate import AdmissionGate
from meshd.attempts import Attempts
from meshd.context import Plane, RequestContext
from meshd.fallback import Fallbacks
from meshd.http_message import BodyError, HttpRequest, Reply, json_reply
from meshd.relay import HOP_BY_HOP
from meshd.response_cache import MISS

if TYPE_CHECKING:
    from meshd.kv_events import PrecisePrefix

# Recomputed by the side that writes the body.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "content-encoding", "expect"}
VIA = "1.1 meshd"


class Intake:
    def __init__(
        self,
        plane: Plane,
        accounting: Accounting,
        gate: AdmissionGate,
        attempts: Attempts,
        *,
        precise: dict[str, PrecisePrefix],
        chars_per_token: CharsPerToken | None,
        intercepted_pool: Callable[[HttpRequest], str | None],
    ) -> None:
        self.plane = plane
        self.acct = accounting
        self.gate = gate
        self.attempts = attempts
        self.precise = precise
        self.chars_per_token = chars_per_token
        self._intercepted_pool = intercepted_pool
        self._trusted_nets = plane.config.trust.networks()
        # Per-request answers that depend only on the peer address or the model name, kept
        # (bounded) so the request path does not parse an address or match globs each time.
        self._trust_cache: dict[str, bool] = {}
        self._pool_cache: dict[str | None, str | None] = {}
        self.active = 0
        # meshd_active_requests reads the count when scraped, instead of a gauge inc and dec
        # (each a locked update) per request.
        plane.metrics.active_streams.set_function(lambda: self.active)
        self.session: aiohttp.ClientSession | None = None  # for /v1/models
        self.fallbacks = Fallbacks(plane, accounting, self._hash_prompt)

    async def inference(self, req: HttpRequest) -> Reply | None:
        """POST to an inference path: parsed, admitted, routed, relayed."""
        plane, acct = self.plane, self.acct
        started = asyncio.get_running_loop().time()
        kind = PATH_KINDS[req.path]
        intercepted = self._intercepted_pool(req)  # asked once: loop detection and pool
        if intercepted is not None and (rejected := self._loop_detected(req)) is not None:
            return rejected
        limit = plane.settings.max_concurrent_streams
        if self.active >= limit:
            return acct.reject(
                503,
                f"meshd is serving limits.max_concurrent_streams ({limit}) requests; retry shortly",
                "overloaded",
                retry_after_s=1,
            )
        self.active += 1
        try:
            try:
                body = req.ready_body() or await req.read_body()
            except BodyError as exc:
                return self._body_refused(exc)
            try:
                inference = parse_inference_request(kind, body)
            except RequestError as exc:
                return acct.reject(400, exc.message, exc.code, param=exc.param)
            trusted = self._is_trusted(req)
            routing, headers = parse_routing_headers(req.headers, trusted)
            if routing.stripped:
                plane.metrics.stripped_headers.inc(len(routing.stripped))
            if routing.errors:
                return acct.reject(400, "; ".join(routing.errors), "bad_routing_header")
            pool = intercepted if intercepted is not None else self._pool_for(inference.model)
            if pool is None:
                return acct.reject(
                    404,
                    f"The model `{inference.model}` does not exist: no pool serves it",
                    "model_not_found",
                    param="model",
                )
            ctx = RequestContext(
                kind, pool, started, trusted, req.method, req.target, inference, routing
            )
            if pool in self.fallbacks.chains:  # else a cap would change nothing
                bad_cap = self.fallbacks.cost_cap(ctx, headers)
                if bad_cap is not None:
                    return acct.reject(400, bad_cap, "bad_routing_header")
            self._hash_prompt(ctx)
            return await self._forward(req, ctx, headers, body)
        finally:
            self.active -= 1

    async def passthrough(self, req: HttpRequest) -> Reply | None:
        """Any other path goes to the chosen pool unchanged (e.g. /tokenize)."""
        intercepted = self._intercepted_pool(req)
        if intercepted is not None and (rejected := self._loop_detected(req)) is not None:
            return rejected
        try:
            body = req.ready_body() or await req.read_body()
        except BodyError as exc:
            return self._body_refused(exc)
        trusted = self._is_trusted(req)
        routing, headers = parse_routing_headers(req.headers, trusted)
        if routing.stripped:
            self.plane.metrics.stripped_headers.inc(len(routing.stripped))
        if routing.errors:
            return self.acct.reject(400, "; ".join(routing.errors), "bad_routing_header")
        pool = intercepted if intercepted is not None else self._pool_for(None)
        assert pool is not None
        started = asyncio.get_running_loop().time()
        ctx = RequestContext("other", pool, started, trusted, req.method, req.target)
        return await self._forward(req, ctx, headers, body)

    async def models(self, req: HttpRequest) -> Reply:
        """`/v1/models` merged across every pool's endpoints, first answer wins per id."""
        assert self.session is not None
        session = self.session
        config = self.plane.config
        timeout = aiohttp.ClientTimeout(total=min(10.0, config.upstream.first_byte_timeout_s))

        async def fetch(url: str) -> list[dict[str, Any]]:
            async with session.get(
                url + "/v1/models", timeout=timeout, headers={"via": VIA}
            ) as resp:
                if resp.status != 200:
                    return []
                doc = await resp.json(content_type=None)
                data = doc.get("data") if isinstance(doc, dict) else None
                return [m for m in data or [] if isinstance(m, dict) and "id" in m]

        urls = [ep.url for pool in config.pools for ep in pool.endpoints]
        results = await asyncio.gather(*(fetch(u) for u in urls), return_exceptions=True)
        merged: dict[str, dict[str, Any]] = {}
        for result in results:
            if isinstance(result, BaseException):
                continue
            for m in result:
                merged.setdefault(str(m["id"]), m)
        if not merged and all(isinstance(r, BaseException) for r in results):
            return self.acct.reject(502, "no endpoint answered /v1/models", "upstream_unavailable")
        return json_reply({"object": "list", "data": list(merged.values())})

    # -- the parts -------------------------------------------------------------------------

    def _body_refused(self, exc: BodyError) -> Reply:
        reply = exc.reply
        if reply.code is not None:
            self.plane.metrics.rejected.labels(reply.code).inc()
        return reply

    def _hash_prompt(self, ctx: RequestContext) -> None:
        """The prompt's block hashes, for the prefix-aware policies only: the engine's own
        (what its KV events name) where the precise path knows the model, else ours."""
        settings = self.plane.settings
        inference = ctx.inference
        if settings.routing_policy not in ("meshd", "cache-aware") or inference is None:
            return
        precise = self.precise.get(ctx.pool)
        engine_hashes = (
            None
            if precise is None or inference.doc is None
            else precise.block_hashes(inference.model, ctx.kind, inference.doc)
        )
        if engine_hashes is not None and precise is not None:
            ctx.block_hashes = engine_hashes
            ctx.tokens_per_block = precise.block_size(inference.model)
        else:
            ctx.block_hashes = block_hashes(
                inference.prompt_text,
                inference.model,
                settings.cache_salt,
                settings.block_size_bytes,
            )

    async def _forward(
        self,
        req: HttpRequest,
        ctx: RequestContext,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> Reply | None:
        """The request begins (its trace), is admitted when it has a prompt, and is tried;
        its admission slot is released when the tries end."""
        plane = self.plane
        ctx.upstream_headers = self._upstream_headers(headers, ctx)
        rh = ctx.routing
        ctx.obs = plane.observer.begin(
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
        ctx.deadline = ctx.started + plane.settings.request_timeout_s
        if rh is not None and rh.deadline_ms is not None:
            ctx.head_by = ctx.started + rh.deadline_ms / 1000.0
        cache = plane.cache
        plan = ctx.cache = None if cache is None else cache.plan(req, ctx)
        try:
            if plan is not None:
                assert cache is not None
                served = await cache.lookup(req, ctx, plan)
                if served is not MISS:
                    return served
            if ctx.pool in self.fallbacks.chains:
                return await self.fallbacks.serve(req, ctx, self._admit_and_try)
            return await self._admit_and_try(req, ctx)
        except asyncio.CancelledError:
            # The client left, or a drain ran out of time, before the answer was over
            # (queued, waiting for the engine's head, relaying): the trace ends as what it
            # was (a no-op where the relay has already ended it).
            self.acct.finish(ctx, "drain_timeout" if req.drained else "client_disconnect")
            raise
        finally:
            if plan is not None:
                assert cache is not None
                cache.release(plan)

    async def _admit_and_try(self, req: HttpRequest, ctx: RequestContext) -> Reply | None:
        plane = self.plane
        guard = plane.guards[ctx.pool]
        if ctx.inference is not None and ctx.routing is not None:
            cpt, tpb = pick_inputs(
                self.chars_per_token,
                ctx.inference.model,
                plane.settings.block_size_bytes,
                ctx.tokens_per_block,
            )
            ctx.pick = PickRequest.build(
                ctx.inference,
                ctx.routing,
                time.monotonic(),
                block_hashes=ctx.block_hashes,
                tokens_per_block=tpb,
                chars_per_token=cpt,
            )
            ctx.tokens = guard.expected_tokens(
                ctx.inference.model, ctx.pick.prompt_tokens, ctx.inference.max_tokens
            )
            refused = await self.gate.admit(ctx, guard)
            if refused is not None:
                return refused
        else:
            ctx.pick = PickRequest(model="")
        try:
            return await self.attempts.run(req, ctx)
        finally:
            self.gate.release(ctx)

    def _upstream_headers(
        self, headers: Iterable[tuple[str, str]], ctx: RequestContext
    ) -> list[tuple[str, str]]:
        """The client's headers without hop-by-hop ones (and those its Connection names),
        with an x-request-id (the client's, else a new one) and our Via appended."""
        out, connection, via, rid = split_fields(headers, _REQUEST_DROP, True)
        if rid is not None:
            ctx.request_id = rid
        if connection:
            # The fields the client's Connection names are hop-by-hop too (RFC 9110 7.6.1);
            # rare, so a second pass only then.
            tokens = {t.strip().lower() for value in connection for t in value.split(",")}
            out = [f for f in out if f[0].lower() not in tokens]
            if "via" in tokens:
                via = []
        if not ctx.request_id:
            ctx.request_id = request_id()
            out.append(("x-request-id", ctx.request_id))
        # RFC 9110 7.6.3: a proxy appends itself to the Via the request came with.
        via.append(VIA)
        out.append(("via", ", ".join(via)))
        return out

    def _is_trusted(self, req: HttpRequest) -> bool:
        remote = req.remote
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
            if len(cache) >= CACHE_LIMIT:
                cache.clear()
            cache[remote] = trusted
        return trusted

    def _loop_detected(self, req: HttpRequest) -> Reply | None:
        """A request meshd already relayed (intercepted: the caller asks only for those),
        intercepted again by our own rules: the sidecar's UID is not excluded from the
        REDIRECT. Refuse instead of looping."""
        if not any(VIA in v for v in req.header_all("via")):
            return None
        return self.acct.reject(
            508,
            "meshd intercepted its own upstream request: exclude the sidecar's UID from "
            "the iptables REDIRECT (meshd iptables --proxy-uid)",
            "loop_detected",
        )

    def _pool_for(self, model: str | None) -> str | None:
        """The pool serving `model` (an intercepted connection's pool is the caller's)."""
        cache = self._pool_cache
        if model in cache:
            return cache[model]
        pools = [p for p in self.plane.config.pools if p.role != "prefill"]
        if model is None:
            pool = pools[0].name if pools else None
        else:
            pool = next((p.name for p in pools if p.serves(model)), None)
        if len(cache) >= CACHE_LIMIT:
            cache.clear()
        cache[model] = pool
        return pool


def request_id() -> str:
    """A random UUID version 4 as 32 hex digits, the same as `uuid.uuid4().hex` without
    building a UUID object or reading os.urandom per request (a syscall, ~5 us): the bits
    come from a Mersenne Twister seeded from os.urandom once per process. Request ids
    name requests in logs and traces; they are not secrets."""
    return "%032x" % ((_ids.getrandbits(128) & _UUID4_CLEAR) | _UUID4_SET)


_ids = random.Random(os.urandom(32))
# RFC 9562 5.4: the version nibble (4) and the variant bits (0b10), as uuid.UUID sets them.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)
